"""A bare PyTorch loop over the same megatron-core model and data, for the overhead ratio.

    torchrun --nproc-per-node 2 benchmarks/bare_loop.py --iters 20

Same GPTModel (gpt_smoke), same GPTDataset batches, torch DDP + AdamW, no launcher, no metrics,
no accounting: what the framework's stage-0 path is measured against. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

warnings.filterwarnings("ignore")  # before torch: its import warns

import torch  # noqa: E402 (after the filter)
import torch.distributed as dist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", default="gpt_smoke")
    p.add_argument("--data", default="smoke")
    p.add_argument("--attention", choices=["sdpa", "local"], default="sdpa",
                   help="sdpa: the program's (torch scaled_dot_product_attention); local: megatron-core DotProductAttention")
    args = p.parse_args()
    from megatron.core import parallel_state

    from megatron_ext.data.prepare import ensure_prepared
    from megatron_ext.run_spec.flops import padded_vocab_size
    from megatron_ext.run_spec.params import load_run_params, with_batch_geometry
    from megatron_ext.run_spec.run_paths import artifact_root
    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.datasets import build_datasets, global_batch_slice
    import dataclasses

    from megatron_ext.training.model import CPU_KERNELS, build_gpt_model, model_vocab_size

    params, geometry = with_batch_geometry(load_run_params(args.model, args.data), int(os.environ["WORLD_SIZE"]))
    m, t = params.model, params.training
    root = artifact_root(os.environ)
    prepared = ensure_prepared(params.data, root / "data_cache")
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    install_megatron_on_cpu(t.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    torch.manual_seed(t.seed)
    vocab = padded_vocab_size(model_vocab_size(m, prepared.vocab_size), m.make_vocab_size_divisible_by)
    model = build_gpt_model(m, vocab, t.seq_length, kernels=dataclasses.replace(CPU_KERNELS, attention=args.attention))
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, foreach=False)
    train, _ = build_datasets(prepared, params.data, t.seq_length, t.seed, args.iters * t.global_batch_size, t.global_batch_size,
                              root / "data_cache" / "index", create_attention_mask=args.attention == "local")
    dp, rank = dist.get_world_size(), dist.get_rank()
    accumulation = geometry.accumulation_steps
    times = []
    for it in range(args.iters):
        start = time.time()
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            b = global_batch_slice(train, it * t.global_batch_size, rank, dp, t.micro_batch_size, micro)
            ctx = ddp.no_sync() if micro < accumulation - 1 else torch.enable_grad()
            with ctx:
                losses = ddp(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
                ((losses * b["loss_mask"]).sum() / b["loss_mask"].sum() / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        opt.step()
        times.append(time.time() - start)
    if rank == 0:
        steady = sorted(times[1:])
        median = steady[len(steady) // 2]
        print(json.dumps({"step_time_s": median, "tokens_per_s": t.global_batch_size * t.seq_length / median}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
