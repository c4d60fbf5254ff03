"""Secrets (WANDB_API_KEY, HF_TOKEN, any forwarded ``*_TOKEN``, ``*_KEY``, ``*_SECRET``, ``*_PASSWORD``)
reach the ranks, and nothing else: no command line, no printed plan, no file, no batch script.
The pure parts, then a real start on this machine (the local transport; the ssh one is in
tests/test_multinode.py's first test)."""

from __future__ import annotations

import json
import threading

import pytest

from standins import scan_cmdlines, secret_env
from conftest import clean_env, free_port, last_iteration, planned_nodes, run_script, tagged_pids, wait_for, write_data_set
from megatron_ext.run_spec.errors import UserError
from orchestration.cluster.backends import backend_for
from orchestration.launch_env import is_secret, read_launch_env
from orchestration.node.commands import receive_secrets
from orchestration.node.wire import NodePlan, start_call
from megatron_ext.host.procfs import parent_pid, process_environ
from orchestration.node.watchdog import worker_pids
from orchestration.runner.start_plan import plan_start, read_start_inputs
from orchestration.runner.submit import plan_submit


def test_which_variables_are_secrets():
    for name in ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MEGATRON_S3_SECRET", "NCCL_X_PASSWORD", "A_KEY"):
        assert is_secret(name), name
    for name in ("WANDB_PROJECT", "HF_HOME", "TOKENIZERS_PARALLELISM", "KEYBOARD", "PATH"):
        assert not is_secret(name), name
    values = secret_env()
    launch = read_launch_env({**values, "HF_HOME": "/shared/hf", "WANDB_ENTITY": "team", "OTHER_TOKEN": "x",
                              "HOSTS": "n0,n1"})
    assert launch.secrets == values  # OTHER_TOKEN is not forwarded at all: no prefix of ours
    assert {"HF_HOME", "WANDB_ENTITY"} <= set(launch.forwarded) and not set(values) & set(launch.forwarded)
    assert not any(v in repr(launch) for v in values.values())


def test_a_start_names_secrets_and_sends_their_values_on_standard_input_only(tmp_path):
    values = secret_env()
    launch = read_launch_env({**values, "HOSTS": "n0,n1", "ARTIFACT_ROOT": str(tmp_path), "SSH_OPTS": "-p 2222"})
    plan = plan_start(launch, read_start_inputs(launch, "gpt_smoke", "smoke", "sec", list(enumerate(launch.hosts))))
    node = plan.nodes[1]
    assert node.secret_names == ("HF_TOKEN", "MEGATRON_STORE_PASSWORD", "WANDB_API_KEY")
    text = node.to_json()  # what DRY_RUN prints and the plan file holds
    assert not any(v in text for v in values.values()) and NodePlan.from_json(text) == node
    call = start_call(node, launch.secrets)
    assert json.loads(call.stdin) == {"secrets": values} and not any(v in repr(call) for v in values.values())
    for container in (None, "megatron-training"):
        remote = backend_for(read_launch_env({**values, "HOSTS": "n0,n1", **({"CONTAINER_NAME": container} if container else {})})
                             ).plan("n1", call.argv(launch.python), launch.forwarded, "/w", stdin=True)
        assert remote[0] == "ssh" and not any(v in " ".join(remote) for v in values.values())
        assert ("docker exec -i" in remote[-1]) == bool(container)  # docker passes stdin on only with -i
    assert start_call(node, {}).stdin == '{"secrets": {}}\n'  # the node then says which did not arrive


def test_the_node_takes_the_values_from_its_standard_input_or_its_own_environment():
    plan = NodePlan(run="r", run_id="r-1", node_rank=1, host="n1", nnodes=2, nproc_per_node=1, master_addr="n0", master_port=6000,
                    argv=("torchrun",), env={}, unset=(), cwd="/", log_path="l", pid_path="p", secret_names=("HF_TOKEN", "WANDB_API_KEY"))
    line = '{"secrets": {"HF_TOKEN": "t1", "WANDB_API_KEY": "k1", "EXTRA_KEY": "x"}}\n'
    assert receive_secrets(plan, line, {}) == {"HF_TOKEN": "t1", "WANDB_API_KEY": "k1"}
    assert receive_secrets(plan, "", {"HF_TOKEN": "t2", "WANDB_API_KEY": "k2"}) == {"HF_TOKEN": "t2", "WANDB_API_KEY": "k2"}
    with pytest.raises(UserError, match=r"node 1: the secret variable\(s\) WANDB_API_KEY did not arrive") as err:
        receive_secrets(plan, '{"secrets": {"HF_TOKEN": "t3"}}', {})
    assert "t3" not in str(err.value)
    with pytest.raises(UserError, match="not JSON"):
        receive_secrets(plan, "HF_TOKEN=t4", {})


def test_the_batch_script_holds_no_secret(tmp_path):
    """sbatch exports the submitting environment (``--export=ALL``, Slurm's default): the secrets reach
    the job that way, the script (a file under the artifact root, printed by DRY_RUN) never has them."""
    values = secret_env()
    launch = read_launch_env({**values, "WANDB_PROJECT": "p", "HF_HOME": "/shared/hf", "ARTIFACT_ROOT": str(tmp_path)})
    script = plan_submit(launch, "gpt_smoke", "smoke", "sec_batch", nodes=2).script
    assert "export WANDB_PROJECT=p" in script and "export HF_HOME=/shared/hf" in script
    assert not any(v in script for v in values.values()) and "WANDB_API_KEY" not in script
    for export in ("ALL", "ALL,OTHER=1", "PATH,HF_TOKEN,WANDB_API_KEY,MEGATRON_STORE_PASSWORD"):
        plan_submit(read_launch_env({**values, "SBATCH_EXPORT": export, "ARTIFACT_ROOT": str(tmp_path)}), "gpt_smoke",
                    "smoke", "sec_batch")
    with pytest.raises(UserError, match=r"SBATCH_EXPORT \(names: HF_TOKEN,NONE\) would keep MEGATRON_STORE_PASSWORD, "
                                        r"WANDB_API_KEY from the job") as err:
        plan_submit(read_launch_env({**values, "SBATCH_EXPORT": f"NONE,HF_TOKEN={values['HF_TOKEN']}",
                                     "ARTIFACT_ROOT": str(tmp_path)}), "gpt_smoke", "smoke", "sec_batch")
    assert values["HF_TOKEN"] not in str(err.value)


@pytest.mark.slow
def test_a_start_on_this_machine_gives_the_ranks_the_secrets_and_shows_them_nowhere(artifact_root, tmp_path):
    values = secret_env()
    run = "secrets_local"
    env = clean_env(ARTIFACT_ROOT=str(artifact_root), MASTER_PORT=str(free_port()), WANDB_PROJECT="megatron-zero-tests",
                    WANDB_MODE="offline", **values)
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    dry = run_script("start_training.sh", "gpt_smoke", data, run, env={**env, "DRY_RUN": "1"})
    assert dry.returncode == 0 and planned_nodes(dry.stdout)[0]["secret_names"] == sorted(values), dry.stderr
    assert not any(v in dry.stdout + dry.stderr for v in values.values())
    hits: list[str] = []
    stop = threading.Event()
    scanner = threading.Thread(target=scan_cmdlines, args=([v.encode() for v in values.values()], hits, stop), daemon=True)
    scanner.start()
    try:
        start = run_script("start_training.sh", "gpt_smoke", data, run, env=env)
        assert start.returncode == 0, start.stdout + start.stderr
        assert not any(v in start.stdout + start.stderr for v in values.values())
        wait_for(lambda: last_iteration(artifact_root / "logs" / f"{run}_node0.log") >= 2, 180, what="two iterations")
        record = json.loads((artifact_root / "run_state" / f"{run}_node0.pid").read_text())
        wait_for(lambda: list((artifact_root / "runs" / run / "wandb").glob("offline-run-*")), 60, what="the W&B run")
        ranks = worker_pids(run, 0)  # the ranks, not wandb's service process (a child of rank 1, with its RANK)
        assert sorted(ranks) == [0, 1] and {parent_pid(p) for p in ranks.values()} == {record["pid"]}
        for pid in ranks.values():  # what the ranks see (and wandb, on the last rank, reads WANDB_API_KEY from there)
            environ = process_environ(pid)
            assert {k: environ.get(k) for k in values} == values
            assert environ["WANDB_PROJECT"] == "megatron-zero-tests"
        assert {k: process_environ(record["supervisor_pid"]).get(k) for k in values} == values
        stopped = run_script("stop_training.sh", run, env=env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    finally:
        stop.set()
        scanner.join()
        run_script("stop_training.sh", run, env=env)
    assert hits == [], hits  # launcher, node-start, supervisor, torchrun, ranks, wandb's service: no command line
    assert tagged_pids(run) == []
    plan_file = artifact_root / "run_state" / f"{run}_node0.plan.json"
    assert json.loads(plan_file.read_text())["secret_names"] == sorted(values)
    files = [p for d in ("logs", "run_state", f"runs/{run}") for p in (artifact_root / d).rglob("*") if p.is_file()]
    assert plan_file in files and any(p.suffix == ".wandb" for p in files)
    for path in files:  # logs, plan and pid files, resolved params, metrics, TensorBoard, wandb's files
        content = path.read_bytes()
        assert not any(v.encode() in content for v in values.values()), path
