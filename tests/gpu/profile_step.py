"""One training step of the program under torch.profiler, after its warm-up: where the step's time goes.

    torchrun --nproc-per-node 1 tests/gpu/profile_step.py --at 7 --out DIR -- --model qwen3_1p7b --data D.yaml --zero-stage 0

Runs ``megatron_ext.pretrain``'s main in this process with ``Pretrain.train_step`` wrapped: iteration
``--at`` (the last, so that the iterations before it are the run's warm-up and its medians) runs
under torch.profiler, the CPU and (on a GPU) CUDA activities, its optimizer step marked with
:data:`OPTIMIZER_RANGE`. Rank 0 then writes ``DIR/profile.md`` (:func:`format_profile`: the device
time of the step by kernel group, GEMM, attention, elementwise, optimizer, communication, memory
copies, with each group's share of the step's wall time, and the top kernels) and
``DIR/profile.json`` (the same figures). On a CPU (the tests) the groups are of the CPU operators'
own time. Touches the file system (DIR) only; the grouping (:func:`kernel_group`) is pure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

OPTIMIZER_RANGE = "megatron_ext::optimizer_step"
"""The record_function around the trainer's step (the optimizer: clip, norm, Adam, parameter copies)."""
GROUPS = ("GEMM", "attention", "elementwise", "optimizer", "communication", "memory copies")
TOP_KERNELS = 15

_PATTERNS = (  # (group, lower-case substrings), first match wins: attention before GEMM (cutlass FMHA kernels)
    ("communication", ("nccl",)),
    ("memory copies", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "_mha", "softmax_kernel_fprop_bprop")),
    ("optimizer", ("adam", "multi_tensor", "l2norm")),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear")),
)


def kernel_group(name: str, in_optimizer: bool = False) -> str:
    """The group of a kernel (or, on a CPU, an operator) by its name; anything launched inside the
    optimizer step is ``optimizer``; what matches nothing (torch's elementwise and reduction
    kernels, torch.compile'd triton fusions, norms, cross entropy) is ``elementwise``. Pure."""
    if in_optimizer:
        return "optimizer"
    lower = name.lower()
    return next((group for group, parts in _PATTERNS if any(p in lower for p in parts)), "elementwise")


@dataclass(frozen=True)
class KernelTime:
    name: str
    us: float
    in_optimizer: bool = False


def kernel_times(events, on_cuda: bool) -> list[KernelTime]:
    """The step's kernels from torch.profiler's events: on a GPU every device event but the
    record_function annotations, inside the optimizer when it ran within an
    :data:`OPTIMIZER_RANGE` annotation on the device; on a CPU each operator's own time, inside
    the optimizer when the range is among its callers."""
    from torch.autograd import DeviceType

    if on_cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        ranges = [(e.time_range.start, e.time_range.end) for e in device if e.name == OPTIMIZER_RANGE]
        return [KernelTime(e.name, e.time_range.elapsed_us(), any(a <= e.time_range.start < b for a, b in ranges))
                for e in device if not getattr(e, "is_user_annotation", False) and e.name != OPTIMIZER_RANGE]

    def under_optimizer(e) -> bool:
        while e is not None:
            if e.name == OPTIMIZER_RANGE:
                return True
            e = e.cpu_parent
        return False

    return [KernelTime(e.name, e.self_cpu_time_total, under_optimizer(e)) for e in events
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0 and e.name != OPTIMIZER_RANGE
            and not getattr(e, "is_user_annotation", False)]


def summarize(times: list[KernelTime], step_s: float) -> dict:
    """Per group: time, share of the step, count, largest kernel; the top kernels by total time. Pure."""
    groups = {g: {"ms": 0.0, "count": 0, "top": ("", 0.0)} for g in GROUPS}
    by_name: dict[str, list] = {}
    for k in times:
        group = kernel_group(k.name, k.in_optimizer)
        entry = groups[group]
        entry["ms"] += k.us / 1e3
        entry["count"] += 1
        named = by_name.setdefault(k.name, [group, 0, 0.0])
        named[1] += 1
        named[2] += k.us / 1e3
    for name, (group, _, ms) in by_name.items():
        if ms > groups[group]["top"][1]:
            groups[group]["top"] = (name, ms)
    busy_ms = sum(g["ms"] for g in groups.values())
    step_ms = step_s * 1e3
    top = sorted(by_name.items(), key=lambda item: -item[1][2])[:TOP_KERNELS]
    return {"step_ms": step_ms, "kernel_ms": busy_ms,
            "groups": {g: {"ms": v["ms"], "share": v["ms"] / step_ms if step_ms else 0.0, "count": v["count"],
                           "top": v["top"][0]} for g, v in groups.items()},
            "top": [{"name": n, "group": g, "calls": c, "ms": ms, "share": ms / step_ms if step_ms else 0.0}
                    for n, (g, c, ms) in top]}


def format_profile(summary: dict, title: str) -> str:
    """Markdown: the groups' table, then the top kernels'."""
    step, kernels = summary["step_ms"], summary["kernel_ms"]
    lines = [f"{title}: step {step:.1f} ms, kernels {kernels:.1f} ms ({kernels / step:.1%} of the step; the rest "
             "is time with no kernel running, or overlapped kernels counted once each)", "",
             "| group | time (ms) | share of step | kernels | largest |", "|---|---|---|---|---|"]
    for group, g in sorted(summary["groups"].items(), key=lambda item: -item[1]["ms"]):
        lines.append(f"| {group} | {g['ms']:.1f} | {g['share']:.1%} | {g['count']} | {g['top'][:80] or '-'} |")
    lines += ["", "| kernel | group | calls | time (ms) | share of step |", "|---|---|---|---|---|"]
    lines += [f"| {k['name'][:100]} | {k['group']} | {k['calls']} | {k['ms']:.1f} | {k['share']:.1%} |"
              for k in summary["top"]]
    return "\n".join(lines) + "\n"


def one_line(summary: dict) -> str:
    """The groups' shares on one line, largest first (the GPU check's row)."""
    groups = sorted(summary["groups"].items(), key=lambda item: -item[1]["ms"])
    if not summary["kernel_ms"]:
        return f"step {summary['step_ms']:.0f} ms: no kernel recorded (torch.profiler's CUDA activity needs CUPTI)"
    return (f"step {summary['step_ms']:.0f} ms: " + ", ".join(f"{g} {v['share']:.1%}" for g, v in groups if v["ms"])
            + f"; no kernel {max(0.0, 1 - summary['kernel_ms'] / summary['step_ms']):.1%}")


def profile_iteration(at: int, out_dir: Path) -> None:
    """Wrap ``Pretrain.train_step`` so that iteration ``at`` is profiled and written to ``out_dir``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_ext.training.loop import Pretrain

    original = Pretrain.train_step

    def train_step(self, built, iteration: int, sample_memory: bool):
        if iteration != at:
            return original(self, built, iteration, sample_memory)
        on_cuda = torch.cuda.is_available()
        trainer_step = built.trainer.step

        def marked_step(*args, **kwargs):
            with record_function(OPTIMIZER_RANGE):
                return trainer_step(*args, **kwargs)

        built.trainer.step = marked_step
        if on_cuda:
            torch.cuda.synchronize()
        try:
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])) as prof:
                started = time.perf_counter()
                result = original(self, built, iteration, sample_memory)
                if on_cuda:
                    torch.cuda.synchronize()
                step_s = time.perf_counter() - started
        finally:
            del built.trainer.step
        if self.ranks.rank == 0:
            summary = summarize(kernel_times(prof.events(), on_cuda), step_s)
            device = torch.cuda.get_device_name(0) if on_cuda else "CPU"
            title = (f"iteration {iteration}, ZERO_STAGE={self.t.zero_stage}, micro batch {self.t.micro_batch_size}, "
                     f"seq {self.t.seq_length}, {device}")
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "profile.md").write_text(format_profile(summary, title))
            (out_dir / "profile.json").write_text(json.dumps({"title": title, **summary}, indent=1))
            print(f"profile: {one_line(summary)} ({out_dir / 'profile.md'})", flush=True)
        return result

    Pretrain.train_step = train_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--at", type=int, required=True, help="the iteration to profile (after the warm-up: the last)")
    p.add_argument("--out", type=Path, required=True, help="where profile.md and profile.json go")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- then megatron_ext.pretrain's arguments")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    profile_iteration(args.at, args.out)
    from megatron_ext.pretrain import main as pretrain

    return pretrain(args.program[1:] if args.program[:1] == ["--"] else args.program)


if __name__ == "__main__":
    sys.exit(main())
