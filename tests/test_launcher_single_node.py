"""start_training.sh / stop_training.sh on this machine, for real (torchrun, gloo, /proc)."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from conftest import REPO, clean_env, free_port, last_iteration, run_script, tagged_pids, wait_for, write_data_set

pytestmark = pytest.mark.slow


@pytest.fixture()
def env(artifact_root):
    return clean_env(ARTIFACT_ROOT=str(artifact_root), MASTER_PORT=str(free_port()))


def test_start_status_stop_one_node_spares_other_run(env, artifact_root, tmp_path):
    long_data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    other_env = {**env, "MASTER_PORT": str(free_port())}
    assert run_script("start_training.sh", "gpt_smoke", long_data, "single_a", env=env).returncode == 0
    started = run_script("start_training.sh", "gpt_smoke", long_data, "single_b", env=other_env)
    assert started.returncode == 0, started.stderr
    try:
        pid_file = artifact_root / "run_state" / "single_a_node0.pid"
        record = json.loads(pid_file.read_text())
        assert {"host", "pid", "pgid", "start_time", "run_id", "argv"} <= set(record)
        assert record["argv"][record["argv"].index("--node-rank") + 1] == "0"
        log = artifact_root / "logs" / "single_a_node0.log"
        wait_for(lambda: last_iteration(log) >= 2, 180, what="two iterations in the node log")
        assert "world size 2" in log.read_text()

        again = run_script("start_training.sh", "gpt_smoke", long_data, "single_a", env=env)
        assert again.returncode == 2 and "already running on node 0" in again.stderr

        status = run_script("status_training.sh", "single_a", "--json", env=env)
        node = json.loads(status.stdout.splitlines()[0])
        assert node["alive"] and node["pid"] == record["pid"] and node["last_iteration"] >= 2 and node["tokens_per_s"] > 0

        workers = sorted(tagged_pids("single_a"))
        dry = run_script("stop_training.sh", "single_a", env={**env, "DRY_RUN": "1"})
        assert dry.returncode == 0, dry.stdout + dry.stderr
        assert f"would SIGTERM process group {record['pgid']} (torchrun pid {record['pid']})" in dry.stdout, dry.stdout
        assert f"{len(workers)} live process(es) carry the run's tags" in dry.stdout
        assert sorted(tagged_pids("single_a")) == workers and pid_file.exists()  # nothing was signalled

        stop = run_script("stop_training.sh", "single_a", env=env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "stopped" in stop.stdout
        assert tagged_pids("single_a") == []
        assert not pid_file.exists()
        # The run beside it is untouched and keeps training.
        assert tagged_pids("single_b")
        log_b = artifact_root / "logs" / "single_b_node0.log"
        before = last_iteration(log_b)
        wait_for(lambda: last_iteration(log_b) > before, 120, what="the other run to keep training")
        # Stopping twice is fine.
        assert run_script("stop_training.sh", "single_a", env=env).returncode == 0
    finally:
        run_script("stop_training.sh", "single_b", env=other_env)
        run_script("stop_training.sh", "single_a", env=env)
    assert tagged_pids("single_b") == []


def test_leftover_workers_are_swept(env, artifact_root, tmp_path):
    """torchrun SIGKILLed orphans its workers (they live in sessions of their own): the node's
    supervisor sweeps them by the run tag; with the supervisor gone too, stop still finds them."""
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    for run, supervisor_too in (("orphans", False), ("orphans_alone", True)):
        assert run_script("start_training.sh", "gpt_smoke", data, run, env=env).returncode == 0
        try:
            record = json.loads((artifact_root / "run_state" / f"{run}_node0.pid").read_text())
            wait_for(lambda: len(tagged_pids(run)) >= 4, 60, what="the supervisor, torchrun and its 2 workers")
            # Past their start-up (a worker killed in its imports may leave a child it was starting
            # that ends by itself: CI saw one outlive the sweep by a moment), as a run that loses torchrun.
            wait_for(lambda: last_iteration(artifact_root / "logs" / f"{run}_node0.log") >= 1, 120, what="the first iteration")
            if supervisor_too:
                os.kill(record["supervisor_pid"], 9)
            os.kill(record["pid"], 9)
            wait_for(lambda: record["pid"] not in tagged_pids(run), 10, what="torchrun to die")
            if supervisor_too:
                assert tagged_pids(run), "workers survive their torchrun"
                stop = run_script("stop_training.sh", run, env=env)
                assert stop.returncode == 0 and "swept" in stop.stdout
            else:
                wait_for(lambda: not tagged_pids(run), 30, what="the supervisor to sweep the orphaned workers")
            assert tagged_pids(run) == []
        finally:
            run_script("stop_training.sh", run, env=env)


def test_container_name_uses_docker_exec(env, artifact_root, tmp_path):
    """There is no Docker engine on these machines: a `docker` stand-in on PATH records its argv
    and runs the inner command as `docker exec -w DIR -e K=V CONTAINER CMD...` would."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "docker_calls.jsonl"
    stub = bin_dir / "docker"
    stub.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open({str(record)!r}, "a") as fh:
    fh.write(json.dumps(args) + "\\n")
assert args[0] == "exec", args
i, env, cwd = 1, dict(os.environ), None
while args[i].startswith("-"):
    if args[i] == "-w": cwd = args[i + 1]
    elif args[i] == "-e":
        k, _, v = args[i + 1].partition("="); env[k] = v
    i += 2
container, cmd = args[i], args[i + 1:]
assert container == "megatron-training", container
os.chdir(cwd)
os.execvpe(cmd[0], cmd, env)
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    data = write_data_set(tmp_path / "long.yaml", train_iters=5000)
    denv = {**env, "PATH": f"{bin_dir}:{env['PATH']}", "CONTAINER_NAME": "megatron-training"}
    try:
        start = run_script("start_multinode_training.sh", "gpt_smoke", data, "in_container", env=denv)
        assert start.returncode == 0, start.stdout + start.stderr
        calls = [json.loads(l) for l in record.read_text().splitlines()]
        commands = [c[c.index("megatron-training") + 1:][2:4] for c in calls]
        assert commands == [["orchestration", "node-check"], ["orchestration", "node-start"]]
        first = calls[1]
        assert first[:4] == ["exec", "-w", str(REPO), "-e"]
        plan = json.loads(first[first.index("--request") + 1])  # the node's whole plan travels with the command
        assert plan["env"]["ARTIFACT_ROOT"] == str(artifact_root) and plan["env"]["NODE_RANK"] == "0" and plan["env"]["NNODES"] == "1"
        python = first[first.index("megatron-training") + 1]  # the start command's interpreter, by path
        assert os.path.isabs(python) and os.path.realpath(python) == os.path.realpath(sys.executable)
        wait_for(lambda: tagged_pids("in_container"), 30, what="the run's processes")
        stop = run_script("stop_multinode_training.sh", "in_container", env=denv)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        last = json.loads(record.read_text().splitlines()[-1])
        assert last[last.index("megatron-training") + 3:last.index("megatron-training") + 5] == ["orchestration", "node-stop"]
        assert json.loads(last[-1])["target"]["run"] == "in_container"
        assert tagged_pids("in_container") == []
    finally:
        run_script("stop_training.sh", "in_container", env=env)


@pytest.mark.parametrize("extra,args,message", [
    ({"NNODES": "2", "NODE_RANK": "2"}, ("gpt_smoke", "smoke", "r"), "NODE_RANK=2 is outside NNODES=2"),
    ({}, ("gpt_smoke", "smoke", "bad run"), "is not a valid run name"),
    ({}, ("gpt_smoke", "smoke", "bad;run"), "is not a valid run name"),
    ({}, ("gpt9", "smoke", "r"), "unknown model 'gpt9'"),
    ({"ZERO_STAGE": "7"}, ("gpt_smoke", "smoke", "r"), "ZERO_STAGE='7' is not a ZeRO stage"),
    ({"NPROC_PER_NODE": "3"}, ("gpt2", "gpt2_smoke", "r"),
     "global_batch_size=64 is not divisible by micro_batch_size(2) x data_parallel_size(3)"),
    ({}, ("gpt_smoke", "gpt2_smoke", "r"), "data/gpt2_smoke.yaml:training.seq_length=1024 is longer than model "
                                           "gpt_smoke's max_position_embeddings=256: "),
])
def test_bad_input_starts_nothing(env, artifact_root, extra, args, message):
    proc = run_script("start_training.sh", *args, env={**env, **extra}, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert tagged_pids(args[2]) == []
    assert not (artifact_root / "run_state" / f"{args[2]}_node0.pid").exists()


@pytest.mark.parametrize("root,message", [
    ("{file}", "ARTIFACT_ROOT={file} is a file; the artifact root must be a directory (every run's logs, run state and "
               "checkpoints go under it): set ARTIFACT_ROOT to a directory"),
    ("/proc/no_such_root", "ARTIFACT_ROOT=/proc/no_such_root cannot be made: /proc takes no new folder ("),
], ids=["a_file", "cannot_be_made"])
def test_an_artifact_root_that_cannot_be_one_starts_nothing(env, tmp_path, root, message):
    """One line naming the value, the rule and the fix, exit 2, nothing started or made (each used to
    end in a traceback from the preflight, exit 1)."""
    (tmp_path / "file").write_text("not a directory\n")
    root, message = root.format(file=tmp_path / "file"), message.format(file=tmp_path / "file")
    proc = run_script("start_training.sh", "gpt_smoke", "smoke", "bad_root", env={**env, "ARTIFACT_ROOT": root}, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert "or unset it for " in proc.stderr
    assert tagged_pids("bad_root") == [] and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert (tmp_path / "file").read_text() == "not a directory\n" and not os.path.exists("/proc/no_such_root")


@pytest.mark.parametrize("dry_run", ["", "1"])
def test_a_tokenizer_that_does_not_load_starts_nothing(env, artifact_root, tmp_path, dry_run):
    """An invalid tokenizer.json: one message before anything starts (it used to say "started" and
    then kill every rank with the parser's exception)."""
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE" "vocab": {}}}')
    data = tmp_path / "hf.yaml"
    data.write_text(f"data:\n  source: embedded\n  tokenizer: {{type: huggingface, model_path: {tokenizer}}}\n")
    proc = run_script("start_training.sh", "gpt_smoke", str(data), "bad_tok", env={**env, "DRY_RUN": dry_run}, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1 and f"{tokenizer / 'tokenizer.json'} does not load as a Hugging Face tokenizer (" in proc.stderr
    assert tagged_pids("bad_tok") == [] and not (artifact_root / "run_state" / "bad_tok_node0.pid").exists()


def test_status_of_a_run_that_is_not_there(env, artifact_root):
    proc = run_script("status_training.sh", "never_started", env=env, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"no run 'never_started' under ARTIFACT_ROOT={artifact_root}" in proc.stderr, proc.stderr


def test_busy_master_port_is_refused(env, artifact_root):
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_script("start_training.sh", "gpt_smoke", "smoke", "busy", env={**env, "MASTER_PORT": str(port)})
    assert proc.returncode == 2
    assert f"MASTER_PORT={port} is in use on node 0" in proc.stderr
    assert tagged_pids("busy") == []
