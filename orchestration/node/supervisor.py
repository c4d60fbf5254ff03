"""The per-node supervisor: torchrun's parent, so that a run fails together and says how it ended.

    python -m orchestration node-supervise --plan-file $ARTIFACT_ROOT/run_state/demo_node1.plan.json

``node-start`` starts one per node, detached (under Slurm, one task of the start's srun step per
node); it starts the node's torchrun exactly as the plan says (same process group, so ``stop``
signals both), writes the pid file, and then, every :data:`POLL_S` seconds:

- touches the node's heartbeat file;
- when torchrun exits: 0 -> the node ``finished``; non-zero (a worker died, an exception, a
  collective timeout) -> the node ``failed``, and the first failing node writes
  ``run_state/<run>_failure.txt`` (node, rank if torchrun named one, exit code or signal, the last
  lines of the node's log);
- when another node's failure file appears, or another node's heartbeat is older than
  :data:`~orchestration.node.run_state.NODE_LOST_S` (its machine or supervisor is gone), it stops
  its own torchrun (SIGTERM, which torchrun forwards to its workers, then the sweep by run tag)
  and records ``stopped``;
- on SIGTERM (``stop``) it lets torchrun stop and records ``stopped``.

torchrun's elastic agent already restarts nothing (``--max-restarts`` 0), watches its own
workers, tears them all down when one dies and exits non-zero; the supervisor adds what torchrun
does not do across nodes. The files live under the artifact root, which every node must see
(preflight checks it). Side effects: processes, the run_state files, the node log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping

from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node import processes
from orchestration.node.failure import describe_returncode, failure_summary
from orchestration.node.node_plan import NodePlan
from orchestration.node.run_state import (HEARTBEAT_S, NODE_LOST_S, NodeExit, RunState, claim_failure, heartbeat_age_s,
                                          read_exit, read_failure, tail, touch_heartbeat, write_exit)

POLL_S = 0.5
LOG_TAIL_LINES = 25


class Supervisor:
    def __init__(self, plan: NodePlan, node_env: Mapping[str, str], slurm_step: str | None = None):
        self.plan, self.node_env, self.slurm_step = plan, dict(node_env), slurm_step
        """``node_env``: the node's own environment (the plan's goes on top); ``slurm_step``:
        JOB.STEP when this supervisor is a task of the start's srun step."""
        self.paths = RunPaths(plan.artifact_root, plan.run)
        self.nnodes = plan.nnodes
        self.stopping = False
        self.started = time.time()

    def _on_sigterm(self, signum, frame) -> None:
        self.stopping = True  # torchrun, in the same process group, got the signal too

    def say(self, text: str) -> None:
        print(f"[supervisor node{self.plan.node_rank}] {text}", flush=True)

    def _lost_peer(self) -> int | None:
        """A peer whose heartbeat went stale while it had not ended."""
        now = time.time()
        for rank in range(self.nnodes):
            if rank == self.plan.node_rank or read_exit(self.paths, rank):
                continue
            age = heartbeat_age_s(self.paths, rank, now)
            if (now - self.started if age is None else age) > NODE_LOST_S:  # never beat: NODE_LOST_S from our start
                return rank
        return None

    def _record(self, state: RunState, code: int | None, reason: str) -> None:
        exit_code, sig = describe_returncode(code) if code is not None else (None, None)
        write_exit(self.paths, NodeExit(self.plan.node_rank, state, exit_code, sig, reason, time.time()))
        self.say(f"{state}: {reason}")

    def _stop_torchrun(self, proc: subprocess.Popen, reason: str) -> None:
        self.say(f"stopping: {reason}")
        processes.stop_run(self.plan.run, self.plan.node_rank, self.plan.host, Path(self.plan.pid_path),
                           signal_group=False)
        proc.poll()
        self._record(RunState.STOPPED, proc.returncode, reason)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        log = Path(self.plan.log_path)
        with open(log, "ab", buffering=0) as out:
            proc = subprocess.Popen(list(self.plan.argv), cwd=self.plan.cwd, env=self.plan.process_environment(self.node_env),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        record = processes.new_record(self.plan.run, self.plan.run_id, self.plan.node_rank, self.plan.host, proc,
                                      self.plan.argv, log, supervisor_pid=os.getpid(), slurm_step=self.slurm_step)
        processes.write_pid_file(Path(self.plan.pid_path), record)
        last_beat = 0.0
        while True:
            code = proc.poll()
            if code is not None:
                if code == 0:
                    self._record(RunState.FINISHED, 0, "torchrun exited with code 0")
                elif self.stopping:
                    self._record(RunState.STOPPED, code, "stopped on request")
                else:
                    text = failure_summary(self.plan.node_rank, self.plan.host, code, tail(log, LOG_TAIL_LINES))
                    claim_failure(self.paths, text)
                    self._record(RunState.FAILED, code, text.splitlines()[0])
                return 0
            if not self.stopping:
                failure = read_failure(self.paths)
                if failure is not None:
                    self._stop_torchrun(proc, f"another node failed: {failure}")
                    return 0
                lost = self._lost_peer()
                if lost is not None:
                    claim_failure(self.paths, f"node {lost} lost: no heartbeat for {NODE_LOST_S:.0f} s (its machine or "
                                              f"its supervisor is gone); noticed by node {self.plan.node_rank}\n")
                    self._stop_torchrun(proc, f"node {lost} lost (no heartbeat for {NODE_LOST_S:.0f} s)")
                    return 0
            if time.time() - last_beat >= HEARTBEAT_S:
                touch_heartbeat(self.paths, self.plan.node_rank)
                last_beat = time.time()
            time.sleep(POLL_S)
