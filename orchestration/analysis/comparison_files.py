"""What a comparison writes besides its table: a PNG, JSON and CSV with the same numbers.

    python -m orchestration compare demo_z0 demo_z1 demo_z3 --name demo
    # -> $ARTIFACT_ROOT/compare/demo.png, demo.json, demo.csv

The PNG (matplotlib, Agg backend: no display needed) has four panels: loss against iteration for
every run, the loss difference from the first run, tokens/s per run, and memory per rank per run
(bars, with the plan marked). JSON holds every field of every run (loss series included), CSV one
row per run with the table's columns at full precision. matplotlib is imported inside
:func:`write_png` only: it is optional (no PNG without it) and slow to import. Side effects:
those three files.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.engines import engine_named
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.run_paths import RUN_NAME_RE, check_run_name
from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS, MB, RunSummary, base_run, loss_difference, ratio
from orchestration.node.run_state import RunState

CSV_COLUMNS = (
    "run", "engine", "model", "data_set", "zero_stage", "nnodes", "nproc_per_node", "world_size", "device", "iterations",
    "train_iters", "status", "reason", "warmup_iterations", "step_time_s", "tokens_per_s", "tokens_per_s_ratio",
    "tflops_per_gpu", "mfu", "model_state_bytes", "planned_model_state_bytes", "peak_memory_bytes", "planned_peak_bytes",
    "peak_memory_ratio", "peak_memory_per_rank", "peak_rss_bytes", "first_loss", "last_loss", "max_loss_diff_abs",
    "max_loss_diff_rel", "wall_clock_s", "goodput",
)


@dataclass(frozen=True)
class ComparisonFiles:
    png_path: Path | None
    """None when matplotlib is not installed."""
    json_path: Path
    csv_path: Path


def comparison_rows(rows: Sequence[RunSummary]) -> list[dict]:
    """Every run as a flat dict: its summary plus the figures against the first run."""
    base = base_run(list(rows))
    out = []
    for r in rows:
        diff = loss_difference(base, r) if base and r.has_records else None
        row = dataclasses.asdict(r)
        row.update(
            tokens_per_s_ratio=ratio(r.tokens_per_s, base and base.tokens_per_s),
            peak_memory_ratio=ratio(r.peak_memory_bytes, base and base.peak_memory_bytes),
            max_loss_diff_abs=diff.max_abs if diff else None, max_loss_diff_rel=diff.max_rel if diff else None,
            max_loss_diff_iteration=diff.at_iteration if diff else None,
        )
        out.append(row)
    return out


def write_json(path: Path, name: str, rows: Sequence[RunSummary]) -> None:
    base = base_run(list(rows))
    doc = {
        "name": name,
        "base_run": base.run if base else None,
        "warmup_iterations": rows[0].warmup_iterations if rows else DEFAULT_WARMUP_ITERATIONS,
        "units": {"time": "s", "memory": "bytes per rank (largest over ranks)", "throughput": "tokens/s over all ranks",
                  "tflops_per_gpu": "TFLOP/s per rank", "mfu": "fraction of the device's dense BF16 peak",
                  "loss": "lm loss, nats per token"},
        "runs": comparison_rows(rows),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


def write_csv(path: Path, rows: Sequence[RunSummary]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in comparison_rows(rows):
            row["peak_memory_per_rank"] = ";".join(str(b) for b in row["peak_memory_per_rank"])
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in CSV_COLUMNS})


def _label(r: RunSummary) -> str:
    shape = f", {r.nnodes}x{r.nproc_per_node}" if r.nnodes else ""
    engine = f", {engine_named(r.engine).tag}" if engine_named(r.engine).tag else ""
    failed = f" ({r.status})" if r.status in (RunState.FAILED, RunState.STOPPED) else ""
    return f"{r.run} (stage {r.zero_stage}{shape}{engine}){failed}"


def write_png(path: Path, name: str, rows: Sequence[RunSummary]) -> bool:
    """The four panels; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = list(rows)
    base = base_run(rows)
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(2, 2, figsize=(15, 10), dpi=100)
    (ax_loss, ax_diff), (ax_speed, ax_mem) = axes
    models = sorted({r.model for r in rows if r.model})
    fig.suptitle(f"{name}: {', '.join(models) or 'runs'} - {len(rows)} run(s); medians after "
                 f"{rows[0].warmup_iterations} warm-up iterations", fontsize=14)

    ref = dict(base.losses) if base else {}
    diffs = [[] if r is base else [(it, abs(loss - ref[it])) for it, loss in r.losses if it in ref] for r in rows]
    for ax, series, wide in ((ax_loss, [r.losses for r in rows], True), (ax_diff, diffs, False)):
        for i, (r, points) in enumerate(zip(rows, series)):  # overlapping losses stay visible: wide to narrow, different dashes
            if points:
                ax.plot(*zip(*points), color=colors[i % 10], marker="osD^vPX*"[i % 8], linestyle=("-", "--", "-.", ":")[i % 4],
                        linewidth=max(1.0, 4.0 - 0.8 * i) if wide else None, markersize=max(3.0, 9.0 - 1.5 * i) if wide else None,
                        label=_label(r))
        if base is None:
            ax.text(0.5, 0.5, "no run recorded an iteration", ha="center", va="center", transform=ax.transAxes)
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    ax_loss.set(title="Training loss against iteration", xlabel="iteration", ylabel="lm loss (nats per token)")
    ax_loss.grid(alpha=0.3)
    if base:
        ax_diff.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if max([0.0, *(d for points in diffs for _, d in points)]) == 0.0:
            ax_diff.text(0.5, 0.5, f"every run's loss equals {base.run}'s\nat every iteration", ha="center",
                         va="center", transform=ax_diff.transAxes, fontsize=12)
        ax_diff.set(title=f"Loss difference from {base.run}", xlabel="iteration", ylabel="|loss - base loss| (nats per token)")
        ax_diff.grid(alpha=0.3)
    else:
        ax_diff.set(title="Loss difference from the first run")

    xs = range(len(rows))
    speeds = [r.tokens_per_s or 0.0 for r in rows]
    bars = ax_speed.bar(xs, speeds, color=[colors[i % 10] for i in xs])
    for bar, r in zip(bars, rows):
        text = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else r.status
        ax_speed.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9)
    ax_speed.set(title="Throughput (median after warm-up)", ylabel="tokens/s (all ranks)")
    ax_speed.set_ylim(0, max(speeds) * 1.15 if max(speeds) else 1)

    width = 0.8
    most_ranks = max(len(r.peak_memory_per_rank) for r in rows) or 1
    rank_colors = plt.get_cmap("viridis")
    labelled: set[str] = set()
    for i, r in enumerate(rows):
        values = r.peak_memory_per_rank
        w = width / max(1, len(values))
        for j, v in enumerate(values):
            label = ("max over ranks (GPU)" if r.device != Device.CPU else f"rank {j}") if most_ranks <= 8 else "ranks"
            ax_mem.bar(i - width / 2 + w * (j + 0.5), v / MB, width=w * 0.9,
                       color=rank_colors(j / max(1, most_ranks - 1) * 0.85), edgecolor="black", linewidth=0.4,
                       label=None if label in labelled else label)
            labelled.add(label)
        if values:
            ax_mem.annotate(f"{max(values) / MB:,.1f}", (i, max(values) / MB), ha="center", va="bottom", fontsize=9,
                            xytext=(0, 6), textcoords="offset points")
        else:
            ax_mem.annotate(r.status if r.status != RunState.FINISHED else "not measured", (i, 0), ha="center", va="bottom", fontsize=9)
        if r.planned_peak_bytes:
            ax_mem.hlines(r.planned_peak_bytes / MB, i - width / 2, i + width / 2, colors="red", linestyles="--",
                          linewidth=2, label=None if "plan" in labelled else "plan (orchestration/analysis/memory_plan.py)")
            labelled.add("plan")
    ax_mem.set(title="Peak memory per rank (CPU: model states; GPU: CUDA allocation)", ylabel="MB (1e6 bytes) per rank")
    top = max([v / MB for r in rows for v in r.peak_memory_per_rank] + [(r.planned_peak_bytes or 0) / MB for r in rows] + [0])
    if top:
        ax_mem.set_ylim(0, top * 1.35)  # room for the legend above the bars
    for ax in (ax_speed, ax_mem):
        ax.set_xticks(list(xs), [r.run for r in rows], rotation=15)
        ax.grid(axis="y", alpha=0.3)
    if labelled:
        ax_mem.legend(fontsize=9)

    fig.tight_layout(rect=(0, 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def write_comparison(root: Path, name: str, rows: Sequence[RunSummary]) -> ComparisonFiles:
    """``$ARTIFACT_ROOT/compare/<name>.{png,json,csv}``."""
    out = root / "compare"
    out.mkdir(parents=True, exist_ok=True)
    files = ComparisonFiles(out / f"{name}.png", out / f"{name}.json", out / f"{name}.csv")
    write_json(files.json_path, name, rows)
    write_csv(files.csv_path, rows)
    if not write_png(files.png_path, name, rows):
        return dataclasses.replace(files, png_path=None)
    return files


def describe_files(files: ComparisonFiles) -> str:
    png = str(files.png_path) if files.png_path else "no PNG (matplotlib is not installed: pip install matplotlib)"
    return f"wrote {png}, {files.json_path}, {files.csv_path}"


def comparison_name(runs: Sequence[str], name: str | None) -> str:
    """The files' name: ``--name``, else the runs joined by ``_vs_`` (too long: ``<first>_and_<N>_more``); checked."""
    joined = "_vs_".join(runs)
    name = name or (joined if RUN_NAME_RE.match(joined) else f"{runs[0]}_and_{len(runs) - 1}_more")
    try:
        return check_run_name(name)
    except UserError:
        raise UserError(f"--name {name!r} is not a usable file name: use letters, digits, '.', '_' and '-'") from None
