"""Pure launcher planning: environment parsing, node plans, transports (no processes)."""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import sys

import pytest

from megatron_ext.run_spec.run_paths import check_run_name
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import load_run_params, with_batch_geometry
from orchestration.engines import ProgramPlan
from orchestration.launch_env import read_launch_env, visible_gpu_count
from orchestration.node.node_plan import NodePlan
from orchestration.runner.start_plan import build_start_plan
from orchestration.cluster.transports import docker_exec_argv, transport_argv

from conftest import REPO, clean_env


def test_one_node_defaults():
    launch = read_launch_env({}, visible_gpus=0)
    assert (launch.hosts, launch.nnodes, launch.node_rank, launch.nproc_per_node) == (("localhost",), 1, 0, 2)
    assert (launch.master_addr, launch.master_port, launch.zero_stage) == ("localhost", 6000, None)
    assert read_launch_env({}, visible_gpus=8).nproc_per_node == 8


def test_hosts_give_ranks_and_master(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode-a slots=8\n\nnode-b  # second\n")
    launch = read_launch_env({"HOSTFILE": str(hostfile)})
    assert launch.hosts == ("node-a", "node-b") and launch.nnodes == 2 and launch.master_addr == "node-a"
    launch = read_launch_env({"HOSTS": "a,b,c", "MASTER_ADDR": "10.0.0.1", "ZERO_STAGE": "2"})
    assert launch.nnodes == 3 and launch.master_addr == "10.0.0.1" and launch.zero_stage == 2


@pytest.mark.parametrize("env,message", [
    ({"HOSTS": "a,b,a"}, "host 'a' is listed twice (node ranks 0 and 2)"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 is outside NNODES=2"),
    ({"HOSTS": "a,b", "NNODES": "3"}, "NNODES=3 but 2 hosts are listed"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' must be an integer"),
    ({"ZERO_STAGE": "7"}, "ZERO_STAGE='7' is not a ZeRO stage"),
    ({"HOSTS": "a;rm -rf /"}, "has characters a host name cannot have"),
    ({"HOSTFILE": "/nonexistent/hosts"}, "HOSTFILE=/nonexistent/hosts does not exist"),
])
def test_bad_launch_env(env, message):
    with pytest.raises(UserError, match=None) as err:
        read_launch_env(env)
    assert message in str(err.value)


@pytest.mark.parametrize("run", ["has space", "semi;colon", "", "-dash", "a" * 200, "quote'", "$(x)"])
def test_bad_run_names(run):
    with pytest.raises(UserError, match="is not a valid run name"):
        check_run_name(run)


def _plan(env: dict, program_env: dict | None = None):
    launch = read_launch_env(env)
    params, geometry = with_batch_geometry(load_run_params("gpt_smoke", "smoke", launch.overrides), launch.world_size)
    program = ProgramPlan("megatron-core", ("-m", "megatron_ext.pretrain", "--run-name", "r1"), program_env or {})
    return build_start_plan(launch, params, geometry, program, "r1", "r1-abc", list(enumerate(launch.hosts)),
                            "/usr/bin/python3", "/work")


def test_node_plans_fix_node_rank_and_forward_environment():
    env = {"HOSTS": "n0,n1", "NPROC_PER_NODE": "8", "ZERO_STAGE": "1", "NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth0",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTHONPATH": "/x",
           "MEGATRON_LM_DIR": "/m", "PATH": "/bin", "VIRTUAL_ENV": "/venv", "CONDA_PREFIX": "/c", "HOME": "/root", "SECRET": "no",
           "ARTIFACT_ROOT": "/shared/art", "global_batch": "ignored"}
    plan = _plan(env, {"CUDA_DEVICE_MAX_CONNECTIONS": None})
    assert [p.node_rank for p in plan.nodes] == [0, 1] and plan.run_id == "r1-abc"
    assert plan.geometry.describe() == "micro 4 x dp 16 x accumulation 2 = global 128"  # smoke: 2 micro-batches per replica
    for p in plan.nodes:
        argv = list(p.argv)
        assert argv[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
        assert argv[argv.index("--node-rank") + 1] == str(p.node_rank)
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--master-addr") + 1] == "n0"
        assert "--rdzv-backend" not in argv  # static rendezvous: ranks follow --node-rank
        assert p.env["NODE_RANK"] == str(p.node_rank) and p.env["ARTIFACT_ROOT"] == "/shared/art"
        assert (p.env["LAUNCHER_RUN"], p.env["LAUNCHER_RUN_ID"], p.env["LAUNCHER_NODE_RANK"]) == ("r1", "r1-abc", str(p.node_rank))
        assert p.log_path == f"/shared/art/logs/r1_node{p.node_rank}.log" and p.pid_path.endswith(f"run_state/r1_node{p.node_rank}.pid")
        for key in ("NCCL_IB_HCA", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "PYTHONPATH", "MEGATRON_LM_DIR", "PATH", "VIRTUAL_ENV", "CONDA_PREFIX"):
            assert p.env[key] == env[key]
        assert "HOME" not in p.env and "SECRET" not in p.env
        # The program's stage environment wins over a forwarded variable: Megatron-FSDP needs it unset.
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in p.env and p.unset == ("CUDA_DEVICE_MAX_CONNECTIONS",)
        assert p.process_environment({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "HOME": "/h"}) == {"HOME": "/h", **p.env}
        assert NodePlan.from_json(p.to_json()) == p
    assert plan.resolved.runtime.world_size == 16 and plan.resolved.params.training.global_batch_size == 128


def test_ssh_transport_quotes_everything():
    launch = read_launch_env({"HOSTS": "n0,n1", "SSH_OPTS": "-F /tmp/cfg -p 2222"})
    argv = transport_argv(launch, "n1", ["python", "-m", "x", "it's"], {"A": "1 2"}, "/work dir")
    assert argv[:6] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-F"]
    assert argv[-3:-1] == ["n1", "--"]
    assert shlex.split(argv[-1]) == ["cd", "/work dir", "&&", "exec", "env", "A=1 2", "python", "-m", "x", "it's"]
    assert transport_argv(launch, "localhost", ["python"], {}, "/") == ["python"]


def test_docker_transport_local_and_over_ssh():
    launch = read_launch_env({"HOSTS": "localhost,n1", "CONTAINER_NAME": "megatron-training"})
    local = transport_argv(launch, "localhost", ["python", "-m", "x"], {"A": "1"}, "/w")
    assert local == ["docker", "exec", "-w", "/w", "-e", "A=1", "megatron-training", "python", "-m", "x"]
    remote = transport_argv(launch, "n1", ["python", "-m", "x"], {"A": "1"}, "/w")
    assert remote[:2] == ["ssh", "-o"] and shlex.split(remote[-1]) == local
    assert docker_exec_argv("c", ["true"], {}, "/") == ["docker", "exec", "-w", "/", "c", "true"]


def test_visible_gpus(tmp_path):
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpu_count({}, dev_dir=tmp_path) == 2


def test_dry_run_prints_one_json_line_per_node_and_starts_nothing(tmp_path):
    key, token = secrets.token_hex(20), secrets.token_hex(16)
    env = clean_env(DRY_RUN="1", HOSTS="node0,node1", ARTIFACT_ROOT=str(tmp_path), ZERO_STAGE="3", GLOO_SOCKET_IFNAME="eth0",
                    WANDB_API_KEY=key, HF_TOKEN=token, WANDB_PROJECT="p")
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", "gpt_smoke", "smoke", "dry"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(l) for l in proc.stdout.splitlines()]
    assert [(l["node_rank"], l["host"]) for l in lines] == [(0, "node0"), (1, "node1")]
    assert set(lines[0]) == {"run", "run_id", "node_rank", "host", "argv", "env", "unset", "cwd", "log_path", "pid_path",
                             "engine", "resilience", "first_attempt", "save_signal", "secret_names"}
    # Secrets are named, never shown: the plan says which variables the ranks get, not their values.
    assert lines[0]["secret_names"] == ["HF_TOKEN", "WANDB_API_KEY"] and lines[0]["env"]["WANDB_PROJECT"] == "p"
    assert key not in proc.stdout + proc.stderr and token not in proc.stdout + proc.stderr
    assert lines[0]["resilience"]["max_restarts"] == 0 and lines[0]["first_attempt"] == 1
    argv = lines[1]["argv"]
    assert argv[argv.index("--zero-stage") + 1] == "3" and lines[1]["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert lines[1]["env"]["ARTIFACT_ROOT"] == str(tmp_path) and lines[1]["unset"] == ["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert not (tmp_path / "run_state").exists() and not (tmp_path / "logs").exists()


def test_setup_decides_by_metadata_and_never_replaces():
    from orchestration.setup_env import plan_installs

    commands, _ = plan_installs((3, 12), None, None, None)
    assert commands == [["install", "torch==2.13.0"], ["install", "--no-deps", "megatron-core==0.19.2"],
                        ["install", "packaging>=24.2", "einops", "pyyaml"]]
    assert plan_installs((3, 11), "2.13.0", None, None)[0][0] == ["install", "--no-deps", "megatron-core==0.16.1"]
    # An installed release that fails to import only for a missing small package keeps its release.
    commands, messages = plan_installs((3, 12), "2.13.0", "0.19.2", ModuleNotFoundError("no packaging", name="packaging"))
    assert commands == [["install", "packaging>=24.2"]] and "keeping megatron-core 0.19.2" in messages[-1]
    commands, messages = plan_installs((3, 12), "2.11.0", "0.19.2", ImportError("libcudart.so.13: cannot open"))
    assert commands == [] and messages[-1].startswith("error: megatron-core 0.19.2 is installed but does not import")
    assert plan_installs((3, 12), "2.11.0+cu130", "0.16.1", None)[0] == []  # a container's builds stay
