"""Megatron-LM's manual garbage collection, for the training loop.

    python -c "from megatron_ext.training.manual_gc import ManualGc; help(ManualGc)"

At scale, Python's automatic collector stops one rank at a random step; every other rank then
waits for it in the next collective, so each rank's pauses add up for all. With
``training.manual_gc`` the collector is off and every rank collects at the same steps. Side
effects: the interpreter's garbage collector.
"""

from __future__ import annotations

import contextlib
import gc


class ManualGc:
    """Megatron-LM's ``--manual-gc`` (training.py, core_v0.16.1): Python's automatic collector off
    and one collection at the start (~L2579-2586), then every ``interval`` iterations on every rank
    at once (~L2297-2299; 0 = never in training), a full collection before each evaluation and a
    young-generation one after it (``--manual-gc-eval``, on by default: ~L2921-2923, ~L2956-2958).
    Off: nothing changes. ``collector``: the ``gc`` module (tests pass a recorder)."""

    def __init__(self, enabled: bool, interval: int, collector=gc):
        self.enabled, self.interval, self.gc = enabled, interval, collector

    def start(self) -> None:
        if self.enabled:
            self.gc.disable()
            self.gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            self.gc.collect()

    @contextlib.contextmanager
    def around_evaluation(self):
        if self.enabled:
            self.gc.collect()
        yield
        if self.enabled:
            self.gc.collect(generation=0)

    def stop(self) -> None:
        if self.enabled:
            self.gc.enable()
