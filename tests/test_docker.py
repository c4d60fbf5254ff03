"""CONTAINER_NAME against a real Docker engine (tests/docker_engine.py): start, status, a worker
killed inside the container, resume, and stop with nothing left, all through ``docker exec``; a
secret reaches the ranks in the container through ``docker exec -i`` and shows in no command line.
With CI=true a missing prerequisite is a failure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from docker_engine import DockerEngine, missing_prerequisites
from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.host.procfs import process_environ
from conftest import require, REPO, clean_env, free_port, last_iteration, run_script, tagged_pids, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require(missing_prerequisites(), "Docker tests")
    e = DockerEngine(tmp_path_factory.mktemp("docker"), REPO).open()
    yield e
    e.close()


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_start_status_failure_resume_and_stop_through_docker_exec(engine, artifact_root, tmp_path):
    run = "in_docker"
    data = tmp_path / "long.yaml"
    data.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        "training:\n  seq_length: 128\n  micro_batch_size: 4\n  global_batch_size: 16\n  train_iters: 2000\n"
        "  eval_iters: 0\n  save_interval: 5\n")
    token = f"hf_{os.urandom(12).hex()}"  # a secret: it travels on docker exec -i's standard input only
    env = clean_env(ARTIFACT_ROOT=str(artifact_root), MASTER_PORT=str(free_port()), CONTAINER_NAME=engine.container,
                    HF_TOKEN=token, **engine.env)
    checkpoints = artifact_root / "runs" / run / "checkpoints"
    try:
        start = run_script("start_training.sh", "gpt_smoke", str(data), run, env=env)
        assert start.returncode == 0, start.stdout + start.stderr
        record = json.loads((artifact_root / "run_state" / f"{run}_node0.pid").read_text())
        assert record["pid"] < 1000  # a pid of the container's own process namespace
        wait_for(lambda: latest_iteration(checkpoints), 240, what="a checkpoint")
        status = json.loads(run_script("status_training.sh", run, "--json", env=env).stdout.splitlines()[0])
        assert status["alive"] and status["state"] == "running", status

        # A worker killed inside the container: torchrun there fails, its supervisor records it.
        workers = [p for p in tagged_pids(run) if "LOCAL_RANK" in process_environ(p)
                   and b"megatron_ext.pretrain" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(workers) == 2, [open(f"/proc/{p}/cmdline", "rb").read() for p in tagged_pids(run)]
        assert all(process_environ(w).get("HF_TOKEN") == token for w in workers)
        shown = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and token.encode() in _cmdline(p)]
        assert shown == [] and token not in start.stdout + start.stderr, shown
        os.kill(workers[0], 9)
        wait_for(lambda: not tagged_pids(run), 60, what="the run to end in the container")
        failure = (artifact_root / "run_state" / f"{run}_failure.txt").read_text()
        assert failure.startswith("node 0 (localhost) failed: torchrun exit code 1"), failure
        status = json.loads(run_script("status_training.sh", run, "--json", env=env).stdout.splitlines()[0])
        assert status["state"] == "failed"

        # Starting it again resumes from the latest checkpoint, then stop leaves nothing.
        saved = latest_iteration(checkpoints)
        again = run_script("start_training.sh", "gpt_smoke", str(data), run, env=env)
        assert again.returncode == 0 and f"resuming from iteration {saved}" in again.stdout, again.stdout + again.stderr
        log = artifact_root / "logs" / f"{run}_node0.log"
        wait_for(lambda: last_iteration(log) > saved + 1, 240, what="training to go on after the resume")
        stop = run_script("stop_training.sh", run, env=env)
        assert stop.returncode == 0 and "stopped (SIGTERM to process group" in stop.stdout, stop.stdout + stop.stderr
        assert tagged_pids(run) == []
        inside = engine.docker("exec", engine.container, "/bin/ps", "-eo", "args", check=False).stdout
        assert "torch.distributed.run" not in inside and "megatron_ext.pretrain" not in inside, inside
    finally:
        run_script("stop_training.sh", run, env=env)
