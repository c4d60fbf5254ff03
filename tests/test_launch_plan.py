"""Pure launcher planning: environment parsing, node plans settled by the preflight's answers (given
as data), backends (no processes)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.run_spec.run_paths import RunPaths, check_run_name
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.resilience import PauseSchedule
from orchestration.cluster.backends import DockerExec, Srun, Ssh, ThisMachine, backend_for
from orchestration.launch_env import read_launch_env, visible_gpu_count
from orchestration.node.wire import NodePlan, NodeReport
from orchestration.runner.preflight import cluster_problems
from orchestration.runner.start_plan import plan_start, read_start_inputs

from conftest import REPO, clean_env


def test_one_node_defaults():
    launch = read_launch_env({}, visible_gpus=0)
    assert (launch.hosts, launch.nnodes, launch.node_rank, launch.nproc_per_node) == (("localhost",), 1, 0, 2)
    assert (launch.master_addr, launch.master_port, launch.zero_stage) == ("localhost", 6000, None)
    assert read_launch_env({}, visible_gpus=8).nproc_per_node == 8


def test_link_test_seconds_reach_every_node_s_call():
    """LINK_TEST_S becomes node-linktest's seconds; unset, the node keeps its own default. The node
    reads the same typed request the launcher wrote (one JSON argument)."""
    from orchestration.node.commands import build_node_parser
    from orchestration.node.wire import LinktestRequest, NodeTarget, decode_request, node_call

    assert read_launch_env({}).link_test_s is None and read_launch_env({"LINK_TEST_S": "0.3"}).link_test_s == 0.3
    for seconds in (None, 0.3):
        call = node_call(LinktestRequest(target=NodeTarget("r1", 1, "node1", Path("/art")), nnodes=2, master_addr="10.0.0.1",
                                         port=6001, backend="gloo", interface="eth0", seconds=seconds))
        args = build_node_parser().parse_args([call.command, *call.args])
        request = decode_request(args.command, args.request)
        assert request.seconds == seconds and (request.target.node_rank, request.interface) == (1, "eth0")


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
    ({"LINK_TEST_S": "0"}, "LINK_TEST_S='0' must be seconds between 0.1 and 60; e.g. LINK_TEST_S=1.5"),
    ({"LINK_TEST_S": "nan"}, "LINK_TEST_S='nan' must be seconds between 0.1 and 60"),
    ({"LINK_TEST_S": "fast"}, "LINK_TEST_S='fast' must be seconds between 0.1 and 60"),
])
def test_bad_launch_env(env, message):
    with pytest.raises(UserError, match=None) as err:
        read_launch_env(env)
    assert message in str(err.value)


@pytest.mark.parametrize("given,blocked,what", [
    ("file", "file", "is a file"),
    ("file/runs", "file", "is under {tmp}/file, which is a file"),
    ("dangling/runs", "dangling", "is under {tmp}/dangling, which is a link to {tmp}/gone, which does not exist"),
    ("/dev/null", "/dev/null", "is not a directory"),
])
def test_an_artifact_root_where_no_directory_can_be_is_refused_by_every_command(tmp_path, given, blocked, what):
    """At the one read of ARTIFACT_ROOT, before any command (start, stop, status, export, ...) looks
    under it: the value, the rule, the fix; nothing made."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    root = given if given.startswith("/") else str(tmp_path / given)
    with pytest.raises(UserError) as refused:
        read_launch_env({"ARTIFACT_ROOT": root})
    assert str(refused.value) == (
        f"ARTIFACT_ROOT={root} {what.format(tmp=tmp_path)}; the artifact root must be a directory (every run's logs, run "
        f"state and checkpoints go under it): set ARTIFACT_ROOT to a directory (e.g. ARTIFACT_ROOT=$HOME/runs), or unset "
        f"it for {REPO / 'artifacts'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file"]
    assert read_launch_env({"ARTIFACT_ROOT": str(tmp_path / "new" / "root")}).artifact_root == tmp_path / "new" / "root"


def test_a_start_refuses_an_artifact_root_it_cannot_write(tmp_path):
    """A start (and train, preflight, submit, the sweep, their dry runs) needs to write there: where no
    folder can be made it is refused before anything starts, and the probe leaves nothing behind."""
    with pytest.raises(UserError, match=r"^ARTIFACT_ROOT=/proc/no_such_root cannot be made: /proc takes no new folder \("
                                        r".*; a start writes every run's logs, run state and checkpoints under it: set "
                                        r"ARTIFACT_ROOT to a directory this machine can write"):
        _inputs({"ARTIFACT_ROOT": "/proc/no_such_root"}, tmp_path)
    launch, inputs = _inputs({"ARTIFACT_ROOT": str(tmp_path / "new" / "root")}, tmp_path)
    assert inputs.run == "r1" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["status", "r1"], ["stop", "r1", "--this-node"], ["check-checkpoints", "r1"]])
def test_stop_and_status_under_a_file_say_so(tmp_path, monkeypatch, capsys, command):
    from orchestration import cli

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("ARTIFACT_ROOT", str(tmp_path / "file"))
    assert cli.main(command) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: ARTIFACT_ROOT={tmp_path / 'file'} is a file; ") and err.count("\n") == 1


@pytest.mark.parametrize("run", ["has space", "semi;colon", "", "-dash", "a" * 200, "quote'", "$(x)"])
def test_bad_run_names(run):
    with pytest.raises(UserError, match="is not a valid run name"):
        check_run_name(run)


def _inputs(env: dict, tmp_path, data: str = "smoke"):
    launch = read_launch_env({"ARTIFACT_ROOT": str(tmp_path), **env}, python="/usr/bin/python3", cwd="/work")
    return launch, read_start_inputs(launch, "gpt_smoke", data, "r1", list(enumerate(launch.hosts)))


def test_node_plans_fix_node_rank_and_forward_environment(tmp_path):
    env = {"HOSTS": "n0,n1", "NPROC_PER_NODE": "8", "ZERO_STAGE": "2", "NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "eth0",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTHONPATH": "/x",
           "MEGATRON_LM_DIR": "/m", "PATH": "/bin", "VIRTUAL_ENV": "/venv", "CONDA_PREFIX": "/c", "HOME": "/root", "SECRET": "no",
           "ARTIFACT_ROOT": str(tmp_path / "shared" / "art"), "global_batch": "ignored"}
    launch, inputs = _inputs(env, tmp_path)
    plan = plan_start(launch, inputs)
    assert [p.node_rank for p in plan.nodes] == [0, 1] and plan.run_id == inputs.run_id
    assert plan.geometry.describe() == "micro 4 x dp 16 x accumulation 2 = global 128"  # smoke: 2 micro-batches per replica
    for p in plan.nodes:
        argv = list(p.argv)
        assert argv[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
        assert argv[argv.index("--node-rank") + 1] == str(p.node_rank)
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--master-addr") + 1] == "n0"
        assert "--rdzv-backend" not in argv  # static rendezvous: ranks follow --node-rank
        assert p.env["NODE_RANK"] == str(p.node_rank) and p.env["ARTIFACT_ROOT"] == str(tmp_path / "shared" / "art")
        assert (p.env["LAUNCHER_RUN"], p.env["LAUNCHER_RUN_ID"], p.env["LAUNCHER_NODE_RANK"]) == ("r1", plan.run_id, str(p.node_rank))
        assert p.log_path == f"{tmp_path}/shared/art/logs/r1_node{p.node_rank}.log"
        assert p.pid_path.endswith(f"run_state/r1_node{p.node_rank}.pid")
        for key in ("NCCL_IB_HCA", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "PYTHONPATH", "MEGATRON_LM_DIR", "PATH", "VIRTUAL_ENV", "CONDA_PREFIX"):
            assert p.env[key] == env[key]
        assert "HOME" not in p.env and "SECRET" not in p.env
        # The program's stage environment wins over a forwarded variable: Megatron-FSDP needs it unset.
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in p.env and p.unset == ("CUDA_DEVICE_MAX_CONNECTIONS",)
        assert p.process_environment({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "HOME": "/h"}) == {"HOME": "/h", **p.env}
        assert NodePlan.from_json(p.to_json()) == p
        assert p.resets_run_state == (p.node_rank == 0)
    assert plan.resolved.runtime.world_size == 16 and plan.resolved.params.training.global_batch_size == 128
    assert [s.name for s in plan.steps] == ["write-params", "start-nodes"]


def test_the_plan_carries_the_pause_schedule_and_one_checkpoint_s_size(tmp_path):
    """[issue 54] What the supervisor's watchdog allows a save for: when the run saves and evaluates
    (the Megatron-LM log watch), and how large one checkpoint is before any exists (a fresh start's first
    save): Qwen3-32B's is about 450 GB, 30 minutes more at 250 MB/s."""
    launch = read_launch_env({"ARTIFACT_ROOT": str(tmp_path), "HOSTS": "n0,n1,n2,n3", "NPROC_PER_NODE": "8"},
                             python="/usr/bin/python3", cwd="/work")
    inputs = read_start_inputs(launch, "qwen3_32b", "qwen3_1p7b_gbs2048", "r1", list(enumerate(launch.hosts)))
    node = plan_start(launch, inputs).nodes[3]
    assert node.pauses == PauseSchedule(save_interval=100, train_iters=inputs.params.training.train_iters, eval_interval=100)
    assert 450e9 < node.checkpoint_bytes < 470e9  # 32.8e9 parameters x 14 bytes
    assert node.initial_weights == ""  # random weights: nothing to load before the first step

    def initial(model=None, **training):  # what a fresh start loads first: the setup limit allows for its size
        params = inputs.params
        params = dataclasses.replace(params, training=dataclasses.replace(params.training, **training),
                                     model=dataclasses.replace(params.model, **(model or {})))
        return plan_start(launch, dataclasses.replace(inputs, params=params)).nodes[0].initial_weights
    assert initial(init_checkpoint="/shared/lm_save") == "/shared/lm_save"
    assert initial({"hf_checkpoint": "/shared/Qwen3-32B"}) == "/shared/Qwen3-32B"
    assert initial({"hf_checkpoint": "/shared/Qwen3-32B"}, init="random") == ""
    assert NodePlan.from_json(node.to_json()) == node


def test_the_plan_holds_the_supervisor_s_variables_with_the_rule_for_later_attempts(tmp_path):
    launch, inputs = _inputs({}, tmp_path)
    node = plan_start(launch, inputs, [NodeReport(node_rank=0, host="localhost", local_dir="/dev/shm", free_port=6000)]).nodes[0]
    assert node.env["LAUNCHER_ATTEMPT"] == "1" and node.per_attempt == {"LAUNCHER_ATTEMPT": node.per_attempt["LAUNCHER_ATTEMPT"]}
    assert node.env["LAUNCHER_PROGRESS_DIR"] == f"/dev/shm/megatron_ext_{inputs.run_id}_node0"
    assert node.env["TORCH_FR_BUFFER_SIZE"] == "2000"  # the flight recorder the hang dumps read
    assert node.process_environment({}, attempt=3)["LAUNCHER_ATTEMPT"] == "3"
    # A flight-recorder size of the user's own stays theirs.
    launch, inputs = _inputs({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}, tmp_path)
    assert "TORCH_FR_BUFFER_SIZE" not in plan_start(launch, inputs).nodes[0].env


def test_the_plan_settles_on_the_preflight_answers(tmp_path):
    """The preflight's answers are data: node 0's free port, each node's interface and local directory."""
    launch, inputs = _inputs({"HOSTS": "n0,n1"}, tmp_path)
    unsettled = plan_start(launch, inputs)
    assert not unsettled.settled and unsettled.master_port == 6000 and "not asked" in unsettled.notes[-1]
    answers = [NodeReport(node_rank=0, host="n0", free_port=6003, interface="eth1", local_dir="/run/shm"),
               NodeReport(node_rank=1, host="n1", interface="ib0", local_dir="/tmp")]
    plan = plan_start(launch, inputs, answers)
    assert plan.settled and plan.master_port == 6003 and plan.run_id == unsettled.run_id
    for node, ifname, local in zip(plan.nodes, ("eth1", "ib0"), ("/run/shm", "/tmp")):
        assert node.argv[node.argv.index("--master-port") + 1] == "6003" and node.env["MASTER_PORT"] == "6003"
        assert node.env["GLOO_SOCKET_IFNAME"] == node.env["NCCL_SOCKET_IFNAME"] == ifname
        assert node.env["LAUNCHER_PROGRESS_DIR"].startswith(f"{local}/megatron_ext_{inputs.run_id}_node")
    assert any("using 6003, the first free port from 6000 on node 0" in n for n in plan.notes)
    assert any("node0 eth1, node1 ib0" in n for n in plan.notes)
    # What the user set stays: an explicit port, and an interface variable given (the other is still settled).
    launch, inputs = _inputs({"HOSTS": "n0,n1", "MASTER_PORT": "7000", "GLOO_SOCKET_IFNAME": "eth9"}, tmp_path)
    plan = plan_start(launch, inputs, answers)
    assert plan.master_port == 7000 and [n.env["GLOO_SOCKET_IFNAME"] for n in plan.nodes] == ["eth9", "eth9"]
    assert [n.env["NCCL_SOCKET_IFNAME"] for n in plan.nodes] == ["eth1", "ib0"]
    # One node: no interface is settled (loopback), the port still is.
    launch, inputs = _inputs({}, tmp_path)
    plan = plan_start(launch, inputs, [NodeReport(node_rank=0, host="localhost", free_port=6001, interface="lo")])
    assert plan.master_port == 6001 and "GLOO_SOCKET_IFNAME" not in plan.nodes[0].env


def test_nnodes_min_max_is_checked_for_every_node_count_before_anything_starts(tmp_path):
    """NNODES=MIN:MAX: the global batch must divide at every node count from MIN to MAX (a run that
    loses nodes keeps it), and the stage's checkpoint must reshard; the program gets the global batch."""
    launch, inputs = _inputs({"HOSTS": "a,b,c", "NNODES": "2:3", "NPROC_PER_NODE": "2"}, tmp_path, "smoke")
    assert inputs.params.training.resilience.min_nodes == 2
    node = plan_start(launch, inputs).nodes[0]
    assert node.argv[node.argv.index("--global-batch-size") + 1] == str(inputs.params.training.global_batch_size)
    assert node.per_attempt["NNODES"].startswith("the nodes of the attempt")
    tmp = tmp_path / "odd.yaml"
    tmp.write_text("data: {source: embedded, tokenizer: {type: sentencepiece, vocab_size: 2048}}\n"
                   "training: {micro_batch_size: 4, global_batch_size: 24}\n")
    with pytest.raises(UserError, match=r"NNODES=2:3: the global batch 24 does not divide into micro-batches of 4 on 2 "
                                        r"node\(s\) x 2 processes.*\(e\.g\. 48\)"):
        _inputs({"HOSTS": "a,b,c", "NNODES": "2:3", "NPROC_PER_NODE": "2"}, tmp_path, str(tmp))
    with pytest.raises(UserError, match=r"ZERO_STAGE=1: the CPU path's stage-1 checkpoints.*use ZERO_STAGE=0 or 2 or 3"):
        _inputs({"HOSTS": "a,b", "NNODES": "1:2", "ZERO_STAGE": "1"}, tmp_path)
    launch, inputs = _inputs({"HOSTS": "a,b"}, tmp_path)  # without MIN: every node, nothing elastic
    assert inputs.params.training.resilience.min_nodes == 0 and "--global-batch-size" not in plan_start(launch, inputs).nodes[0].argv


def test_cluster_problems_put_every_node_s_problems_and_differing_software_in_one_list():
    base = {"torch": "2.13.0", "megatron-core": "0.16.1", "project": "abc"}
    reports = [NodeReport(node_rank=0, host="n0", problems=["MASTER_PORT=6000 is in use"], software=base),
               NodeReport(node_rank=1, host="n1", problems=[], software={**base, "megatron-core": "0.15.3"}),
               NodeReport(node_rank=2, host="n2", problems=["/data/x does not exist"], software={**base, "project": None})]
    assert cluster_problems(reports) == [
        (0, "n0", "MASTER_PORT=6000 is in use"),
        (1, "n1", "megatron-core 0.15.3 here but 0.16.1 on node 0; every node needs the same megatron-core"),
        (2, "n2", "/data/x does not exist"),
        (2, "n2", "project absent here but abc on node 0; every node needs the same project"),
    ]


def test_one_backend_per_way_of_reaching_the_nodes():
    assert backend_for(read_launch_env({})) == ThisMachine() and ThisMachine().in_process("localhost")
    launch = read_launch_env({"HOSTS": "localhost,n1", "SSH_OPTS": "-p 2222"})
    ssh = backend_for(launch)
    assert ssh == Ssh(options=("-p", "2222")) and ssh.in_process("localhost") and not ssh.in_process("n1")
    assert backend_for(launch, [(0, "localhost")]) == ThisMachine()  # the nodes a command reaches decide
    docker = backend_for(read_launch_env({"HOSTS": "localhost,n1", "CONTAINER_NAME": "c"}))
    assert docker == DockerExec(container="c") and not docker.in_process("localhost") and not docker.caller_sets_env
    srun = backend_for(read_launch_env({"SLURM_JOB_ID": "42"}, slurm_hosts=("c1", "c2")))
    assert srun == Srun(job_id="42") and srun.caller_sets_env and srun.fixed_nodes and srun.records_only
    assert srun.plan("c2", ["true"], {}, "/w")[:3] == ["srun", "--jobid=42", "--overlap"]
    assert "--nodelist=c2" in srun.plan("c2", ["true"], {}, "/w")
    inside = Srun(job_id="42", container="c").plan("c2", ["true"], {"A": "1"}, "/w")
    assert inside[-8:] == ["docker", "exec", "-w", "/w", "-e", "A=1", "c", "true"]  # CONTAINER_NAME inside srun


def test_ssh_backend_quotes_everything():
    ssh = backend_for(read_launch_env({"HOSTS": "n0,n1", "SSH_OPTS": "-F /tmp/cfg -p 2222"}))
    argv = ssh.plan("n1", ["python", "-m", "x", "it's"], {"A": "1 2"}, "/work dir")
    assert argv[:10] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15", "-o",
                         "ServerAliveCountMax=4", "-F"]
    assert argv[-3:-1] == ["n1", "--"]
    assert shlex.split(argv[-1]) == ["cd", "/work dir", "&&", "exec", "env", "A=1 2", "python", "-m", "x", "it's"]
    assert ssh.plan("localhost", ["python"], {}, "/") == ["python"]


def test_docker_backend_local_and_over_ssh():
    docker = backend_for(read_launch_env({"HOSTS": "localhost,n1", "CONTAINER_NAME": "megatron-training"}))
    local = docker.plan("localhost", ["python", "-m", "x"], {"A": "1"}, "/w")
    assert local == ["docker", "exec", "-w", "/w", "-e", "A=1", "megatron-training", "python", "-m", "x"]
    remote = docker.plan("n1", ["python", "-m", "x"], {"A": "1"}, "/w")
    assert remote[:2] == ["ssh", "-o"] and shlex.split(remote[-1]) == local
    assert DockerExec(container="c").plan("localhost", ["true"], {}, "/", stdin=True) == ["docker", "exec", "-i", "-w", "/", "c", "true"]


def test_visible_gpus(tmp_path):
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpu_count({}, dev_dir=tmp_path) == 2


def test_dry_run_prints_the_plan_and_one_json_line_per_node_and_starts_nothing(tmp_path):
    key, token = secrets.token_hex(20), secrets.token_hex(16)
    env = clean_env(DRY_RUN="1", HOSTS="node0,node1", ARTIFACT_ROOT=str(tmp_path), ZERO_STAGE="3", GLOO_SOCKET_IFNAME="eth0",
                    WANDB_API_KEY=key, HF_TOKEN=token, WANDB_PROJECT="p")
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", "gpt_smoke", "smoke", "dry"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    header, *lines = [json.loads(l) for l in proc.stdout.splitlines()]
    assert header["plan"]["settled"] is False  # node0 and node1 do not resolve here: nobody answered
    assert "did not answer the preflight" in proc.stderr
    assert [(l["node_rank"], l["host"]) for l in lines] == [(0, "node0"), (1, "node1")]
    assert set(lines[0]) == {"run", "run_id", "node_rank", "host", "nnodes", "nproc_per_node", "master_addr", "master_port",
                             "argv", "env", "unset", "cwd", "log_path", "pid_path",
                             "engine", "resilience", "first_attempt", "save_signal", "secret_names", "per_attempt",
                             "resets_run_state", "resume_args", "checkpoint_choice", "hosts", "first_members", "rejoin",
                             "restart_exclude", "pauses", "checkpoint_bytes", "initial_weights"}
    # Secrets are named, never shown: the plan says which variables the ranks get, not their values.
    assert lines[0]["secret_names"] == ["HF_TOKEN", "WANDB_API_KEY"] and lines[0]["env"]["WANDB_PROJECT"] == "p"
    assert key not in proc.stdout + proc.stderr and token not in proc.stdout + proc.stderr
    assert lines[0]["resilience"]["max_restarts"] == 0 and lines[0]["first_attempt"] == 1
    # this data set keeps no checkpoints, and evaluates once, at the end
    assert lines[0]["pauses"]["save_interval"] == 0 and lines[0]["pauses"]["eval_interval"] == 30
    assert lines[0]["checkpoint_bytes"] == 0
    argv = lines[1]["argv"]
    assert (lines[1]["nnodes"], lines[1]["env"]["NNODES"], argv[argv.index("--nnodes") + 1]) == (2, "2", "2")  # one value
    assert argv[argv.index("--zero-stage") + 1] == "3" and lines[1]["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert lines[1]["env"]["ARTIFACT_ROOT"] == str(tmp_path) and lines[1]["unset"] == ["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, the preflight's token removed


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


def test_the_link_table_times_an_nccl_all_reduce_per_neighbour_pair_or_says_it_skipped():
    """NCCL: one 256 MB all-reduce per pair of ring neighbours (each pair a process group every
    node creates in the same order); gloo: skipped, said under the table."""
    from orchestration.node.linktest import ring_pairs
    from orchestration.node.wire import LinkReport
    from orchestration.runner.links import format_links, link_rows

    assert ring_pairs(1) == [] and ring_pairs(2) == [(0, 1)] and ring_pairs(4) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    gpus = [LinkReport(node_rank=0, host="g0", rates_gbs={"1": 40.0}, transport="NET/IB", allreduce_s={"1": 0.0125}),
            LinkReport(node_rank=1, host="g1", rates_gbs={"0": 41.0}, transport="NET/IB", allreduce_s={"0": 0.0127})]
    assert format_links(link_rows(gpus)).splitlines()[-1] == "one 256 MB NCCL all-reduce per neighbour pair: node0-node1 12.7 ms"
    cpus = [LinkReport(node_rank=0, host="c0", rates_gbs={"1": 0.4}, transport="TCP (gloo)"),
            LinkReport(node_rank=1, host="c1", rates_gbs={"0": 0.4}, transport="TCP (gloo)")]
    assert format_links(link_rows(cpus)).splitlines()[-1].endswith("skipped (gloo: no GPUs)")


def test_nnodes_min_max_leaves_out_the_nodes_the_preflight_refused_while_enough_are_left():
    from orchestration.runner.preflight import Preflight, leave_out

    bad = Preflight((), ((2, "g2", "GPU 3: 2 uncorrected ECC errors; reset it"), (3, "g3", "MASTER_ADDR=... loopback")), True)
    kept, left = leave_out(bad, 2, 4)
    assert kept.problems == () and left == bad.problems  # 2 of 4 left: enough for MIN 2
    assert leave_out(bad, 3, 4) == (bad, ())  # too few left: the start refuses
    assert leave_out(bad, None, 4) == (bad, ())  # NNODES=4: every node or none
    on_node0 = Preflight((), ((0, "g0", "MASTER_PORT=6000 is in use"),), True)
    assert leave_out(on_node0, 1, 4) == (on_node0, ())  # node 0 leads: never left out
    unanswered = Preflight((), ((2, "g2", "no answer"),), False)
    assert leave_out(unanswered, 1, 4) == (unanswered, ())  # unsettled: a start stops there


# -- a start under Slurm, judged from the nodes' records ----------------------------------------------

def _status(rank: int, exit: str | None = None):
    from orchestration.node.run_state import RunState
    from orchestration.node.wire import NodeStatus

    return NodeStatus(node_rank=rank, host=f"n{rank}", alive=exit is None, state=RunState.FINISHED if exit else RunState.RUNNING,
                      exit=exit, run_failure=None, pid=None, last_iteration=None, train_iters=None, tokens_per_s=None,
                      last_line="", log="")


def test_a_heartbeat_record_that_stops_changing_ends_its_node_after_the_margin():
    """By the reader's clock alone (a fake one here): node 0's counter goes up every 2 s, node 1's
    stopped at 7 (its supervisor SIGKILLed); node 1 is alive until its counter has been still for
    the margin, then failed with the reason, and the wait's end is a failure."""
    from orchestration.node.run_state import Heartbeat, RunState
    from orchestration.runner.control import RunEnd
    from orchestration.runner.record_beats import RecordBeats

    beats = RecordBeats(run_id="start2", since=100.0, silence_s=90.0)
    for t in range(100, 300, 2):
        beats.observe(0, Heartbeat(1, RunState.RUNNING, beat=t, run_id="start2"), float(t))
        beats.observe(1, Heartbeat(1, RunState.RUNNING, beat=min(t, 106), run_id="start2"), float(t))
        judged, silent = beats.judge({0: _status(0), 1: _status(1)}, float(t))
        assert judged[0].alive and judged[0].state == RunState.RUNNING
        assert (silent == ()) == (t - 106 <= 90), t  # 106: the reader's time its counter last changed
    assert silent == (1,) and not judged[1].alive and judged[1].state == RunState.FAILED
    assert judged[1].exit == ("node 1's supervisor has not updated its record for 192 s: it ended without saying how "
                              "(killed, e.g. by the out-of-memory killer), or its machine or its share is gone")
    end = RunEnd({1: judged[1]}, silent=silent)
    assert end.describe().startswith("node1 failed; node 1's supervisor has not updated its record for 192 s")
    assert end.exit_code == 1


def test_only_this_start_s_record_is_a_sign_of_life():
    """A record of another start (an earlier one's, still there or seen late) is ignored: the node is
    silent from the watch's beginning. A counter that starts again from 1 (a new supervisor) is a
    change. A node whose status says how it ended is never judged silent."""
    from orchestration.node.run_state import Heartbeat, RunState
    from orchestration.runner.record_beats import RecordBeats

    beats = RecordBeats(run_id="start2", since=0.0, silence_s=10.0)
    for t in range(0, 30):
        beats.observe(0, Heartbeat(1, RunState.RUNNING, beat=t, run_id="start1"), float(t))
    assert beats.silent_s(0, 29.0) == 29.0 and beats.judge({0: _status(0)}, 29.0)[1] == (0,)
    beats.observe(1, Heartbeat(1, RunState.RUNNING, beat=500, run_id="start2"), 1.0)
    beats.observe(1, Heartbeat(2, RunState.RUNNING, beat=1, run_id="start2"), 20.0)
    beats.observe(1, None, 25.0)  # missing or torn: no news
    assert beats.silent_s(1, 29.0) == 9.0 and beats.judge({1: _status(1)}, 29.0)[1] == ()
    ended = _status(2, exit="torchrun exited with code 0")
    judged, silent = beats.judge({2: ended}, 1000.0)
    assert judged[2] == ended and silent == ()


def test_a_status_from_the_records_reads_only_this_start_s(tmp_path):
    """node-status by_heartbeat with the start's run id: an earlier start's heartbeat and exit
    records are not this start's end or life; this start's counter is shown."""
    from megatron_ext.run_spec.run_paths import RunPaths
    from orchestration.node.commands import node_status
    from orchestration.node.run_state import NodeExit, RunState, write_exit, write_heartbeat
    from orchestration.node.wire import NodeTarget, StatusRequest

    def node_status_of(run_id: str):
        return node_status(StatusRequest(NodeTarget("r1", 0, "n0", tmp_path), by_heartbeat=True, run_id=run_id))

    paths = RunPaths(tmp_path, "r1")
    write_exit(paths, NodeExit(node_rank=0, state=RunState.PREEMPTED, exit_code=0, signal=None, reason="saved", ended_at=0.0,
                               run_id="start1"))
    write_heartbeat(paths, 0, 1, RunState.RUNNING, "start1", beat=41)
    earlier = node_status_of("start2")
    assert earlier.exit is None and not earlier.alive and earlier.beat is None
    assert node_status_of("start1").exit == "saved"
    write_heartbeat(paths, 0, 1, RunState.RUNNING, "start2", beat=3)
    now = node_status_of("start2")
    assert now.alive and now.state == RunState.RUNNING and now.beat == 3 and now.exit is None


def test_the_srun_start_waits_for_the_supervisors_deadlines_and_the_share_s_cache(tmp_path):
    """The srun start reads each node's pid file through the share: it waits for the supervisors'
    own deadlines (their plan seen there, node 0's store, Megatron-LM's choice of checkpoint) plus
    the share's cache (the pid file seen here)."""
    import dataclasses

    from megatron_ext.host.json_files import SETTLE_S, SHARE_CACHE_S
    from orchestration.cluster.backends import srun_start_timeout_s
    from orchestration.node.wire import CheckpointChoice

    assert SHARE_CACHE_S == 60.0 and SETTLE_S > SHARE_CACHE_S  # NFS's acregmax/acdirmax
    launch, inputs = _inputs({}, tmp_path)
    node = plan_start(launch, inputs).nodes[0]
    assert srun_start_timeout_s(node) == SETTLE_S + 120 + SHARE_CACHE_S + 30  # join_s 120: the data set's default
    chosen = dataclasses.replace(node, checkpoint_choice=CheckpointChoice())
    assert srun_start_timeout_s(chosen) == srun_start_timeout_s(node) + 120


def test_record_silence_allows_for_the_share_s_cache_and_tests_may_lower_it():
    """RECORD_SILENCE_S lowers the margin (tests only); by default it is above NFS's 60 s cache plus
    the longest pause a supervisor bounds between two writes of its record."""
    from megatron_ext.host.json_files import SHARE_CACHE_S
    from orchestration.runner.record_beats import RECORD_GAP_S, RECORD_SILENCE_S

    assert read_launch_env({}).record_silence_s is None and read_launch_env({"RECORD_SILENCE_S": "15"}).record_silence_s == 15.0
    with pytest.raises(UserError, match="RECORD_SILENCE_S='1' must be seconds between 5 and 3600; e.g. RECORD_SILENCE_S=76"):
        read_launch_env({"RECORD_SILENCE_S": "1"})
    assert RECORD_SILENCE_S == 76.0 == SHARE_CACHE_S + RECORD_GAP_S + 4


@pytest.mark.parametrize("doing, started", [("verifying the checkpoint of iteration 8 before choosing it: 4.0 of 9.0 GB read",
                                             True), ("", False)])
def test_a_start_waits_while_the_supervisor_says_a_step_before_torchrun_is_under_way(tmp_path, doing, started):
    """node-start's wait for torchrun's pid file (0.6 s here, 31.5 s in the product) goes on while the
    supervisor's heartbeat record of this start keeps moving and names a step under way (node 0's
    pass over a 115 GB checkpoint took 2 minutes, and the start gave up at 32 s: issue 54); a
    record that moves without naming one is no reason to wait, and a record that stops moving ends
    the wait at ``timeout_s``, naming the step. The writer is the supervisor's own HeartbeatRecord
    thread (every 0.1 s here), the pid file written 2 s in, as torchrun's would be."""
    import threading
    import time

    from orchestration.node.records import HeartbeatRecord, RecordKeeper
    from orchestration.node.run_state import PidRecord, RunState, wait_until_started, write_heartbeat, write_pid_file

    paths = RunPaths(tmp_path, "big")
    paths.run_state_dir.mkdir(parents=True)
    pid_file = paths.node_pid_file(0)
    record = HeartbeatRecord(RecordKeeper(tmp_path, "node 0", lambda _: None),
                             lambda attempt, state, count, said: write_heartbeat(paths, 0, attempt, state, "start7", count, said),
                             deadline_s=5.0, period_s=0.1)
    record.doing = doing
    record.set(1, RunState.RESTARTING)
    torchrun = threading.Timer(2.0, lambda: write_pid_file(pid_file, PidRecord(
        run="big", run_id="start7", node_rank=0, host="h", hostname="h", pid=1, pgid=1, start_time=1, argv=[],
        log_path="", started_at=0.0)))
    torchrun.start()
    t0 = time.monotonic()
    try:
        wait = wait_until_started(paths, 0, pid_file, "start7", lambda: True, timeout_s=0.6, poll_s=0.05)
    finally:
        record.stop()
        torchrun.cancel()
    assert wait.started is started and wait.timed_out is not started, wait
    assert (time.monotonic() - t0 >= 2.0) is started
    if doing:  # the record stops moving (a supervisor stuck after saying what it was doing): named at the end
        record = HeartbeatRecord(RecordKeeper(tmp_path, "node 0", lambda _: None),
                                 lambda attempt, state, count, said: write_heartbeat(paths, 1, attempt, state, "start7", count, said),
                                 deadline_s=5.0, period_s=60.0)
        record.doing = doing
        record.set(1, RunState.RESTARTING)
        stuck = wait_until_started(paths, 1, paths.node_pid_file(1), "start7", lambda: True, timeout_s=0.6, poll_s=0.05)
        record.stop()
        assert stuck.timed_out and stuck.doing == doing, stuck


def test_a_start_says_what_its_nodes_wait_for(tmp_path):
    """[issue 54] While a start waits on its nodes, it says each node's step under way as the node's
    supervisor names it (node 0 reading its share of a large checkpoint for minutes), at once and
    then every WAIT_SAY_S; a record of another start, or one naming no step, says nothing."""
    import time

    from orchestration.node.run_state import RunState, write_heartbeat
    from orchestration.runner.start_plan import naming_the_waits

    paths = RunPaths(tmp_path, "big")
    paths.run_state_dir.mkdir(parents=True)
    doing = "verifying the checkpoint of iteration 8 before choosing it (this node's share, 1 of 2): 40.0 of 57.5 GB read"
    write_heartbeat(paths, 0, 1, RunState.RESTARTING, "start7", 3, doing)
    write_heartbeat(paths, 1, 1, RunState.RESTARTING, "start6", 3, "waiting for node 0's choice")  # an older start's
    write_heartbeat(paths, 2, 1, RunState.RUNNING, "start7", 3)
    said: list[str] = []
    with naming_the_waits(paths, [0, 1, 2], "start7", said.append, every_s=3600.0, poll_s=0.05):
        deadline = time.monotonic() + 30  # a loaded machine may run the watcher late
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # more polls: nothing else to say within every_s
    assert said == [f"waiting: node 0 is {doing}"]
