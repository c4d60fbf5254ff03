"""What a rank tells its node's supervisor, and how the ranks agree to save and stop.

    LAUNCHER_PROGRESS_DIR=/dev/shm/... torchrun ... -m megatron_ext.pretrain ...   # set by the supervisor

:class:`ProgressReporter` rewrites ``<dir>/rank<R>.json`` (:class:`~megatron_ext.run_spec.resilience.RankProgress`)
at every phase change: no collective, one small atomic write in a node-local directory (tmpfs)
per step; SIGUSR2 makes faulthandler write every thread's stack beside it, and a request file
makes a thread write the rank's flight recorder (torch's record of its collectives) there.
:class:`SaveRequest` is Megatron-LM's DistributedSignalHandler in this program: SIGUSR1
(sent by the supervisor to each rank when a preemption or a time limit comes, or a ``stop --save``)
sets a flag, and at every step boundary the ranks agree on it with one all-reduce of one integer on
a gloo group (host memory: no CUDA synchronisation), so all of them save the same iteration and
end together. Without a progress directory (plain torchrun) both are off. Side effects: that file,
a signal handler, the collective.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ext.host.json_files import write_text_atomic
from megatron_ext.run_spec.resilience import DUMP_REQUEST, RECENT_STEPS, Phase, RankProgress, write_progress

FLIGHT_RECORDER_POLL_S = 0.5
DUMP_FLIGHT_RECORDER = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
"""torch >= 2.6: every collective this process issued, per process group, gloo and NCCL alike."""


def process_groups() -> dict[str, dict[str, str]]:
    """Every process group this rank belongs to, as the flight recorder's ``pg_config`` names them
    (name -> name, description, global ranks). ProcessGroupGloo records its ranks before the group
    has a name, so its dump's own ``pg_config`` is one unnamed entry (torch 2.13; torch's analyser
    then fails): rebuilt here from torch.distributed's own table of groups."""
    world = dist.distributed_c10d._world
    return {pg.group_name: {"name": pg.group_name, "desc": pg.group_desc, "ranks": str(sorted(ranks))}
            for pg, ranks in list(world.pg_group_ranks.items()) if isinstance(pg, dist.ProcessGroup)}


class ProgressReporter:
    def __init__(self, directory: Path | None, rank: int, local_rank: int, attempt: int):
        self.directory = directory
        self.rank, self.local_rank, self.attempt = rank, local_rank, attempt
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.steps_done = 0
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.iteration = 0
        self._stack_file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            # SIGUSR2 -> every thread's stack into <dir>/rank<R>.stack, written by faulthandler from C,
            # so it works inside a collective too: the supervisor's dump when py-spy cannot read the rank.
            self._stack_file = open(directory / f"rank{rank}.stack", "a")
            faulthandler.register(signal.SIGUSR2, file=self._stack_file, all_threads=True)
            threading.Thread(target=self._flight_recorder, name="flight-recorder", daemon=True).start()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def phase(self, name: Phase, iteration: int | None = None) -> None:
        if iteration is not None:
            self.iteration = iteration
        if self.directory is None:
            return
        write_progress(self.directory, RankProgress(
            rank=self.rank, local_rank=self.local_rank, host=self.host, pid=self.pid, attempt=self.attempt,
            iteration=self.iteration, phase=name, phase_started_at=time.time(), steps_done=self.steps_done,
            slowest_recent_step_s=max(self.recent) if self.recent else None))

    def _flight_recorder(self) -> None:
        """On the supervisor's request, torch's flight recorder of this rank (the collectives it
        issued, per process group) to ``rank<R>.fr.json``: a thread, so it answers while the main
        thread waits inside a collective (which releases the GIL)."""
        request, out, seen = self.directory / DUMP_REQUEST, self.directory / f"rank{self.rank}.fr.json", 0.0
        while True:
            time.sleep(FLIGHT_RECORDER_POLL_S)
            try:
                asked = request.stat().st_mtime
            except FileNotFoundError:
                continue
            if asked <= seen:
                continue
            seen = asked
            try:
                if DUMP_FLIGHT_RECORDER is None:
                    raise RuntimeError("this torch has no flight recorder dump (_dump_fr_trace_json)")
                record = json.loads(DUMP_FLIGHT_RECORDER(True, False))
                record["pg_config"] = process_groups()
                text = json.dumps(record)
            except Exception as exc:  # the recorder off, or a torch without it
                text = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            write_text_atomic(out, text.decode() if isinstance(text, bytes) else text)

    def step_done(self, seconds: float) -> None:
        self.steps_done += 1
        self.recent.append(seconds)


class SaveRequest:
    """SIGUSR1 -> save at the next step boundary on every rank, then end ("preempted")."""

    SIGNAL = signal.SIGUSR1

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received = False
        self.group = None
        if enabled:
            signal.signal(self.SIGNAL, self._on_signal)

    def _on_signal(self, _signum, _frame) -> None:
        self.received = True

    def open_group(self, on_cuda: bool) -> None:
        """The group the flag is agreed on: the world's own on CPU (gloo already), one gloo group
        beside NCCL on GPUs (a host tensor: the check never waits for the GPU)."""
        if self.enabled and on_cuda:
            self.group = dist.new_group(backend="gloo")

    def agreed(self) -> bool:
        """Whether any rank got the signal (a collective: every rank calls it at the same step)."""
        if not self.enabled:
            return False
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())
