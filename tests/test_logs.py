"""``logs_training.sh RUN``: every node's log merged in time order, each line named ``[node host
rank]``, the lines many ranks print alike shown once. The rules on synthetic lines (who printed a line,
its time, the nodes' clock offsets, the attempts' order, the collapse, the filters, reading back from a
log's end and over a transport), bad input (one error line, exit 2), then a real one-node 2-rank run
with a fault (both ranks interrupted, a restart) read back, followed while it runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from megatron_ext.host.procfs import parent_pid, process_environ
from megatron_ext.run_spec.errors import UserError
from orchestration.analysis.merged_log import (SUPERVISOR, TORCHRUN, UNNAMED, Collapser, LineFilter, NodeLines, classify,
                                               clock_offsets, collapse, compile_pattern, format_group, iteration_times,
                                               line_time, merge, node_stream, parse_since, ranges, tail_lines)
from orchestration.cluster.backends import Ssh, ThisMachine
from orchestration.launch_env import read_launch_env
from orchestration.runner.node_logs import READ_SCRIPT, FileHere, FileOnNode, LogUnreadable, find_window

from conftest import REPO, clean_env, free_port, last_iteration, run_script, tagged_pids, wait_for, write_data_set

T0 = datetime(2026, 12, 6, 8, 0, 0)
HOSTS = {0: "g0033", 1: "g0034"}


def iteration(ts: datetime, it: int) -> str:
    return f" [{ts.strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {it:8d}/     100 | consumed samples: {it * 16:12d} |"


def glog(ts: datetime, text: str, level: str = "E") -> str:
    return f"{level}{ts.strftime('%m%d %H:%M:%S.%f')} 4242 site-packages/torch/distributed/elastic/api.py:1002] {text}"


TRACEBACK = ["Traceback (most recent call last):", '  File "/work/main/megatron_ext/pretrain.py", line 221, in <module>',
             "RuntimeError: Connection closed by peer"]
SUMMARY = ["Traceback (most recent call last):", '  File "<frozen runpy>", line 198, in _run_module_as_main',
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "=" * 30, "megatron_ext.pretrain FAILED",
           "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)", "=" * 30]


def node_log(node: int, skew_s: float = 0.0, fault_at: int = 3, steps: int = 6) -> list[str]:
    """A node's log of 2 x 1 ranks (rank = node): a fault after ``fault_at`` steps, then attempt 2;
    its clock ``skew_s`` ahead."""
    at = lambda s: T0 + timedelta(seconds=s + skew_s)  # noqa: E731
    lines = [f"[supervisor node{node}] attempt 1 of 2: starting torchrun", "", "*" * 41,
             "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default", "*" * 41]
    lines += [x for it in range(1, fault_at + 1) for x in (iteration(at(it), it), f"progress: {it}/100")]
    lines += [f"[rank{node}]: {line}" for line in TRACEBACK]
    if node == 0:  # node 0 follows node 1's failure
        lines += ["[supervisor node0] stopping torchrun: another node failed: node 1 (g0034) failed"]
    lines += [glog(at(fault_at + 0.5 + 0.3 * (node == 0)), f"failed (exitcode: 1) local_rank: 0 (pid: {node})"), *SUMMARY]
    lines += [f"[supervisor node{node}] restarting as attempt 2 in 1 s: node 1 failed",
              f"[supervisor node{node}] attempt 2 of 2: starting torchrun"]
    lines += [x for it in range(fault_at + 1, steps + 1) for x in (iteration(at(it + 10), it), f"progress: {it}/100")]
    return lines + [f"[supervisor node{node}] finished: torchrun exited with code 0"]


def merged(logs: dict[int, list[str]], window: int | None = None) -> list[str]:
    times = {n: iteration_times(lines) for n, lines in logs.items()}
    offsets = clock_offsets(times)
    streams = [node_stream(NodeLines(n, offsets[n], year=2026), [lines]) for n, lines in logs.items()]
    collapser = Collapser() if window is None else Collapser(window_lines=window)
    return [format_group(g, HOSTS) for g in collapse(merge(streams), collapser)]


# -- who, when ------------------------------------------------------------------------------------

def test_each_line_is_named_by_what_printed_it():
    assert classify("[supervisor node1] restarting as attempt 2") == (SUPERVISOR, None, "restarting as attempt 2")
    assert classify("[rank13]:   File \"x.py\", line 3") == ("rank13", 13, "  File \"x.py\", line 3")
    assert classify("error: rank 5: disk full") == ("rank5", 5, "error: rank 5: disk full")
    assert classify(glog(T0, "Sending process 7 closing signal SIGTERM", "W"))[0] == TORCHRUN
    assert classify("*" * 41)[0] == TORCHRUN and classify("progress: 3/30 (10%)")[0] == UNNAMED
    assert classify("[rank0]:[W1206 08:00:00.000000 4242 socket.cpp:1]")[1] == 0
    node = NodeLines(0, year=2026)
    lines = node.feed(["W1206 08:00:01.000000 42 api.py:1] Sending process 7 closing signal SIGTERM",
                       glog(T0, "failed (exitcode: 1)"), *SUMMARY, "after the summary", "[supervisor node0] x"]) + node.flush()
    assert [l.who for l in lines] == [TORCHRUN] * (2 + len(SUMMARY)) + [UNNAMED, SUPERVISOR]


def test_a_line_s_time_is_its_own_or_the_last_before_it_in_its_node():
    assert line_time(iteration(T0, 1), 2026) == (T0.timestamp(), 2026)
    assert line_time("2026-12-06 08:00:00,250 INFO x", 2026)[0] == T0.timestamp() + 0.25
    assert line_time(glog(T0, "x"), 2026)[0] == T0.timestamp() and line_time(glog(T0, "x"), 2025)[0] != T0.timestamp()
    assert line_time("[2026-13-06 08:00:00] x", 2026) == (None, None) and line_time("progress", 2026) == (None, None)
    node = NodeLines(0, offset_s=10.0, year=2026)
    out = node.feed(["held 1", "held 2", iteration(T0, 1), "after", iteration(T0 - timedelta(seconds=5), 2), "later"])
    assert [l.key for l in out] == [T0.timestamp() - 10] * 5  # keys never go down within a node
    assert node.feed(["x"]) == [] and [l.key for l in node.flush()] == [T0.timestamp() - 10] * 2  # the last time, at the end
    lone = NodeLines(1)
    assert lone.feed(["no time at all"]) == [] and lone.flush()[0].key == float("-inf")
    fault = NodeLines(2, year=2026)  # an untimed line takes the next time: the torchrun line after a traceback
    lines = fault.feed([iteration(T0, 1), "[rank2]: RuntimeError: x", "[supervisor node2] stopping torchrun",
                        glog(T0 + timedelta(seconds=90), "Sending process 7 closing signal SIGTERM", "W")])
    assert [l.key - T0.timestamp() for l in lines] == [0.0, 90.0, 90.0, 90.0]
    assert line_time("[W1206 08:00:00.557564534 socket.cpp:207] [c10d] x", 2026)[0] == T0.timestamp() + 0.557564534


def test_attempts_count_on_across_a_new_start():
    node = NodeLines(0)
    lines = node.feed(["[supervisor node0] attempt 1 of 2: starting torchrun", "x",
                       "[supervisor node0] attempt 2 of 2: starting torchrun", "y",
                       "[supervisor node0] attempt 1 of 1: starting torchrun", "z", iteration(T0, 1)])
    assert [l.attempt for l in lines] == [1, 1, 2, 2, 3, 3, 3]
    rejoined = NodeLines(1).feed(["[supervisor node1] attempt 3 of 4: starting torchrun", iteration(T0, 1)])
    assert [l.attempt for l in rejoined] == [3, 3]


def test_clock_offsets_come_from_the_iteration_lines_every_node_prints():
    logs = {0: node_log(0), 1: node_log(1, skew_s=30.0), 2: ["no iteration line"]}
    offsets = clock_offsets({n: iteration_times(lines) for n, lines in logs.items()})
    assert offsets[0] == 0.0 and abs(offsets[1] - 30.0) < 1e-6 and offsets[2] == 0.0
    assert clock_offsets({0: {}, 1: {}}) == {0: 0.0, 1: 0.0}


# -- the merge -------------------------------------------------------------------------------------

def test_two_nodes_with_a_fault_read_in_order_named_and_collapsed():
    """Node 1's clock 30 s ahead: its iteration lines still interleave with node 0's, every line of
    attempt 1 comes before any of attempt 2, and each line two nodes print alike shows once."""
    out = merged({0: node_log(0), 1: node_log(1, skew_s=30.0)})
    text = "\n".join(out)
    assert out[0] == "[nodes 0-1 supervisor] attempt 1 of 2: starting torchrun"
    assert out[1:4] == ["[nodes 0-1 torchrun] " + "*" * 41, "[nodes 0-1 torchrun] Setting OMP_NUM_THREADS environment "
                        "variable for each process to be 1 in default", "[nodes 0-1 torchrun] " + "*" * 41]
    its = [(l.split()[0], int(l.split("iteration")[1].split("/")[0])) for l in out if "] iteration " in l]
    assert [it for _, it in its] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6], its  # in step, node by node
    assert [n for n, _ in its][:2] == ["[node0", "[node1"]
    assert "[nodes 0-1 ranks 0-1] Traceback (most recent call last):" in out
    assert "[nodes 0-1 ranks 0-1] RuntimeError: Connection closed by peer" in out
    assert sum("Traceback" in l for l in out) == 2  # the ranks' (once), torchrun's (once)
    restart = out.index("[nodes 0-1 supervisor] attempt 2 of 2: starting torchrun")
    assert all("iteration        4/" not in l for l in out[:restart]) and "failed (exitcode" in text[:text.index("attempt 2 of")]
    assert "[nodes 0-1 supervisor] finished: torchrun exited with code 0" in out[-3:]  # at node 0's, its last step's time
    assert out.count("[nodes 0-1 rank?] progress: 2/100") == 1
    node1_failed = next(i for i, l in enumerate(out) if l.startswith("[node1 g0034 torchrun] E"))
    assert node1_failed < out.index("[node0 g0033 supervisor] stopping torchrun: another node failed: node 1 (g0034) failed")


def test_attempts_order_the_nodes_whatever_their_clocks_without_iteration_lines():
    """No iteration line (a run failing at start-up): no offset is measured, node 1's clock 300 s ahead,
    yet attempt 2's lines come after every node's attempt-1 lines."""
    def failing(node, skew_s):
        at = lambda s: T0 + timedelta(seconds=s + skew_s)  # noqa: E731
        return [f"[supervisor node{node}] attempt 1 of 2: starting torchrun", glog(at(1), f"failed node {node} a1"),
                f"[supervisor node{node}] attempt 2 of 2: starting torchrun", glog(at(5), f"failed node {node} a2")]
    out = merged({0: failing(0, 0.0), 1: failing(1, 300.0)})
    assert [l.rsplit("failed ", 1)[1] for l in out if "failed node" in l] == ["node 0 a1", "node 1 a1", "node 0 a2",
                                                                             "node 1 a2"], out


def test_repeated_lines_join_only_other_sources_or_the_same_one_in_a_row():
    lines = {0: ["[supervisor node0] attempt 1 of 2: starting torchrun", iteration(T0, 1), "same", "same", "same",
                 "[rank0]: boom", "[supervisor node0] attempt 2 of 2: starting torchrun", iteration(T0, 9), "same"],
             1: ["[supervisor node1] attempt 1 of 2: starting torchrun", iteration(T0, 1), "[rank1]: boom", "boom"]}
    out = merged(lines)
    assert "[node0 g0033 rank? x3] same" in out and out.count("[node0 g0033 rank?] same") == 1  # attempt 2's stays there
    assert "[nodes 0-1 ranks 0-1] boom" in out and "[node1 g0034 rank?] boom" in out  # named and unnamed apart
    far = merged({0: [iteration(T0, 1), "warn", *[f"l{i}" for i in range(20)]], 1: [iteration(T0, 1), "warn"]}, window=5)
    assert "[node0 g0033 rank?] warn" in far and "[node1 g0034 rank?] warn" in far  # beyond the window: apart
    assert ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11" and ranges([5]) == "5"


def test_filters_and_the_tail():
    node = NodeLines(0, year=2026)
    lines = node.feed(["[rank3]: a", "error: rank 3: b", "c", iteration(T0, 1), "[rank2]: d"]) + node.flush()
    assert [l.text for l in lines if LineFilter(rank=3)(l)] == ["a", "error: rank 3: b"]
    assert [l.text for l in lines if LineFilter(pattern=compile_pattern("^[cd]$"))(l)] == ["c", "d"]
    assert [l.text for l in lines if LineFilter(since=T0.timestamp() + 1)(l)] == []
    assert [l.text for l in tail_lines(lines, 2)] == [lines[-2].text, "d"] and tail_lines(lines, None) is lines
    now = datetime(2026, 12, 6, 12, 0, 0)
    assert parse_since("10m", now) == (now - timedelta(minutes=10)).timestamp()
    assert parse_since("1.5h", now) == (now - timedelta(minutes=90)).timestamp()
    assert parse_since("08:20", now) == datetime(2026, 12, 6, 8, 20).timestamp()
    assert parse_since("2026-12-05 23:00:30", now) == datetime(2026, 12, 5, 23, 0, 30).timestamp()
    for bad in ("yesterday", "10 minutes", "25:00"):
        with pytest.raises(UserError, match="neither a span back from now"):
            parse_since(bad, now)
    with pytest.raises(UserError, match="is not a regular expression"):
        compile_pattern("(")


# -- reading back from the end, and over a transport ----------------------------------------------

class CountingFile(FileHere):
    def __init__(self, path):
        super().__init__(path)
        self.bytes_read = 0

    def read(self, offset, length):
        chunk = super().read(offset, length)
        self.bytes_read += len(chunk.data)
        return chunk


def test_the_last_lines_and_a_since_are_read_back_from_the_end_only(tmp_path):
    """A 12 MB log: -n 50 and --since (the last minute) read a block or two from its end and start
    where a full read's last lines start."""
    path = tmp_path / "big_node0.log"
    with open(path, "w") as out:
        for it in range(1, 60001):
            out.write(iteration(T0 + timedelta(seconds=it), it) + f" {'x' * 100}\nprogress: {it}/100\n")
    size = path.stat().st_size
    source = CountingFile(str(path))
    window = find_window(source, size, None, 50, None, 0.0, LineFilter().keeps)
    assert source.bytes_read <= 2 << 20 and window.start > 0
    tail = path.read_bytes()[window.start:].decode().splitlines()
    assert len(tail) == 50 and tail[-1] == "progress: 60000/100"
    source.bytes_read = 0
    since = (T0 + timedelta(seconds=60000 - 60)).timestamp()
    window = find_window(source, size, None, None, since, 0.0, LineFilter().keeps)
    first = path.read_bytes()[window.start:].decode().splitlines()[0]
    assert source.bytes_read <= 2 << 20 and "iteration    59939/" in first, first  # the last line older than since
    ranked = find_window(source, size, None, 3, None, 0.0, LineFilter(rank=0).keeps)
    assert ranked.start == 0  # no line names rank 0: back to the start


def test_a_node_local_log_is_read_on_its_node_by_the_backend_s_command(tmp_path):
    """The one-liner the transport runs, for real (this machine's backend runs it as a process); and
    ssh's command line for it."""
    path = tmp_path / "node1.log"
    path.write_bytes(b"first\nsecond\nthird\n")
    launch = read_launch_env({"ARTIFACT_ROOT": str(tmp_path)}, python=sys.executable, cwd=str(REPO))
    source = FileOnNode(launch, ThisMachine(), "localhost", str(path))
    assert source.read(-6, 100).data == b"third\n" and source.read(6, 6).data == b"second"
    assert source.read(0, 3).size == 19
    with pytest.raises(LogUnreadable, match="no log at"):
        FileOnNode(launch, ThisMachine(), "localhost", str(tmp_path / "missing.log")).read(0, 10)
    argv = FileOnNode(launch, Ssh(options=("-p", "2222")), "node1", str(path)).argv(-100, 100)
    assert argv[:2] == ["ssh", "-o"] and "node1" in argv and READ_SCRIPT.splitlines()[0] in argv[-1]


# -- the command: bad input -----------------------------------------------------------------------

def logs_command(*args: str, root: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestration", "logs", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=clean_env(ARTIFACT_ROOT=str(root), **env))


def test_bad_input_is_one_error_line_and_exit_2(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "r1_node0.log").write_text("[supervisor node0] attempt 1 of 1: starting torchrun\nhello\n")
    (tmp_path / "logs" / "r1_node1.log").write_text("[supervisor node1] attempt 1 of 1: starting torchrun\n"
                                                    "[supervisor node1] finished: torchrun exited with code 0\n")
    for args, message in ((["nope"], "error: no run 'nope' under ARTIFACT_ROOT="),
                          (["r1", "--node", "5"], "error: --node 5: run r1 has node(s) 0 (localhost), 1 (h1)"),
                          (["r1", "--since", "yesterday"], "error: --since 'yesterday' is neither"),
                          (["r1", "--grep", "("], "error: --grep '(' is not a regular expression"),
                          (["r1", "-n", "0"], "error: -n/--lines 0 must be at least 1"),
                          (["bad/name"], "error: RUN='bad/name' is not a valid run name")):
        proc = logs_command(*args, root=tmp_path, HOSTS="localhost,h1")
        assert proc.returncode == 2 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert proc.stdout == "" and "Traceback" not in proc.stderr
    proc = logs_command("r1", root=tmp_path, HOSTS="localhost,h1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[nodes 0-1 supervisor] attempt 1 of 1: starting torchrun",
                                        "[node0 localhost rank?] hello",
                                        "[node1 h1 supervisor] finished: torchrun exited with code 0"], proc.stdout
    dry = logs_command("r1", "--node", "1", root=tmp_path, HOSTS="localhost,h1", DRY_RUN="1")
    assert [json.loads(l).get("read") for l in dry.stdout.splitlines()] == [None, "here"], dry.stdout
    (tmp_path / "logs" / "r1_node1.log").unlink()  # node 1's log neither here nor reachable: said, the rest shown
    proc = logs_command("r1", root=tmp_path, HOSTS="localhost,h1.invalid", SSH_OPTS="-o ConnectTimeout=1")
    assert proc.returncode == 1 and proc.stdout.count("\n") == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: node 1 (h1.invalid): ") and proc.stderr.count("\n") == 1, proc.stderr


# -- a real run -------------------------------------------------------------------------------------

def _interrupt_both_ranks(run: str) -> None:
    """SIGINT to each rank (not its children: a rank's helper processes carry its variables too)."""
    tagged = tagged_pids(run)
    ranks = [p for p in tagged if "LOCAL_RANK" in process_environ(p) and "LOCAL_RANK" not in process_environ(parent_pid(p) or 0)]
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGINT)


@pytest.mark.slow
def test_a_real_run_with_a_fault_reads_in_order_named_and_collapsed(artifact_root, tmp_path):
    """gpt_smoke on 2 processes, MAX_RESTARTS=1; both ranks SIGINTed mid-training (each prints the same
    first frames of its traceback), attempt 2 finishes. ``logs --follow`` started with the run ends by
    itself with it; the merged log names both ranks, shows each shared traceback line once for ranks
    0-1, the restart between the attempts, the iteration lines in order; -n, --rank, --since filter."""
    run = "logs_fault"
    env = clean_env(ARTIFACT_ROOT=str(artifact_root), MASTER_PORT=str(free_port()), MAX_RESTARTS="1", NPROC_PER_NODE="2")
    data = write_data_set(tmp_path / "data.yaml", train_iters=30, resilience="restart_backoff_s: 1")
    log = artifact_root / "logs" / f"{run}_node0.log"
    follower = None
    try:
        start = run_script("start_training.sh", "gpt_smoke", data, run, env=env)
        assert start.returncode == 0, start.stdout + start.stderr
        follower = subprocess.Popen(["bash", str(REPO / "training_scripts" / "logs_training.sh"), run, "--follow", "-n", "1000"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: last_iteration(log) >= 2, 120, interval_s=0.2, what="two iterations")
        _interrupt_both_ranks(run)
        exit_record = artifact_root / "run_state" / f"{run}_node0.exit.json"
        wait_for(exit_record.exists, 120, interval_s=0.5, what="the run to finish after its restart")
        followed, errors = follower.communicate(timeout=30)
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        run_script("stop_training.sh", run, env=env)
    assert json.loads(exit_record.read_text())["state"] == "finished"
    assert follower.returncode == 0, errors
    out = run_script("logs_training.sh", run, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    def texts(output, what):  # the text of the lines of one kind (a follow collapses only within what came together)
        return [l.split("] ", 1)[1] for l in output if what in l]
    for what in ("] iteration ", " supervisor] ", " torchrun] "):  # the follow saw them all, in the same order
        assert texts(followed.splitlines(), what) == texts(lines, what), (what, followed[-3000:])
    at = {name: next(i for i, l in enumerate(lines) if l.startswith(name)) for name in (
        "[node0 localhost supervisor] attempt 1 of 2: starting torchrun",
        "[node0 localhost ranks 0-1] Traceback (most recent call last):",
        "[node0 localhost supervisor] restarting as attempt 2 in 1 s",
        "[node0 localhost supervisor] attempt 2 of 2: starting torchrun",
        "[node0 localhost supervisor] finished: torchrun exited with code 0")}
    assert list(at.values()) == sorted(at.values()), at
    assert lines.count("[node0 localhost ranks 0-1] Traceback (most recent call last):") == 1
    assert "[node0 localhost ranks 0-1] KeyboardInterrupt" in lines
    for rank in (0, 1):  # each rank's frames: its own where the two were interrupted at different lines, else shared
        assert any(l.startswith((f"[node0 localhost rank{rank}]   File ", "[node0 localhost ranks 0-1]   File ")) for l in lines)
    assert any(l.startswith("[node0 localhost torchrun] E") and "failed (exitcode: -2)" in l for l in lines)
    stamps = [l.split("[", 2)[2].split("]")[0] for l in lines if "] iteration " in l]
    assert stamps == sorted(stamps) and len(stamps) >= 32, stamps  # attempt 1's few, then attempt 2's 30
    assert run_script("logs_training.sh", run, "-n", "1", env=env).stdout == lines[-1] + "\n"
    rank1 = run_script("logs_training.sh", run, "--rank", "1", env=env).stdout.splitlines()
    assert rank1 and all(l.startswith(("[node0 localhost rank1] ", "[node0 localhost ranks 0-1] ")) for l in rank1), rank1
    late = run_script("logs_training.sh", run, "--since", (datetime.now() + timedelta(hours=1)).strftime("%Y-%m-%d %H:%M"),
                      env=env)
    assert late.returncode == 0 and late.stdout == ""
    assert tagged_pids(run) == []
