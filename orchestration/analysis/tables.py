"""The text tables: the memory plan, the comparison of runs, and the column layout both use.

    python -m orchestration plan-memory qwen3_1p7b qwen3_1p7b_smoke
    python -m orchestration compare demo_z0 demo_z1

Pure: data in (:class:`~orchestration.analysis.memory_plan.MemoryPlan`,
:class:`~orchestration.analysis.compare.RunSummary` rows), text out.
"""

from __future__ import annotations

from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS, MB, RunSummary, base_run, loss_difference, ratio
from orchestration.analysis.memory_plan import DEFAULT_BUS_BANDWIDTH_GBS, GB, MemoryPlan


def format_rows(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns as wide as their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return out


# -- the memory plan ----------------------------------------------------------------------------

def _gb(n: float, unit: float = GB) -> str:
    return f"{n / unit:.1f}" if n >= 0.05 * unit else f"{n / unit:.3f}"


def _fit(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def format_memory_plan(plan: MemoryPlan) -> str:
    p = plan
    unit, unit_name = (GB, "GB (1e9 bytes)") if max(s.total_bytes for s in p.stages) >= GB else (1e6, "MB (1e6 bytes)")
    gb = lambda n: _gb(n, unit)  # noqa: E731
    rank, ranks = ("GPU", "GPUs") if p.precision == "bf16" else ("CPU process", "CPU processes")
    what = ("bf16 params, fp32 grads and main params (Megatron)" if p.precision == "bf16"
            else "fp32 params, grads and AdamW state (CPU path)")
    reduce = "bf16" if p.grad_reduce_in_bf16 and p.precision == "bf16" else "fp32"
    lines = [
        f"{p.model}: {p.parameters:,} parameters (vocabulary padded to {p.padded_vocab:,}), "
        f"{p.num_gpus} {ranks} ({p.nnodes} node(s) x {p.nproc_per_node}) data-parallel, {what}; "
        f"activations for sequence {p.seq_length} x micro batch {p.micro_batch_size}"
        + (f" ({p.data_set})" if p.data_set else ""),
        f"per {rank}, {unit_name}; device: {p.device}"
        + (f", usable with {p.headroom:.0%} headroom: {_gb(p.usable_bytes)} GB" if p.usable_bytes else ""),
        "",
    ]
    header = ["stage", "params", "grads", "optimizer", "states", "activations", "total", "fits",
              "act. recompute", "total recompute", "fits", "DP traffic/step", f"at {p.bus_bandwidth_gbs:g} GB/s"]
    rows = []
    for s in p.stages:
        peak = f" (peak {gb(s.states_peak_bytes)})" if s.states_peak_bytes != s.states_bytes else ""
        rows.append([str(s.stage), gb(s.params_bytes), gb(s.grads_bytes), gb(s.optimizer_bytes),
                     gb(s.states_bytes) + peak, gb(s.activation_bytes), gb(s.total_bytes), _fit(s.fits),
                     gb(s.activation_recompute_bytes), gb(s.total_recompute_bytes), _fit(s.fits_recompute),
                     f"{gb(s.traffic_bytes)} {unit_name.split()[0]}", f"{s.traffic_s * 1000:.3g} ms"])
    lines += format_rows(header, rows)
    lines.append("")
    if p.usable_bytes:
        if p.lowest_fitting_stage is not None:
            s = p.stage(p.lowest_fitting_stage)
            lines.append(f"lowest stage that fits in {_gb(p.device_bytes)} GB with {p.headroom:.0%} headroom: "
                         f"stage {s.stage} ({_gb(s.total_bytes)} GB of {_gb(p.usable_bytes)} GB usable)")
        elif p.lowest_fitting_stage_recompute is not None:
            s = p.stage(p.lowest_fitting_stage_recompute)
            lines.append(f"no stage fits without recomputation; with full activation recomputation: stage {s.stage} "
                         f"({_gb(s.total_recompute_bytes)} GB of {_gb(p.usable_bytes)} GB usable)")
        else:
            lines.append(f"no stage fits in {_gb(p.usable_bytes)} GB usable, even with full recomputation; "
                         "use more GPUs, a smaller micro batch or sequence, or tensor/pipeline parallelism")
    if p.compute_s:
        lines.append(f"compute per step at {p.assumed_mfu:.0%} MFU: {p.compute_s * 1000:,.0f} ms "
                     f"(global batch {p.global_batch_size} x {p.seq_length} tokens); data-parallel traffic is "
                     + ", ".join(f"stage {s.stage} {s.traffic_s / p.compute_s:.1%}" for s in p.stages)
                     + " of it before any overlap")
    if p.mfu_estimates:
        kind = "FP8" if p.fp8 else "BF16"
        lines.append(f"MFU estimate against the dense {kind} peak ({p.peak_tflops:g} TFLOP/s): "
                     + ", ".join(f"stage {e.stage} {e.mfu:.1%} ({e.step_s * 1000:,.0f} ms/step: exposed traffic "
                                 f"{e.exposed_traffic_s * 1000:,.0f} ms, optimizer {e.optimizer_s * 1000:,.0f} ms)"
                                 for e in p.mfu_estimates))
        lines.append(f"  assumes the kernels at {p.assumed_mfu:.0%} of the peak while they run, forward 1/3 and backward 2/3 "
                     "of the compute, gradient reduction hidden behind backward, parameter gathers behind forward "
                     "(stage 1) or forward + backward (stage 3), stage 2's one gather after the update exposed, the "
                     "optimizer streaming 26 bytes per updated parameter at the device's memory bandwidth; not "
                     "modelled: data loading, launches, stragglers")
    lines += [
        "model states: stages 0-1 Megatron's bytes per parameter (18, 6 + 12/d with bf16 params, fp32 grads and "
        "main params), stages 2-3 the ZeRO paper's (2 + 14/d, 16/d)" if p.precision == "bf16" else
        "model states: fp32 AdamW (16, 8 + 8/d, 16/d with peak 4 + 12/d, 16/d bytes per parameter)",
        "activations: an estimate after Korthikanti et al. 2022 (\"Reducing Activation Recomputation in Large "
        "Transformer Models\"), re-derived for this layer (GQA, SwiGLU, QK-norm) with flash/SDPA attention; "
        "recompute = full recomputation (each layer keeps its input)",
        f"traffic: ZeRO paper volumes (2 Psi stages 0-2, 3 Psi stage 3), gradients reduced in {reduce}, "
        f"parameters gathered in {'bf16' if p.precision == 'bf16' else 'fp32'}, ring factor (d-1)/d; "
        f"time = bytes / bus bandwidth ({p.bus_bandwidth_gbs:g} GB/s"
        + (": 4x8 H100 NCCL all-reduce, measured)" if p.bus_bandwidth_gbs == DEFAULT_BUS_BANDWIDTH_GBS else ")"),
    ]
    return "\n".join(lines)


# -- the comparison -------------------------------------------------------------------------------

def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:,.1f}"


def format_comparison(rows: list[RunSummary]) -> str:
    """One table: engine, stage, nodes x processes, iterations, medians after the warm-up,
    TFLOP/s, MFU, memory per rank with the plan next to it, final loss, the largest loss
    difference from the first run, ratios to it; reasons for failures below."""
    base = base_run(rows)
    warmup = rows[0].warmup_iterations if rows else DEFAULT_WARMUP_ITERATIONS
    header = ["run", "engine", "stage", "nodes x procs", "iters", "step ms", "tokens/s", "x", "TFLOP/s/GPU", "MFU",
              "states MB/rank", "plan", "peak MB/rank", "plan", "x", "final loss", "max |dloss|", "status"]
    body, notes = [], []
    for r in rows:
        shape = f"{r.nnodes} x {r.nproc_per_node}" if r.nnodes else f"? x ? ({r.world_size})"
        iters = f"{r.iterations}/{r.train_iters}" if r.train_iters else str(r.iterations)
        diff = loss_difference(base, r) if base and r is not base and r.has_records else None
        status = r.status
        if r.reason:
            notes.append(f"[{len(notes) + 1}] {r.run}: {r.reason}")
            status = f"{r.status} [{len(notes)}]"
        body.append([
            r.run, r.engine, str(r.zero_stage), shape, iters, _num(r.step_time_s and r.step_time_s * 1000, ",.1f"),
            _num(r.tokens_per_s, ",.0f"), _num(ratio(r.tokens_per_s, base and base.tokens_per_s), ".2f"),
            _num(r.tflops_per_gpu, ".4f" if (r.tflops_per_gpu or 0) < 10 else ".1f"), _num(r.mfu and 100 * r.mfu, ".1f"),
            _mb(r.model_state_bytes), _mb(r.planned_model_state_bytes), _mb(r.peak_memory_bytes), _mb(r.planned_peak_bytes),
            _num(ratio(r.peak_memory_bytes, base and base.peak_memory_bytes), ".2f"), _num(r.last_loss, ".4f"),
            "base" if r is base else (f"{diff.max_abs:.1e}" if diff else "-"), status,
        ])
    steady = f"iterations after the first {warmup} (warm-up)"
    lines = [
        f"{len(rows)} run(s); step time, tokens/s, TFLOP/s and MFU (%) are medians over {steady}; "
        f"x = ratio to {base.run if base else '-'}; max |dloss| = largest loss difference from it at the same iteration",
        "memory per rank in MB (1e6 bytes), the largest over ranks: states = model states between steps (CPU), "
        "peak = peak model states (CPU) or peak CUDA allocation (GPU); plan = orchestration/analysis/memory_plan.py "
        "(GPU: states + activation estimate)",
        "",
        *format_rows(header, body),
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)
