"""A run's checkpoints, each verified or damaged: ``check_checkpoints.sh RUN``.

    bash training_scripts/check_checkpoints.sh demo            # CRC-32 of every recorded file
    bash training_scripts/check_checkpoints.sh demo --sizes    # sizes only: a quick look (status's line)

Reads the checkpoints under the artifact root (megatron_ext/run_spec/checksums.py says what they
record); nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.run_spec.checksums import DAMAGED_SUFFIX, CheckpointHealth, HealthState, health, list_checkpoints
from megatron_ext.run_spec.errors import Outcome
from megatron_ext.run_spec.run_paths import RunPaths


@dataclass(frozen=True)
class CheckpointReport(Outcome):
    run: str
    folder: str
    checkpoints: tuple[CheckpointHealth, ...]

    @property
    def loadable(self) -> CheckpointHealth | None:
        """The newest checkpoint a start would resume from (not damaged)."""
        return next((h for h in reversed(self.checkpoints) if h.state != HealthState.DAMAGED), None)

    @property
    def ok(self) -> bool:
        """No checkpoint yet, or one a start resumes from."""
        return self.loadable is not None or not self.checkpoints


def check_run_checkpoints(paths: RunPaths, sizes_only: bool = False) -> CheckpointReport:
    folder = paths.checkpoints_dir
    return CheckpointReport(paths.run, str(folder.resolve() if folder.exists() else folder),
                            tuple(health(path, it, sizes_only) for it, path in list_checkpoints(folder)))


def format_checkpoint_report(report: CheckpointReport) -> str:
    if not report.checkpoints:
        return f"run {report.run}: no checkpoint in {report.folder}"
    lines = [f"{'iteration':>10}  {'state':<11} damage"]
    for h in report.checkpoints:
        damage = "; ".join(d.describe() for d in h.damage) or "-"
        lines.append(f"{h.iteration:>10}  {h.state:<11} {damage}")
    best = report.loadable
    lines.append(f"a start resumes from iteration {best.iteration} ({best.state})" if best else
                 "no checkpoint verifies: a start would refuse to resume (exit 2)")
    return "\n".join(lines)


def moved_aside(paths: RunPaths) -> list[int]:
    """Iterations of the checkpoints a resume found damaged and moved aside (``iter_N.damaged``)."""
    folder = paths.checkpoints_dir
    names = (p.name.removeprefix("iter_").removesuffix(DAMAGED_SUFFIX) for p in folder.glob(f"iter_*{DAMAGED_SUFFIX}")) \
        if folder.is_dir() else ()
    return sorted(int(n) for n in names if n.isdigit())


def format_checkpoint_line(report: CheckpointReport, aside: list[int]) -> str | None:
    """Status's one line on the run's checkpoints, from a sizes-only report (cheap: no byte read)."""
    if not report.checkpoints and not aside:
        return None
    named = {HealthState.VERIFIED: "sizes ok", HealthState.UNRECORDED: "no checksums"}
    parts = [f"{h.iteration} {named.get(h.state, h.state)}"
             + (f" ({'; '.join(d.describe() for d in h.damage[:2])})" if h.damage else "") for h in report.checkpoints]
    line = f"checkpoints: {', '.join(parts) or 'none left'}"
    if aside:
        line += f"; moved aside as damaged: {', '.join(map(str, aside))}"
    return line + f" (check_checkpoints.sh {report.run} reads every byte)"
