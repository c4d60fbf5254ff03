"""The per-node supervisor: torchrun's parent, so that a run fails together and says how it ended.

    python -m orchestration node-supervise --plan-file $ARTIFACT_ROOT/run_state/demo_node1.plan.json

``node-start`` starts one per node, detached; it starts the node's torchrun exactly as the plan
says (same process group, so ``stop`` signals both), writes the pid file, and then, every
:data:`POLL_S` seconds:

- touches the node's heartbeat file;
- when torchrun exits: 0 -> the node ``finished``; non-zero (a worker died, an exception, a
  collective timeout) -> the node ``failed``, and the first failing node writes
  ``run_state/<run>_failure.txt`` (node, rank if torchrun named one, exit code or signal, the last
  lines of the node's log);
- when another node's failure file appears, or another node's heartbeat is older than
  :data:`NODE_LOST_S` (its machine or supervisor is gone), it stops its own torchrun (SIGTERM,
  which torchrun forwards to its workers, then the sweep by run tag) and records ``stopped``;
- on SIGTERM (``stop``) it lets torchrun stop and records ``stopped``.

torchrun's elastic agent already restarts nothing (``--max-restarts`` 0), watches its own
workers, tears them all down when one dies and exits non-zero; the supervisor adds what torchrun
does not do across nodes. The files live under the artifact root, which every node must see
(preflight checks it). Side effects: processes, the run_state files, the node log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.spec.run_paths import RunPaths
from orchestration import processes
from orchestration.plan import RUN_ID_TAG, NodePlan

POLL_S = 0.5
HEARTBEAT_S = 2.0
NODE_LOST_S = 20.0
"""A peer whose heartbeat is this old is taken as lost (its machine, or its supervisor, is gone)."""
LOG_TAIL_LINES = 25


@dataclass(frozen=True)
class NodeExit:
    """``run_state/<run>_node<N>.exit.json``."""

    node_rank: int
    state: str
    """finished, failed or stopped."""
    exit_code: int | None
    signal: str | None
    reason: str
    ended_at: float


def read_exit(path: Path) -> NodeExit | None:
    try:
        return NodeExit(**json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def _write_json(path: Path, raw: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)


def describe_exit(code: int) -> tuple[int | None, str | None]:
    """(exit code, signal name) of a Popen return code."""
    if code < 0:
        return None, signal.Signals(-code).name
    return code, None


_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")


def failure_summary(node_rank: int, host: str, code: int, log_tail: str) -> str:
    """The failure file's text: node, rank (from torchrun's error summary), exit, the log's end."""
    exit_code, sig = describe_exit(code)
    # torchrun's error summary names the root cause (first observed failure) after the others.
    root_cause = log_tail.rpartition("Root Cause")[2] if "Root Cause" in log_tail else log_tail
    ranks = sorted({int(m.group(1)) for m in _FAILED_RANK.finditer(root_cause)})
    what = f"exit code {exit_code}" if sig is None else f"signal {sig}"
    rank = f"rank {', '.join(map(str, ranks))}" if ranks else "rank unknown"
    return (f"node {node_rank} ({host}) failed: torchrun {what}; {rank}\n"
            f"--- last lines of node {node_rank}'s log ---\n{log_tail}\n")


def claim_failure(paths: RunPaths, text: str) -> bool:
    """Write the run's failure file unless another node already did (the first failure wins)."""
    try:
        fd = os.open(paths.failure_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return True


class Supervisor:
    def __init__(self, plan: NodePlan, paths: RunPaths, nnodes: int):
        self.plan, self.paths, self.nnodes = plan, paths, nnodes
        self.stopping = False
        self.started = time.time()

    def _on_sigterm(self, signum, frame) -> None:
        self.stopping = True  # torchrun, in the same process group, got the signal too

    def _beat(self) -> None:
        self.paths.node_heartbeat_file(self.plan.node_rank).touch()

    def _lost_peer(self) -> int | None:
        """A peer whose heartbeat went stale while it had not ended."""
        now = time.time()
        for rank in range(self.nnodes):
            if rank == self.plan.node_rank or read_exit(self.paths.node_exit_file(rank)):
                continue
            beat = self.paths.node_heartbeat_file(rank)
            try:
                age = now - beat.stat().st_mtime
            except FileNotFoundError:
                age = now - self.started  # not started yet: give it NODE_LOST_S from our own start
            if age > NODE_LOST_S:
                return rank
        return None

    def _record(self, state: str, code: int | None, reason: str) -> None:
        exit_code, sig = describe_exit(code) if code is not None else (None, None)
        _write_json(self.paths.node_exit_file(self.plan.node_rank),
                    asdict(NodeExit(self.plan.node_rank, state, exit_code, sig, reason, time.time())))
        print(f"[supervisor node{self.plan.node_rank}] {state}: {reason}", flush=True)

    def _stop_torchrun(self, proc: subprocess.Popen, reason: str) -> None:
        print(f"[supervisor node{self.plan.node_rank}] stopping: {reason}", flush=True)
        processes.stop_run(self.plan.run, self.plan.node_rank, self.plan.host, Path(self.plan.pid_path),
                           signal_group=False)
        proc.poll()
        self._record("stopped", proc.returncode, reason)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        log = Path(self.plan.log_path)
        with open(log, "ab", buffering=0) as out:
            proc = subprocess.Popen(list(self.plan.argv), cwd=self.plan.cwd, env=self.plan.process_environment(os.environ),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        step = f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}" if "SLURM_STEP_ID" in os.environ else None
        record = processes.new_record(self.plan.run, self.plan.run_id, self.plan.node_rank, self.plan.host, proc,
                                      self.plan.argv, log, supervisor_pid=os.getpid(), slurm_step=step)
        processes.write_pid_file(Path(self.plan.pid_path), record)
        last_beat = 0.0
        while True:
            code = proc.poll()
            if code is not None:
                if code == 0:
                    self._record("finished", 0, "torchrun exited with code 0")
                elif self.stopping:
                    self._record("stopped", code, "stopped on request")
                else:
                    from orchestration.node import tail

                    text = failure_summary(self.plan.node_rank, self.plan.host, code, tail(log, LOG_TAIL_LINES))
                    claim_failure(self.paths, text)
                    self._record("failed", code, text.splitlines()[0])
                return 0
            if not self.stopping:
                if self.paths.failure_file.exists():
                    self._stop_torchrun(proc, f"another node failed: {self.paths.failure_file.read_text().splitlines()[0]}")
                    return 0
                lost = self._lost_peer()
                if lost is not None:
                    claim_failure(self.paths, f"node {lost} lost: no heartbeat for {NODE_LOST_S:.0f} s (its machine or "
                                              f"its supervisor is gone); noticed by node {self.plan.node_rank}\n")
                    self._stop_torchrun(proc, f"node {lost} lost (no heartbeat for {NODE_LOST_S:.0f} s)")
                    return 0
            if time.time() - last_beat >= HEARTBEAT_S:
                self._beat()
                last_beat = time.time()
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestration node-supervise")
    p.add_argument("--plan-file", required=True, help="the node's plan; {node} is replaced by SLURM_NODEID (srun)")
    args = p.parse_args(argv)
    plan_file = Path(args.plan_file.replace("{node}", os.environ.get("SLURM_NODEID", "0")))
    plan = NodePlan.from_json(plan_file.read_text())
    if os.environ.get(RUN_ID_TAG) != plan.run_id:  # started by srun: take the plan's environment and tags first
        os.execve(sys.executable, [sys.executable, "-m", "orchestration", "node-supervise", "--plan-file", args.plan_file],
                  plan.process_environment(os.environ))
    paths = RunPaths(Path(plan.env["ARTIFACT_ROOT"]), plan.run)
    if "SLURM_STEP_ID" in os.environ:  # a task of the start step: a process group of its own, so stop signals only the run
        os.setpgid(0, 0)
    return Supervisor(plan, paths, int(plan.env["NNODES"])).run()


if __name__ == "__main__":
    sys.exit(main())
