"""The program torchrun runs on every rank: a megatron-core GPT pretrain with a ZeRO switch.

    torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke --run-name demo
    ZERO_STAGE=3 torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke

Reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them, ZERO_STAGE
and ARTIFACT_ROOT. With CUDA: NCCL, one GPU per LOCAL_RANK, bf16, transformer-engine layers when
they import. Without: gloo, fp32, megatron-core's local layers (see cpu_compat). Parameters,
batch geometry, stage and data are checked before any process group exists: a user error is one
message from rank 0 and exit code 2.

Side effects: the process group, the data cache, metrics/params/checkpoint files under the
artifact root, stdout (rank 0).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass

from megatron_ext.artifacts import RunPaths, artifact_root, check_run_name
from megatron_ext.params import (
    ParamsError, RunParams, TrainingParams, check_batch_geometry, load_run_params, write_resolved_params,
)

EXIT_USER_ERROR = 2


@dataclass(frozen=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int


def read_rank_env(env) -> RankEnv:
    try:
        return RankEnv(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)))
    except ValueError as exc:
        raise ParamsError(f"RANK/LOCAL_RANK/WORLD_SIZE must be integers ({exc}); run under torchrun") from None


def learning_rate(t: TrainingParams, iteration: int) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``min_lr`` (iteration counts from 1)."""
    if t.lr_warmup_iters and iteration <= t.lr_warmup_iters:
        return t.lr * iteration / t.lr_warmup_iters
    decay = t.lr_decay_iters or t.train_iters
    progress = min(1.0, (iteration - t.lr_warmup_iters) / max(1, decay - t.lr_warmup_iters))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_ext.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model preset under params/models")
    p.add_argument("--data", required=True, help="data set under params/data")
    p.add_argument("--run-name", dest="run", default=os.environ.get("LAUNCHER_RUN", "adhoc"), help="run name (default $LAUNCHER_RUN)")
    p.add_argument("--train-iters", type=int, help="override training.train_iters")
    return p.parse_args(argv)


def resolve(args, env) -> tuple[RunParams, RankEnv, int, RunPaths]:
    """Everything checked before a process group exists."""
    import dataclasses

    check_run_name(args.run)
    params = load_run_params(args.model, args.data, env)
    if args.train_iters:
        params = dataclasses.replace(params, training=dataclasses.replace(params.training, train_iters=args.train_iters))
    ranks = read_rank_env(env)
    accumulation = check_batch_geometry(params.training, ranks.world_size)
    from megatron_ext.prepare_data import planned_prepared
    from megatron_ext.versions import check_megatron_core

    check_megatron_core()
    paths = RunPaths(artifact_root(env), args.run)
    planned_prepared(params.data, paths.data_cache_dir)  # missing data paths fail here, on every rank
    return params, ranks, accumulation, paths


def _quiet_megatron() -> None:
    warnings.filterwarnings("ignore")
    for name in ("megatron", "megatron.core", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def train(params: RunParams, ranks: RankEnv, accumulation: int, paths: RunPaths) -> None:
    import torch
    import torch.distributed as dist

    from megatron_ext import metrics as M
    from megatron_ext.data_parallel import wrap_for_stage
    from megatron_ext.datasets import build_datasets, global_batch_slice
    from megatron_ext.gpt_model import build_gpt_model, model_vocab_size, padded_vocab_size, transformer_engine_available
    from megatron_ext.prepare_data import ensure_prepared

    m, t = params.model, params.training
    on_cuda = torch.cuda.is_available()
    prepared = ensure_prepared(params.data, paths.data_cache_dir)
    vocab = padded_vocab_size(model_vocab_size(m, prepared.vocab_size), m.make_vocab_size_divisible_by)

    if on_cuda:
        torch.cuda.set_device(ranks.local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", ranks.local_rank))
    else:
        dist.init_process_group("gloo")
    from megatron.core import parallel_state

    # On CPU the world group is gloo already: no second set of gloo groups.
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=on_cuda)
    if on_cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    else:
        from megatron_ext.cpu_compat import install_cpu_compat

        install_cpu_compat(t.seed)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))

    torch.manual_seed(t.seed)
    use_te = on_cuda and transformer_engine_available()
    module = build_gpt_model(
        m, vocab, t.seq_length, params_dtype=torch.bfloat16 if on_cuda else torch.float32, on_cpu=not on_cuda, use_transformer_engine=use_te
    )
    if on_cuda:
        module.cuda()
    trainer = wrap_for_stage(module, t.zero_stage, t, on_cuda)
    device = torch.device("cuda", ranks.local_rank) if on_cuda else torch.device("cpu")

    dp, rank = ranks.world_size, ranks.rank
    train_ds, valid_ds = build_datasets(
        prepared, params.data, t.seq_length, t.seed,
        num_train_samples=t.train_iters * t.global_batch_size,
        num_valid_samples=max(1, t.eval_iters) * t.global_batch_size,  # every validation pass reads the same batches
        cache_dir=paths.data_cache_dir / "index",
    )
    flops_iter = M.flops_per_token(m, t.seq_length, vocab) * t.global_batch_size * t.seq_length
    peak = M.peak_tflops_for(torch.cuda.get_device_name(device)) if on_cuda else None

    writer = None
    if rank == 0:
        write_resolved_params(paths.params_path, params, {
            "run": paths.run, "engine": "megatron-core", "world_size": dp, "gradient_accumulation_steps": accumulation,
            "device": "cuda" if on_cuda else "cpu", "backend": dist.get_backend(), "padded_vocab_size": vocab,
            "transformer_engine": use_te, "data": prepared.__dict__,
        })
        writer = M.MetricsWriter(paths.metrics_path)
        print(
            f"run {paths.run}: model {m.name} data {params.data_set} | world size {dp} | ZERO_STAGE={t.zero_stage} "
            f"| {'cuda/nccl/bf16' if on_cuda else 'cpu/gloo/fp32'} | vocab {vocab} | "
            f"micro {t.micro_batch_size} x dp {dp} x accumulation {accumulation} = global {t.global_batch_size}",
            flush=True,
        )

    def batch_loss(batch) -> torch.Tensor:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        losses = trainer.model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        mask = batch["loss_mask"]
        return (losses.float() * mask).sum() / mask.sum().clamp(min=1)

    def evaluate() -> float:
        trainer.model.eval()
        total = torch.zeros(1, device=device)
        with torch.no_grad():
            for i in range(t.eval_iters):
                for micro in range(accumulation):
                    batch = global_batch_slice(valid_ds, i * t.global_batch_size, t.global_batch_size, rank, dp, t.micro_batch_size, micro)
                    total += batch_loss(batch).detach() / accumulation
        dist.all_reduce(total)
        trainer.release_unsharded()
        trainer.model.train()
        return float(total) / (dp * t.eval_iters)

    start = time.time()
    consumed = 0
    for iteration in range(1, t.train_iters + 1):
        step_start = time.time()
        lr = learning_rate(t, iteration)
        trainer.zero_grad()
        loss_sum = torch.zeros(1, device=device)
        for micro in range(accumulation):
            batch = global_batch_slice(train_ds, consumed, t.global_batch_size, rank, dp, t.micro_batch_size, micro)
            with trainer.sync_context(micro == accumulation - 1):
                loss = batch_loss(batch)
                if micro == 0 and not on_cuda:
                    trainer.sample_model_state()
                (loss / accumulation).backward()
            loss_sum += loss.detach() / accumulation
        grad_norm = trainer.step(lr)
        state_bytes = trainer.sample_model_state() if not on_cuda else 0
        consumed += t.global_batch_size
        dist.all_reduce(loss_sum)
        lm_loss = float(loss_sum) / dp
        if on_cuda:
            torch.cuda.synchronize()
        step_s = time.time() - step_start

        valid_loss = None
        last = iteration == t.train_iters
        if t.eval_iters and ((t.eval_interval and iteration % t.eval_interval == 0) or last):
            valid_loss = evaluate()
        if t.save_interval and (iteration % t.save_interval == 0 or last):
            save_checkpoint(trainer, paths, iteration)
        if iteration % t.log_interval and not last and iteration != 1:
            continue
        mem = _memory_columns(trainer, state_bytes, on_cuda, device)
        if ranks.local_rank != 0:  # every node's log shows the iterations; rank 0 writes metrics
            continue
        tflops = M.tflops_per_gpu(flops_iter, step_s, dp)
        record = M.IterationRecord(
            iteration=iteration, train_iters=t.train_iters, consumed_samples=consumed, lm_loss=lm_loss, lr=lr,
            grad_norm=grad_norm, step_time_s=step_s, tokens_per_s=t.global_batch_size * t.seq_length / step_s,
            tflops_per_gpu=tflops, global_batch_size=t.global_batch_size, world_size=dp, zero_stage=t.zero_stage,
            mfu=tflops / peak if peak else None, valid_loss=valid_loss, time=time.time(), **mem,
        )
        if writer:
            writer.write(record)
        print(M.format_iteration_line(record), flush=True)
        print(M.format_progress_line(record, time.time() - start), flush=True)
        if valid_loss is not None:
            print(f" validation loss at iteration {iteration} | lm loss value: {valid_loss:.6E} |", flush=True)
    if ranks.local_rank == 0:
        print(f"done: {t.train_iters} iterations in {time.time() - start:.1f}s; metrics {paths.metrics_path}", flush=True)
    if writer:
        writer.close()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _memory_columns(trainer, state_bytes: int, on_cuda: bool, device) -> dict:
    """Per-rank memory, gathered to every rank (a collective: all ranks call it)."""
    import torch
    import torch.distributed as dist

    if on_cuda:
        peak = torch.tensor([torch.cuda.max_memory_allocated(device)], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {"cuda_peak_allocated_bytes": int(peak)}
    now = state_bytes
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = torch.tensor([now, trainer.peak_model_state_bytes, rss], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return {
        "model_state_bytes": now,
        "model_state_peak_bytes": trainer.peak_model_state_bytes,
        "peak_rss_bytes": rss,
        "model_state_bytes_per_rank": [int(g[0]) for g in gathered],
        "model_state_peak_bytes_per_rank": [int(g[1]) for g in gathered],
    }


def save_checkpoint(trainer, paths: RunPaths, iteration: int) -> None:
    """Model weights with torch.distributed.checkpoint (sharded stages write their shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    target = paths.checkpoints_dir / f"iter_{iteration:07d}"
    dcp.save({"model": get_model_state_dict(trainer.module)}, checkpoint_id=str(target))


def main(argv: list[str] | None = None) -> int:
    _quiet_megatron()
    args = parse_args(argv)
    env = os.environ
    rank = env.get("RANK", "0")
    try:
        params, ranks, accumulation, paths = resolve(args, env)
        train(params, ranks, accumulation, paths)  # data preparation can still find a user error
    except ParamsError as exc:
        if rank == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
