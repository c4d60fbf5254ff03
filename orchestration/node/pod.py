"""A Kubernetes pod's main process: its node's supervisor for the plan its completion index picks,
started as ``node-start`` starts it over ssh; SIGTERM asks for a save; the exit code says how the
node ended.

    JOB_COMPLETION_INDEX=1 python -m orchestration node-pod --plan-dir /etc/megatron-launcher/plan   # node1.json

What a kubelet starts (orchestration/cluster/kubernetes.py renders it), in order:

1. the plan ``PLAN_DIR/node<JOB_COMPLETION_INDEX>.json`` (the ConfigMap of every node's plan; of
   more nodes than it holds readable, that entry of ``plans.json.gz``), which names this pod's node
   rank, its stable host name and everything its supervisor runs;
2. what this node's last start left goes (node 0: the run's failure and attempt files), and the
   plan is written where ``status`` and ``rejoin`` read it (run_state/<run>_node<N>.plan.json);
3. the node's supervisor (``node-supervise``) with the plan's environment over the pod's (the
   secrets come from the pod's, by ``secretKeyRef``), detached, its output in the node log on the
   shared artifact root, which this process copies to its own output (``kubectl logs``);
4. SIGTERM (the pod deleted, evicted or preempted: ``stop``) becomes SIGUSR1 to the supervisor,
   ``stop --save``: every node saves at its next step and ends ``preempted`` within the pod's
   ``terminationGracePeriodSeconds``; a SIGTERM that comes before the supervisor has its handler
   waits for it. As a container's PID 1 it also reaps every orphan (what tini does);
5. the exit code from the supervisor's exit record: 0 finished (the Job completes), 3 preempted,
   93 the restart breaker gave up, 1 anything else. Any but 0 fails the Job (``backoffLimit: 0``),
   and JobSet restarts every pod while ``failurePolicy.maxRestarts`` allows: the outer budget
   after the supervisor's own restarts in place.

Side effects: processes, the node's run_state files, this process's output. Imports nothing of
the launcher side.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

from megatron_ext.host.json_files import read_json
from megatron_ext.run_spec.errors import EXIT_GAVE_UP, EXIT_NODE_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_USER_ERROR
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.node.run_state import RunState, read_exit, reset_node_files, reset_run_files, write_plan_file
from orchestration.node.wire import PACKED_PLANS, NodePlan, decode_payload, node_label, supervise_argv

log = logging.getLogger(__name__)

INDEX_ENV = "JOB_COMPLETION_INDEX"
"""Set in every pod of an Indexed Job by the Job controller: the pod's index, this node's rank."""
POLL_S = 0.5
EXIT_CODES = {RunState.FINISHED: EXIT_OK, RunState.PREEMPTED: EXIT_PREEMPTED, RunState.GAVE_UP: EXIT_GAVE_UP}


def read_plan(plan_dir: str, environ: Mapping[str, str]) -> NodePlan:
    """This pod's plan: ``node<JOB_COMPLETION_INDEX>.json`` under ``plan_dir``, or that entry of
    ``plans.json.gz`` (a run of more nodes than one ConfigMap holds readable); a ValueError naming
    what is missing."""
    index = environ.get(INDEX_ENV, "").strip()
    if not index.isdigit():
        raise ValueError(f"{INDEX_ENV} is {index!r}, not a pod index: node-pod runs in a pod of an Indexed Job "
                         "(completionMode: Indexed), whose controller sets it")
    path, packed = Path(plan_dir) / f"node{int(index)}.json", Path(plan_dir) / PACKED_PLANS
    if path.is_file():
        return decode_payload(NodePlan, read_json(path) or {})
    plans = json.loads(gzip.decompress(packed.read_bytes())) if packed.is_file() else []
    if int(index) >= len(plans):
        held = sorted(p.name for p in Path(plan_dir).glob("*")) if Path(plan_dir).is_dir() else []
        raise ValueError(f"{path} does not exist: the plans' ConfigMap holds {', '.join(held) or 'nothing'}"
                         + (f" ({len(plans)} plans in {PACKED_PLANS})" if packed.is_file() else ""))
    return decode_payload(NodePlan, plans[int(index)])


def catches(pid: int, signum: int) -> bool:
    """``pid`` has a handler for ``signum`` (/proc/PID/status SigCgt): a signal now reaches it, not its default."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class Pod:
    """The node's supervisor run to its end, as a pod's main process."""

    def __init__(self, plan: NodePlan, environ: Mapping[str, str], python: str):
        self.plan, self.environ, self.python = plan, dict(environ), python
        self.paths = RunPaths(plan.artifact_root, plan.run)
        self.label = node_label(plan.node_rank, plan.host)
        self.save_asked = False
        self.save_sent = False
        self.supervisor: subprocess.Popen | None = None
        self._log_offset = 0

    def say(self, text: str) -> None:
        log.info("[pod] %s %s", self.label, text)

    def _on_sigterm(self, _signum, _frame) -> None:
        self.save_asked = True  # passed on at the next poll, once the supervisor has its handler

    def start(self) -> None:
        plan = self.plan
        reset_node_files(self.paths, plan.node_rank)
        if plan.resets_run_state:
            reset_run_files(self.paths, keep_ledger=plan.first_attempt > 1)
        plan_file = write_plan_file(self.paths, plan.node_rank, plan.to_json())
        log_path = Path(plan.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab", buffering=0) as out:
            self.supervisor = subprocess.Popen(supervise_argv(self.python, str(plan_file)), cwd=plan.cwd,
                                               env=plan.process_environment(self.environ), stdin=subprocess.DEVNULL,
                                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self.say(f"run {plan.run} ({plan.run_id}): node {plan.node_rank} of {plan.nnodes}, supervisor pid "
                 f"{self.supervisor.pid}; log {log_path}")

    def _copy_log(self) -> None:
        """The node log's new lines to this process's output (what ``kubectl logs`` shows)."""
        try:
            with open(self.plan.log_path, "rb") as f:
                f.seek(self._log_offset)
                chunk = f.read(1 << 20)
        except OSError:
            return
        if chunk:
            self._log_offset += len(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()

    def _reap(self) -> int | None:
        """Every ended child reaped (as PID 1, orphans too); the supervisor's exit status once it ended."""
        ended = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return ended if ended is not None else (self.supervisor.returncode if self.supervisor else 0)
            if pid == 0:
                return ended
            if self.supervisor is not None and pid == self.supervisor.pid:
                ended = os.waitstatus_to_exitcode(status)
                self.supervisor.returncode = ended

    def wait(self) -> int:
        """Until the supervisor has ended: its exit record's state as the pod's exit code."""
        while True:
            code = self._reap()
            self._copy_log()
            if code is not None:
                break
            if self.save_asked and not self.save_sent and catches(self.supervisor.pid, signal.SIGUSR1):
                os.kill(self.supervisor.pid, signal.SIGUSR1)
                self.save_sent = True
                self.say("SIGTERM: asked every node to save at its next step and end (stop --save)")
            time.sleep(POLL_S)
        ended = read_exit(self.paths, self.plan.node_rank, self.plan.run_id)
        if ended is None:
            self.say(f"the supervisor exited with {code} and left no exit record: failed")
            return EXIT_NODE_FAILED
        exit_code = EXIT_CODES.get(ended.state, EXIT_NODE_FAILED)
        self.say(f"{ended.state.value}: {ended.reason} (exit {exit_code})")
        return exit_code

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.start()
        return self.wait()


def run_pod(plan_dir: str, environ: Mapping[str, str], python: str) -> int:
    """``node-pod``: this pod's node, from its plan to its end (the pod's exit code)."""
    try:
        plan = read_plan(plan_dir, environ)
    except (ValueError, OSError) as exc:
        log.error("error: %s", exc)
        return EXIT_USER_ERROR
    return Pod(plan, environ, python).run()
