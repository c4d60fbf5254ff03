"""The text tables: the memory plan, the comparison of runs, and the column layout both use.

    python -m orchestration plan-memory qwen3_1p7b qwen3_1p7b_smoke
    python -m orchestration compare demo_z0 demo_z1

Pure: data in (:class:`~orchestration.analysis.memory_plan.MemoryPlan`,
:class:`~orchestration.analysis.compare.RunSummary` rows), text out.
"""

from __future__ import annotations

from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS, MB, RunSummary, base_run, loss_difference, ratio
from orchestration.analysis.goodput import FAULTS, Part, format_duration, format_losses
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
    rank = "GPU" if p.precision == "bf16" else "CPU process"
    a = p.gradient_accumulation_steps
    micro = f"{a} micro-batch{'es' if a > 1 else ''} per {rank}" + ("" if p.global_batch_size else " (no global batch given)")
    bus = (f"time = bytes / bus bandwidth ({p.bus_bandwidth_gbs:g} GB/s"
           + (": 4x8 H100 NCCL all-reduce, measured)" if p.bus_bandwidth_gbs == DEFAULT_BUS_BANDWIDTH_GBS else ")"))
    if p.precision == "bf16":  # what differs between the GPUs (Megatron) and the CPU path, in one place
        ranks, what = "GPUs", "bf16 params, fp32 grads and main params (Megatron)"
        states = ("model states: stages 0-1 Megatron's bytes per parameter (18, 6 + 12/d with bf16 params, fp32 grads and "
                  "main params), stages 2-3 Megatron-FSDP's "
                  + ("(2 + 14/d, 16/d: bf16 gradient shards)" if p.grad_reduce_in_bf16 else "(2 + 16/d, 18/d: fp32 gradient shards)"))
        traffic = (f"traffic per step of {micro}, megatron-core (r = (d-1)/d, g = {'2 (bf16' if p.grad_reduce_in_bf16 else '4 (fp32'} "
                   "gradient reduction), p = 2 (bf16 parameters), a micro-batches): stage 0 all-reduces the gradients "
                   "once (2 r Psi g), stage 1 reduce-scatters them once and gathers the parameters once (r Psi (g + p)), "
                   "Megatron-FSDP reduce-scatters at every micro-batch and gathers once after the update (stage 2: "
                   "r Psi (a g + p)) or every layer before each forward and backward and the rest once "
                   f"(stage 3: r (a Psi g + (2a (Psi - Psi_o) + Psi_o) p), Psi_o = {p.parameters_outside_layers:,} "
                   f"outside the layers); benchmarks/dp_traffic.py measures it; {bus}")
    else:
        ranks, what = "CPU processes", "fp32 params, grads and AdamW state (CPU path)"
        states = "model states: fp32 AdamW (16, 8 + 8/d, 16/d with peak 4 + 12/d, 16/d bytes per parameter)"
        traffic = (f"traffic per step of {micro}, CPU path (fp32, r = (d-1)/d, a micro-batches): 4 r bytes times 2 Psi "
                   "(DDP all-reduce), 3 Psi (+ ZeRO's parameter broadcasts), (a + 1) Psi and (2a + 1) Psi (FSDP2 gathers "
                   f"before every forward, stage 3 every backward too, one reduce-scatter); {bus}")
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
    lines += [*format_rows(header, rows), ""]
    if p.usable_bytes:
        usable = f"{_gb(p.usable_bytes)} GB usable"
        if p.lowest_fitting_stage is not None:
            s = p.stage(p.lowest_fitting_stage)
            lines.append(f"lowest stage that fits in {_gb(p.device_bytes)} GB with {p.headroom:.0%} headroom: "
                         f"stage {s.stage} ({_gb(s.total_bytes)} GB of {usable})")
        elif p.lowest_fitting_stage_recompute is not None:
            s = p.stage(p.lowest_fitting_stage_recompute)
            lines.append(f"no stage fits without recomputation; with full activation recomputation: stage {s.stage} "
                         f"({_gb(s.total_recompute_bytes)} GB of {usable})")
        else:
            lines.append(f"no stage fits in {usable}, even with full recomputation; "
                         "use more GPUs, a smaller micro batch or sequence, or tensor/pipeline parallelism")
    if p.compute_s:
        fp8 = (f"; FP8 peak ({p.fp8_peak_tflops:g} TFLOP/s) for the linear layers' {p.fp8_flops_share:.0%} of the FLOPs, "
               "BF16 for core attention and logits" if p.fp8_peak_tflops and p.fp8_flops_share else "")
        lines.append(f"compute per step at {p.assumed_mfu:.0%} MFU: {p.compute_s * 1000:,.0f} ms "
                     f"(global batch {p.global_batch_size} x {p.seq_length} tokens, {micro}{fp8}); data-parallel traffic is "
                     + ", ".join(f"stage {s.stage} {s.traffic_s / p.compute_s:.1%}" for s in p.stages)
                     + " of it before any overlap")
    if p.mfu_estimates:
        lines.append(f"MFU estimate against the dense BF16 peak ({p.peak_tflops:g} TFLOP/s"
                     + (", with FP8 too" if p.fp8 else "") + "): "
                     + ", ".join(f"stage {e.stage} {e.mfu:.1%} ({e.step_s * 1000:,.0f} ms/step: exposed traffic "
                                 f"{e.exposed_traffic_s * 1000:,.0f} ms, optimizer {e.optimizer_s * 1000:,.0f} ms)"
                                 for e in p.mfu_estimates))
        lines.append(f"  assumes the kernels at {p.assumed_mfu:.0%} of the peak while they run, forward 1/3 and backward 2/3 "
                     "of the compute split evenly over the micro-batches, the gradient reduction behind the last "
                     "micro-batch's backward (stages 0-1) or every backward (stages 2-3), parameter gathers behind the "
                     "first forward (stage 1) or every forward and backward (stage 3), stage 2's one gather after the "
                     "update exposed, the optimizer streaming 26 bytes per updated parameter at the device's memory "
                     "bandwidth; not modelled: data loading, launches, stragglers")
    lines += [states, "activations: an estimate after Korthikanti et al. 2022 (\"Reducing Activation Recomputation in Large "
              "Transformer Models\"), re-derived for this layer (GQA, SwiGLU, QK-norm) with flash/SDPA attention; "
              "recompute = full recomputation (each layer keeps its input)", traffic]
    return "\n".join(lines)


# -- the comparison -------------------------------------------------------------------------------

def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:,.1f}"


def _largest_loss(r: RunSummary) -> str:
    losses = [(s, p) for p, s in r.goodput_parts.items() if p != Part.PRODUCTIVE.value and s > 0]
    if not losses:
        return "-"
    s, p = max(losses)
    return f"{p} {format_duration(s)}"


def format_goodput_note(r: RunSummary) -> str | None:
    """``goodput of RUN: 71.2% of 3m05.3s; startup 14.2s, hang 12.5s, ...; by attempt 1: 80%, 2: 65%``, for
    a run with a fault or more than one attempt (the others' largest loss is in the table)."""
    faulted = any(r.goodput_parts.get(p.value, 0.0) > 0 for p in FAULTS) or len(r.goodput_attempts) > 1
    if r.goodput is None or r.wall_clock_s is None or not faulted:
        return None
    losses = format_losses(r.goodput_parts)
    attempts = ", ".join(f"{a}: {g:.0%}" if g is not None else f"{a}: -" for a, g in r.goodput_attempts)
    return f"goodput of {r.run}: {r.goodput:.1%} of {format_duration(r.wall_clock_s)}; {losses}; by attempt {attempts}"


def format_comparison(rows: list[RunSummary]) -> str:
    """One table: engine, stage, nodes x processes, iterations, medians after the warm-up,
    TFLOP/s, MFU, memory per rank with the plan next to it, final loss, the largest loss
    difference from the first run, ratios to it, the wall clock, goodput and its largest loss;
    reasons for failures below, then the goodput of the runs with faults, part by part."""
    base = base_run(rows)
    warmup = rows[0].warmup_iterations if rows else DEFAULT_WARMUP_ITERATIONS
    header = ["run", "engine", "stage", "nodes x procs", "iters", "step ms", "tokens/s", "x", "TFLOP/s/GPU", "MFU",
              "states MB/rank", "plan", "peak MB/rank", "plan", "x", "final loss", "max |dloss|", "wall", "goodput",
              "largest loss", "status"]
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
            "base" if r is base else (f"{diff.max_abs:.1e}" if diff else "-"),
            format_duration(r.wall_clock_s) if r.wall_clock_s is not None else "-", _num(r.goodput and 100 * r.goodput, ".1f"),
            _largest_loss(r), status,
        ])
    steady = f"iterations after the first {warmup} (warm-up)"
    lines = [
        f"{len(rows)} run(s); step time, tokens/s, TFLOP/s and MFU (%) are medians over {steady}; "
        f"x = ratio to {base.run if base else '-'}; max |dloss| = largest loss difference from it at the same iteration",
        "memory per rank in MB (1e6 bytes), the largest over ranks: states = model states between steps (CPU), "
        "peak = peak model states (CPU) or peak CUDA allocation (GPU); plan = orchestration/analysis/memory_plan.py "
        "(GPU: states + activation estimate)",
        "wall = node 0's clock from the run's first start (its attempts ledger); goodput (%) = productive step time / wall; "
        "largest loss = the largest other part (status_training.sh RUN shows every part; docs/faults.md#goodput)",
        "",
        *format_rows(header, body),
    ]
    if notes:
        lines += ["", *notes]
    goodput = [n for n in map(format_goodput_note, rows) if n]
    if goodput:
        lines += ["", *goodput]
    return "\n".join(lines)
