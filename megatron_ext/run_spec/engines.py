"""The two engines a run trains with, one object each: this project's program on megatron-core, and a
Megatron-LM checkout's ``pretrain_gpt.py``. ``training.engine`` (ENGINE) names one; the rest of the
code asks :func:`engine_named`'s object, never compares the name.

    python -c "from megatron_ext.run_spec.engines import ENGINES; print([e.label for e in ENGINES.values()])"

What each supplies: the program torchrun runs, its save signal, where its progress comes from, how
its node log is read, which checkpoints another data-parallel size can load, its known limits and
what its checkpoints' checksums cover. Building the Megatron-LM program itself (its flags, its
checks) is orchestration/megatron_lm/'s. Pure.
"""

from __future__ import annotations

from typing import Literal, get_args

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.iteration_log import MEGATRON_LM_STARTS, IterationRecord, parse_log

EngineName = Literal["megatron-core", "megatron-lm"]


class Engine:
    """What each engine supplies (the defaults are this program's)."""

    name: EngineName = "megatron-core"
    label = "this program (megatron-core)"
    tag = ""
    """How tables and notes mark a run of this engine (none for the default)."""
    program = "-m megatron_ext.pretrain"
    save_signal = "SIGUSR1"
    """Every rank installs its handler once it reported progress, saves at the next step and ends."""
    progress_from_log = False
    """Progress comes from the ranks' own progress files (a phase and a step each)."""
    progress_note = ""
    runs_checkout = False
    """Runs a Megatron-LM checkout (MEGATRON_LM_DIR) on data the launcher prepares, on GPUs, and
    saves Megatron-LM's checkpoints (which it checks and resumes itself)."""
    known_limits = "none beyond megatron-core's own: every stage saves and resumes"
    checksums = "every file each rank wrote, CRC32 in the checkpoint's checksum records"
    log_starts: tuple[str, ...] = ()
    """Lines that mark a start in its node log: the second iteration line after each is that interval's own mean."""

    def parse_log(self, text: str, seq_length: int | None = None, world_size: int = 0,
                  zero_stage: int = -1) -> tuple[list[IterationRecord], int]:
        return parse_log(text, seq_length, world_size, zero_stage, starts=self.log_starts)

    def reshard_refusal(self, stage: int, device: Device) -> str | None:
        """Why a checkpoint of ``stage`` cannot be loaded at another data-parallel size, or None."""
        if device == Device.CPU and stage == 1:
            return "the CPU path's stage-1 checkpoints hold torch's ZeroRedundancyOptimizer partitions of each rank"
        return None


class MegatronCore(Engine):
    """This project's program (``python -m megatron_ext.pretrain``) on megatron-core."""


class MegatronLM(Engine):
    """A Megatron-LM checkout's ``pretrain_gpt.py`` (MEGATRON_LM_DIR), on GPUs."""

    name: EngineName = "megatron-lm"
    label = tag = "Megatron-LM"
    program = "pretrain_gpt.py"
    save_signal = "SIGTERM"
    """Its ``--exit-signal-handler``'s default (the render picks SIGUSR1 where the checkout has
    ``--exit-signal``); sent once the log shows an iteration line."""
    progress_from_log = True
    """Progress comes from the node log's iteration lines (only the last rank's node prints them)."""
    progress_note = " (Megatron-LM: from its iteration lines)"
    runs_checkout = True
    known_limits = "orchestration/megatron_lm/program.py known_limits, per release (docs/megatron-lm.md)"
    checksums = "integrity.json's SHA-256 of each file (torch_dist, core_v0.17.1 and later)"
    log_starts = MEGATRON_LM_STARTS

    def reshard_refusal(self, stage: int, device: Device) -> str | None:  # noqa: ARG002 (the interface's signature)
        if stage != 0:
            return ("Megatron-LM's checkpoints are resharded here at stage 0 only (stage 1 cannot resume without apex "
                    "or transformer-engine, stages 2-3 cannot save: see docs/megatron-lm.md)")
        return None


MEGATRON_CORE, MEGATRON_LM = MegatronCore(), MegatronLM()
ENGINES: dict[str, Engine] = {e.name: e for e in (MEGATRON_CORE, MEGATRON_LM)}
assert tuple(ENGINES) == get_args(EngineName)


def engine_named(name: str | None) -> Engine:
    """The engine ``name`` names (a run recorded before engines were named: this program)."""
    return ENGINES.get(name or MEGATRON_CORE.name, MEGATRON_CORE)
