"""A rank's busy time: its training steps less the time it waits for the others in collectives.

The slow-rank measure (run_spec/resilience.py :func:`slow_ranks`). A rank that is slow makes every
other rank wait for it in the next data-parallel collective, wherever that falls (the gradient
reduction inside backward, the parameter gathers inside forward at stages 2-3, the optimizer's
broadcasts at stage 1); its own time is spent working (or stopped), theirs waiting. So the time
that tells them apart is each rank's time *not* waiting.

- CPU (:class:`SampledBusyClock`): torch DDP's reducer and FSDP2 wait for gloo inside C++, where no
  Python clock can stand at a collective's edges; the rank's main thread sleeps there (state ``S``:
  a futex) and the process uses no CPU. A daemon thread samples both every :data:`PERIOD_S` during
  training steps: the main thread asleep while the whole process used less than
  :data:`IDLE_CPU_SHARE` of a core is waiting; anything else is busy: running, runnable but
  descheduled, in the disk, asleep while torch's intra-op threads compute (a rank with more than
  one thread), and any gap in which the sampler itself did not run (a stopped or starved process).
- CUDA (:class:`EventBusyClock`): CUDA events around each micro-batch's forward and backward on the
  compute stream (the kernels' time, not their launch). Megatron-core reduces gradients on its own
  stream, so the reduction's waiting is not in them; at stage 1 with overlapped parameter gathers
  the forward stream waits for a gather, and a waiting rank's forward holds that wait (checked on
  a GPU only: docs/faults.md).

Side effects: a daemon thread reading ``/proc/self/task/<main thread>/stat`` and getrusage (CPU).
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time

import torch

PERIOD_S = 0.01
"""How often the CPU clock samples the main thread's state (about 1% of a core: benchmarks/resilience.py)."""
GAP_S = 0.05
"""A sample later than this after the one before: the process did not run in between (stopped, or
starved of CPU), which is this rank's time, not a wait for the others."""
IDLE_CPU_SHARE = 0.2
"""The process's CPU time over a sample's interval, as a share of it, below which a sleeping main
thread waits for the others (a waiting rank's threads sleep too: gloo's wait on the network, this
clock's own samples ~1%); above it, other threads compute for it (torch's intra-op pool)."""


def thread_state(stat_text: str) -> str:
    """The state letter of a ``/proc/<pid>/task/<tid>/stat`` line (after the command's parenthesis,
    which may itself hold spaces and parentheses). Pure."""
    return stat_text[stat_text.rindex(")") + 2]


def busy_share(state: str, elapsed_s: float, cpu_s: float) -> float:
    """The part of ``elapsed_s`` (since the last sample, in which the whole process used ``cpu_s`` of
    CPU) that counts as busy for a main thread seen in ``state`` now: all of it unless it sleeps
    (``S``), its process idles, and the sampler ran on time. Pure."""
    waiting = state == "S" and elapsed_s <= GAP_S and cpu_s < IDLE_CPU_SHARE * elapsed_s
    return 0.0 if waiting else elapsed_s


def process_cpu_s() -> float:
    """CPU seconds of every thread of this process so far (getrusage: the scheduler's exact sum)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class SampledBusyClock:
    """CPU: the main thread's busy seconds within :meth:`counting`, sampled by a daemon thread."""

    def __init__(self, period_s: float = PERIOD_S):
        self.period_s = period_s
        self._stat = os.open(f"/proc/self/task/{threading.get_native_id()}/stat", os.O_RDONLY)  # this (main) thread
        self._busy = 0.0
        self._counting = False
        self._lock = threading.Lock()
        threading.Thread(target=self._sample, name="busy-clock", daemon=True).start()

    def _sample(self) -> None:
        last, last_cpu = None, 0.0
        while True:
            time.sleep(self.period_s)
            if not self._counting:  # between steps: nothing to read
                last = None
                continue
            state = thread_state(os.pread(self._stat, 512, 0).decode(errors="replace"))
            now, cpu = time.monotonic(), process_cpu_s()
            with self._lock:
                if self._counting and last is not None:
                    self._busy += busy_share(state, now - last, cpu - last_cpu)
            last, last_cpu = now, cpu

    @contextlib.contextmanager
    def counting(self):
        """Around a training step: only its time counts."""
        with self._lock:
            self._counting = True
        try:
            yield
        finally:
            with self._lock:
                self._counting = False

    @contextlib.contextmanager
    def compute(self):
        yield

    def take(self) -> float:
        """Busy seconds since the last take."""
        with self._lock:
            busy, self._busy = self._busy, 0.0
        return busy


class EventBusyClock:
    """CUDA: the kernel time of forward and backward, by events on the current stream."""

    def __init__(self):
        self.events: list = []

    @contextlib.contextmanager
    def counting(self):
        yield

    @contextlib.contextmanager
    def compute(self):
        """Around one micro-batch's forward and backward."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def take(self) -> float:
        """Seconds since the last take (waits for the last end event, complete already at a log
        interval, where the loop synchronizes)."""
        if not self.events:
            return 0.0
        self.events[-1][1].synchronize()
        total = sum(start.elapsed_time(end) for start, end in self.events) / 1000.0
        self.events = []
        return total

