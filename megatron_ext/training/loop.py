"""The training loop, in named steps: set up, build, one step, log (and evaluate, save).

    torchrun --nproc-per-node 2 -m megatron_ext.pretrain --model gpt_smoke --data smoke

:class:`Pretrain` takes everything resolved before a process group exists (:class:`RunInputs`; its
device path, chosen once: training/device_paths.py) and runs it: :meth:`Pretrain.set_up` (process
group, megatron's parallel state, seeds), :meth:`Pretrain.build` (the data and the resume point, both
decided by rank 0 and told to every rank over the network: training/agreement.py; model, trainer for
the ZeRO stage, datasets: one :class:`Built`, handed to the steps), :meth:`Pretrain.train_step`
(micro-batches with gradient accumulation, clip, optimizer step), :meth:`Pretrain.log` (at log
intervals only: one collective gathers the loss and every rank's memory figures; rank 0 writes
the metrics record and TensorBoard, the last rank W&B when WANDB_PROJECT is set, every node's local
rank 0 prints Megatron-LM's iteration line).

Side effects: the process group, the data cache, metrics and checkpoint files under the artifact
root, stdout.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.flops import flops_per_token, padded_vocab_size, tflops_per_gpu
from megatron_ext.run_spec.fp8 import fp8_config_fields, fp8_problem
from megatron_ext.run_spec.iteration_log import (
    IterationRecord, MetricsWriter, format_iteration_line, format_progress_line,
)
from megatron_ext.run_spec.checkpoints import CheckpointMeta, check_resumable, read_meta
from megatron_ext.run_spec.hf_config import hf_model_type
from megatron_ext.run_spec.params import COLLECTIVE_TIMEOUT_S, BatchGeometry, RunParams, TrainingParams
from megatron_ext.run_spec.resilience import (PERSIST_SHARE, Phase, SLOW_RANK_CLEARED, BusyInterval, describe_slow_ranks,
                                             slow_ranks, still_slow, window_of)
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.wandb_run import WandbSettings
from megatron_ext.training.device_paths import device_path
from megatron_ext.training.manual_gc import ManualGc
from megatron_ext.training.progress import ProgressReporter, SaveRequest
from megatron_ext.training.trainers import NonFiniteGradients, Trainer

if TYPE_CHECKING:
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from torch.utils.tensorboard import SummaryWriter

    from megatron_ext.training.checkpoint import PendingSave, ResumeChoice
    from megatron_ext.training.wandb_log import WandbWriter


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    """What torchrun tells a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK: its
    node's place), the node supervisor's progress directory and attempt (None / 1 under plain
    torchrun), and OMP_NUM_THREADS where set (:func:`cpu_threads`)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: int = 0
    progress_dir: Path | None = None
    attempt: int = 1
    omp_num_threads: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunInputs:
    """Everything checked before a process group exists."""

    params: RunParams
    """With the global batch filled in for the world size."""
    geometry: BatchGeometry
    ranks: RankEnv
    paths: RunPaths
    wandb: WandbSettings | None = None
    """WANDB_PROJECT and friends (None: no W&B)."""
    shard_one_rank: bool = False
    """MEGATRON_EXT_SHARD_ONE_RANK=1: on GPUs at one data-parallel rank, stages 2-3 keep
    Megatron-FSDP's own strategy (cuda_trainer.one_rank_strategy; the GPU check's switch)."""


def learning_rate(t: TrainingParams, steps_done: int) -> float:
    """Megatron-LM's learning rate after ``steps_done`` optimizer steps (``OptimizerParamScheduler.get_lr``,
    iteration-based, ``--lr-warmup-init 0``): linear warmup over ``lr_warmup_iters``, then cosine
    decay to ``min_lr`` at ``lr_decay_iters`` (counted from the start, warmup included). As in
    Megatron-LM, iteration i trains with ``learning_rate(t, i - 1)`` (0 on the first iteration
    under warmup) and its log line shows ``learning_rate(t, i)``, the scheduler's value after the step."""
    warmup, decay = t.lr_warmup_iters, t.lr_decay_iters or t.train_iters
    if warmup > 0 and steps_done <= warmup:
        return t.lr * steps_done / warmup
    if steps_done > decay:
        return t.min_lr
    ratio = (steps_done - warmup) / (decay - warmup)
    return t.min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (t.lr - t.min_lr)


def cpu_threads(omp_num_threads: str | None, cpus: int | None, local_world_size: int) -> int | None:
    """Intra-op threads of a CPU rank: None where ``OMP_NUM_THREADS`` is set (torch has read it: the
    user's, or torchrun's 1 when it starts several processes per node; set empty, OpenMP ignores it
    and so does this), else this machine's cores
    shared by its ranks. A rank that takes every core where other processes share them (a node's
    one rank beside another run) spins in OpenMP's barriers: 2 runs of one rank each beside a busy
    loop on 2 cores took 3.8 s an iteration instead of 0.22 s alone. Pure."""
    if (omp_num_threads or "").strip():
        return None
    return max(1, (cpus or 1) // local_world_size)


def open_tensorboard(directory, resume_after: int = 0):
    """A TensorBoard event writer where ``tensorboard`` imports (``pip install tensorboard``), else None.
    A resumed run purges the events after its checkpoint's iteration (an attempt that failed after
    the checkpoint wrote them), so every step's scalars appear once."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(directory), purge_step=resume_after + 1 if resume_after else None)


TENSORBOARD_SCALARS = {
    "lm loss": "lm_loss", "learning-rate": "lr", "grad-norm": "grad_norm", "throughput/tokens-per-s": "tokens_per_s",
    "throughput/tflops-per-gpu": "tflops_per_gpu", "throughput/mfu": "mfu", "iteration-time-s": "step_time_s",
    "memory/model-state-bytes": "model_state_bytes", "memory/model-state-peak-bytes": "model_state_peak_bytes",
    "memory/cuda-peak-allocated-bytes": "cuda_peak_allocated_bytes", "validation/lm loss": "valid_loss",
}
"""TensorBoard tag -> IterationRecord field (Megatron-LM's tag names where it has one)."""


def record_scalars(record: IterationRecord) -> dict[str, float]:
    """The iteration's scalars under their TensorBoard tags (W&B gets the same)."""
    return {tag: getattr(record, field) for tag, field in TENSORBOARD_SCALARS.items() if getattr(record, field) is not None}


def write_tensorboard(writer, record: IterationRecord) -> None:
    for tag, value in record_scalars(record).items():
        writer.add_scalar(tag, value, record.iteration)
    writer.flush()


@dataclass(kw_only=True)
class _Interval:
    """What the loop accumulates between two log lines (Megatron-LM resets its counters likewise)."""

    loss_sum: torch.Tensor | None = None
    """Over the iterations that advanced (a skipped one's loss is not averaged, as in Megatron-LM)."""
    iterations: int = 0
    advanced: int = 0
    step_s: float = 0.0
    skipped: int = 0
    """Iterations whose optimizer step was skipped (non-finite gradients)."""
    nan: int = 0
    """Skipped iterations whose loss was NaN or infinite (Megatron's "number of nan iterations")."""


@dataclass(frozen=True, kw_only=True)
class Built:
    """What :meth:`Pretrain.build` makes once the process group exists, handed to the steps that use
    it (as Megatron-LM's ``train`` and ``train_step`` take the model, optimizer and data iterators)."""

    trainer: Trainer
    train_ds: GPTDataset
    valid_ds: GPTDataset
    start_iteration: int
    """The iteration of the checkpoint resumed (0: a fresh start)."""
    flops_per_iteration: float
    writer: MetricsWriter | None
    """Rank 0's (the TensorBoard events' too; W&B's: the last rank's, where set)."""
    tensorboard: SummaryWriter | None
    wandb: WandbWriter | None


class Pretrain:
    def __init__(self, inputs: RunInputs):
        self.inputs = inputs
        self.params, self.geometry, self.ranks, self.paths = inputs.params, inputs.geometry, inputs.ranks, inputs.paths
        self.t, r = self.params.training, inputs.ranks
        self.device_path = device_path(r.local_rank, cpu_threads(r.omp_num_threads, os.cpu_count(), r.local_world_size))
        self.progress = ProgressReporter(r.progress_dir, r.rank, r.local_rank, r.attempt)
        self.save_request = SaveRequest(self.progress.enabled)
        self.pending_save: PendingSave | None = None
        """The save still being written in the background (training.async_save), if any."""
        self.prefetched: tuple[tuple, Future] | None = None
        """The next micro-batch, read on the reader's thread (the CUDA path): (dataset, first sample, micro step), its read."""
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")  # no thread until the first read
        self.gc = ManualGc(self.t.manual_gc, self.t.manual_gc_interval)
        self.busy_clock = self.device_path.busy_clock()
        self.busy_intervals: list[BusyInterval] = []
        """Every rank's busy time, one entry per log interval after a start's first, the last
        training.resilience.slow_rank_window_s seconds of them."""
        self.slow: list[int] = []
        self.slow_for_s: dict[int, float] = {}
        """Seconds of steps each rank over the ratio has stayed so (named at PERSIST_SHARE of the window)."""
        self.rank_hosts: list[str] | None = None

    def _say(self, text: str, every_node: bool = False) -> None:
        """Rank 0 prints ``text`` (``every_node``: each node's local rank 0, into that node's log)."""
        if (self.ranks.local_rank if every_node else self.ranks.rank) == 0:
            print(text, flush=True)

    # -- set up ---------------------------------------------------------------------------------
    def set_up(self) -> None:
        """Process group (NCCL or gloo), megatron's TP=1/PP=1 parallel state, RNG (the device and
        threads: chosen when constructed, training/device_paths.py)."""
        from megatron_ext.training.model import transformer_engine_version

        # training.fp8 needs transformer-engine and FP8 tensor cores (run_spec/fp8.py): checked before any
        # process group, every rank refuses alike, rank 0 says why
        if problem := fp8_problem(self.t.fp8, transformer_engine_version() if self.t.fp8 else None, self.device_path.capability):
            raise UserError(problem)
        self.device_path.join(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S[self.device_path.kind]), self.t.seed)
        self.save_request.open_group(self.device_path.on_cuda)
        torch.manual_seed(self.t.seed)

    # -- build ----------------------------------------------------------------------------------
    def build(self) -> Built:
        """Data, the model, its trainer for the ZeRO stage, the datasets, the FLOPs per step, the resume point."""
        from megatron_ext.training.agreement import agree_on_data, agree_on_resume
        from megatron_ext.training.datasets import build_datasets
        from megatron_ext.training.model import (build_gpt_model, choose_kernels, installed_megatron_core, model_vocab_size,
                                                 transformer_engine_version)
        from megatron_ext.training.hf_weights import load_hf_weights, restrict_logits

        m, t, on = self.params.model, self.t, self.device_path
        self.progress.phase(Phase.PREPARE)  # as long as a corpus takes: no limit
        # Rank 0 prepares and tells the others over the network (training/agreement.py): no lock,
        # no file polled, no cache key computed on another node.
        prepared = agree_on_data(self.params.data, self.paths.data_cache_dir, self.ranks.rank,
                                 say=print if self.ranks.local_rank == 0 else None)
        self.progress.phase(Phase.SETUP)
        # Rank 0 reads `latest` and lists the checkpoints, every rank takes its choice: whether to
        # start from the initial weights below and, in resume(), which checkpoint to load.
        resume_choice = agree_on_resume(self.paths.checkpoints_dir)
        resuming = bool(resume_choice.candidates)
        real_vocab = model_vocab_size(m, prepared.vocab_size)
        vocab = padded_vocab_size(real_vocab, m.make_vocab_size_divisible_by)
        kernels = choose_kernels(on.on_cuda, transformer_engine_version(), t.zero_stage, grad_reduce_in_bf16=t.grad_reduce_in_bf16,
                                 tied_embeddings=m.tie_embeddings, megatron_core=installed_megatron_core())
        module = build_gpt_model(m, vocab, t.seq_length, params_dtype=on.params_dtype, kernels=kernels,
                                 **fp8_config_fields(t.fp8, t.fp8_amax_history_len, t.fp8_amax_compute_algo))
        restrict_logits(module, real_vocab, vocab)  # the loss over the real vocabulary (hf_weights.py)
        if self.params.hf_weights and not resuming:
            load_hf_weights(module, m, hf_model_type(m), vocab)  # before any wrapper, on every rank
            self._say(f"initialised from the Hugging Face weights in {m.hf_checkpoint}")
        if t.init_checkpoint and not resuming:
            from megatron_ext.training.megatron_lm_weights import load_init_checkpoint

            load_init_checkpoint(module, t.init_checkpoint, m.name, announce=self.ranks.rank == 0)  # every rank
        trainer, warm_up_note = on.wrap(module, t, m=m, kernels=kernels, vocab=vocab, shard_one_rank=self.inputs.shard_one_rank)
        self._say(f"building the dataset index (megatron-core's GPTDataset: {t.train_iters * t.global_batch_size:,} "
                  f"training samples of {t.seq_length} tokens; cached under {self.paths.data_cache_dir / 'index'}, "
                  "so later starts reuse it)")
        index_started = time.monotonic()
        train_ds, valid_ds = build_datasets(
            prepared, self.params.data, t.seq_length, t.seed,
            num_train_samples=t.train_iters * t.global_batch_size,
            num_valid_samples=max(1, t.eval_iters) * t.global_batch_size,  # every validation pass reads the same batches
            cache_dir=self.paths.data_cache_dir / "index",
        )
        self._say(f"dataset index ready in {time.monotonic() - index_started:.1f} s")
        start = self.resume(trainer, resume_choice)
        writer = MetricsWriter(self.paths.metrics_path, start) if self.ranks.rank == 0 else None
        tensorboard = open_tensorboard(self.paths.tensorboard_dir, start) if self.ranks.rank == 0 else None
        wandb = None
        if self.inputs.wandb:  # the last rank, as Megatron-LM (see training/wandb_log.py)
            from megatron_ext.training.wandb_log import open_wandb_on

            wandb = open_wandb_on(self.inputs.wandb, self.paths, self.params, self.ranks.rank, self.ranks.world_size,
                                  self.geometry.accumulation_steps)
        self._say(f"run {self.paths.run}: model {m.name} data {self.params.data_set} | world size {self.ranks.world_size} "
                  f"| ZERO_STAGE={t.zero_stage} | {on.kind}/{on.backend}/{on.precision} "
                  f"| vocab {vocab} | {self.geometry.describe()}\nkernels: {kernels.describe()}"
                  + (f", fp8 {t.fp8}" if t.fp8 else "")
                  + (f"\n{trainer.gradients_note}" if trainer.gradients_note else "")
                  + (f"\n{warm_up_note}" if warm_up_note else "") + f"\n{on.mfu_note(m, t, vocab)}")
        return Built(trainer=trainer, train_ds=train_ds, valid_ds=valid_ds, start_iteration=start,
                     flops_per_iteration=flops_per_token(m, t.seq_length, vocab) * t.global_batch_size * t.seq_length,
                     writer=writer, tensorboard=tensorboard, wandb=wandb)

    # -- one step -------------------------------------------------------------------------------
    def _read(self, dataset, first_sample: int, micro_step: int) -> dict[str, torch.Tensor | None]:
        """One micro-batch on the host (pinned on CUDA, so the copy to the GPU can overlap)."""
        from megatron_ext.training.datasets import global_batch_slice

        t = self.t
        batch = global_batch_slice(dataset, first_sample, self.ranks.rank, self.ranks.world_size,
                                   t.micro_batch_size, micro_step)
        if self.device_path.reads_ahead:
            batch = {k: v.pin_memory() if v is not None else None for k, v in batch.items()}
        return batch

    def _batch(self, dataset, first_sample: int, micro_step: int, then: tuple[int, int] | None = None):
        """This micro-batch on the device; on CUDA the one after it (``then``: first sample, micro
        step) is read on a background thread meanwhile."""
        key = (id(dataset), first_sample, micro_step)
        pending, self.prefetched = self.prefetched, None
        batch = pending[1].result() if pending and pending[0] == key else self._read(dataset, first_sample, micro_step)
        if self.device_path.reads_ahead and then is not None:
            self.prefetched = ((id(dataset), *then), self.reader.submit(self._read, dataset, *then))
        return {k: v.to(self.device_path.device, non_blocking=True) if v is not None else None for k, v in batch.items()}

    @staticmethod
    def _loss(trainer: Trainer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses = trainer.model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        mask = batch["loss_mask"]
        return (losses.float() * mask).sum() / mask.sum().clamp(min=1)

    def train_step(self, built: Built, iteration: int, sample_memory: bool) -> tuple[torch.Tensor, float, bool]:
        """One optimizer step: (this rank's mean micro-batch loss, tensor; grad norm; skipped)."""
        accumulation, trainer = self.geometry.accumulation_steps, built.trainer
        lr = learning_rate(self.t, iteration - 1)
        trainer.zero_grad()
        loss_sum = torch.zeros(1, device=self.device_path.device)
        first = (iteration - 1) * self.t.global_batch_size
        try:
            for micro in range(accumulation):
                then = (first, micro + 1) if micro + 1 < accumulation else (first + self.t.global_batch_size, 0)
                with trainer.sync_context(micro == accumulation - 1):
                    batch = self._batch(built.train_ds, first, micro, then)
                    with self.busy_clock.compute():
                        loss = self._loss(trainer, batch)
                        if micro == 0 and sample_memory:
                            trainer.sample_memory()
                        (loss / accumulation).backward()
                loss_sum += loss.detach() / accumulation
            trainer.last_loss = loss_sum
            grad_norm, skipped = trainer.step(lr, self.t.weight_decay)
        except RuntimeError as exc:  # megatron-core DDP's own bucket check names this rank (rerun_state_machine.py)
            if isinstance(exc, NonFiniteGradients) or "Unexpected result" not in str(exc):
                raise
            raise NonFiniteGradients(float("nan"), detail=f"iteration {iteration}: {exc}; the update was not applied "
                                                          "and the run stops (Megatron-LM's default)") from None
        return loss_sum, grad_norm, skipped

    # -- log ------------------------------------------------------------------------------------
    def log(self, built: Built, iteration: int, interval: _Interval, grad_norm: float, valid_loss: float | None,
            elapsed_s: float) -> None:
        """One collective (all ranks): the interval's loss, every rank's busy time and memory
        figures (and once, every rank's host name)."""
        memory = built.trainer.memory_values()
        loss_sum = float(interval.loss_sum.item()) if interval.loss_sum is not None else 0.0
        busy_s = self.busy_clock.take()
        mine = torch.tensor([loss_sum, busy_s, *map(float, memory)], dtype=torch.float64, device=self.device_path.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.ranks.world_size)]
        dist.all_gather(gathered, mine)
        if self.rank_hosts is None:
            self.rank_hosts = [""] * self.ranks.world_size
            dist.all_gather_object(self.rank_hosts, socket.gethostname())
        if self.ranks.local_rank != 0 and built.wandb is None:  # every node's log shows the iterations; rank 0
            return  # writes metrics and TensorBoard, the last rank W&B
        t, world = self.t, self.ranks.world_size
        rows = [g.tolist() for g in gathered]
        busy = [r[1] for r in rows]
        self.note_slow_ranks(iteration, built.start_iteration, BusyInterval(interval.iterations, interval.step_s, tuple(busy)))
        lm_loss = sum(r[0] for r in rows) / (world * max(1, interval.advanced))
        step_s = interval.step_s / interval.iterations
        tflops = tflops_per_gpu(built.flops_per_iteration, step_s, world)
        record = IterationRecord(
            iteration=iteration, train_iters=t.train_iters, consumed_samples=iteration * t.global_batch_size,
            lm_loss=lm_loss, lr=learning_rate(t, iteration), grad_norm=grad_norm, step_time_s=step_s,
            skipped_iterations=interval.skipped, nan_iterations=interval.nan,
            tokens_per_s=t.global_batch_size * t.seq_length / step_s, tflops_per_gpu=tflops,
            global_batch_size=t.global_batch_size, world_size=world, zero_stage=t.zero_stage,
            mfu=tflops / peak if (peak := self.device_path.peak_tflops) else None, valid_loss=valid_loss, time=time.time(),
            busy_s_per_rank=[b / max(1, interval.iterations) for b in busy], slow_ranks=list(self.slow) if world > 1 else None,
            **built.trainer.memory_columns([[int(v) for v in r[2:]] for r in rows]),
        )
        if built.writer:
            built.writer.write(record)
        if built.tensorboard:
            write_tensorboard(built.tensorboard, record)
        if built.wandb:
            built.wandb.write(iteration, record_scalars(record))
        self._say(format_iteration_line(record), every_node=True)
        self._say(format_progress_line(record, elapsed_s), every_node=True)

    def note_slow_ranks(self, iteration: int, start_iteration: int, interval: BusyInterval) -> None:
        """Rank 0 names the ranks slower than the others (training.resilience.slow_rank_ratio and
        _window_s; run_spec/resilience.py) once they have stayed so for PERSIST_SHARE of the window,
        and says when they catch up. A start's first interval (allocation, first collectives) is not
        counted."""
        if iteration == start_iteration + 1 or self.ranks.world_size < 2:
            return
        r = self.t.resilience
        self.busy_intervals = window_of(self.busy_intervals + [interval], r.slow_rank_window_s)
        over = slow_ranks(self.busy_intervals, r.slow_rank_ratio, r.slow_rank_window_s)
        self.slow_for_s = still_slow(over, self.slow_for_s, interval.seconds)
        slow = [s for s in over if s.rank in self.slow or self.slow_for_s[s.rank] >= PERSIST_SHARE * r.slow_rank_window_s]
        named = [s.rank for s in slow]
        if named != self.slow and self.ranks.rank == 0:
            if slow:
                print(describe_slow_ranks(slow, self.ranks.local_world_size, self.rank_hosts or [], r.slow_rank_ratio)
                      + f" (iteration {iteration})", flush=True)
            else:
                print(f"{SLOW_RANK_CLEARED} (iteration {iteration}): rank(s) {', '.join(map(str, self.slow))} caught up",
                      flush=True)
        self.slow = named

    def evaluate(self, built: Built) -> float:
        t, accumulation, trainer = self.t, self.geometry.accumulation_steps, built.trainer
        trainer.model.eval()
        total = torch.zeros(1, device=self.device_path.device)
        with self.gc.around_evaluation(), torch.no_grad(), trainer.synced_parameters():
            for i in range(t.eval_iters):
                for micro in range(accumulation):
                    total += self._loss(trainer, self._batch(built.valid_ds, i * t.global_batch_size, micro)).detach() / accumulation
        dist.all_reduce(total)
        trainer.release_unsharded()
        trainer.model.train()
        return float(total) / (self.ranks.world_size * t.eval_iters)

    def resume(self, trainer: Trainer, choice: ResumeChoice) -> int:
        """Load the checkpoint rank 0 chose (:meth:`build`), if any: the iteration it holds (0 = fresh start)."""
        from megatron_ext.training import checkpoint

        where = self.paths.checkpoints_dir
        if not choice.candidates:
            return 0
        t = self.t
        started = time.monotonic()
        latest, skipped = checkpoint.newest_verified(where, choice)
        verified_s = time.monotonic() - started
        note = check_resumable(read_meta(where, latest), self.ranks.world_size, t.zero_stage, t.global_batch_size,
                               self.device_path.kind, where)
        started = time.monotonic()
        meta = checkpoint.load(trainer, where, latest)
        for line in (*choice.notes, *skipped):
            self._say(f"warning: {line}")
        self._say(f"checkpoint of iteration {latest} verified against its checksums in {verified_s:.1f} s")
        self._say(f"resuming from iteration {meta.iteration} ({where}; consumed samples {meta.consumed_samples}; "
                  f"loaded in {time.monotonic() - started:.1f} s)" + (f"; {note}" if note else ""),
                  every_node=True)  # every node's log: what its own ranks loaded
        return meta.iteration

    def save_checkpoint(self, trainer: Trainer, iteration: int, wait: bool) -> None:
        """Model, optimizer, schedule and data position, RNG (see training/checkpoint.py). With
        training.async_save the files are written in the background and committed at a later step
        (:meth:`finish_save`); ``wait``: committed before this returns (the last save of a run, a
        save on request before it ends)."""
        from megatron_ext.training import checkpoint

        t = self.t
        if self.pending_save is not None:  # Megatron-LM warns the same and finalizes before it saves again
            self._say(f"warning: the checkpoint of iteration {self.pending_save.meta.iteration} was still being "
                      f"written when the next save began: training waits for it; a longer training.save_interval "
                      f"leaves it the time")
            self.finish_save(blocking=True)
        meta = CheckpointMeta(iteration=iteration, consumed_samples=iteration * t.global_batch_size,
                              world_size=self.ranks.world_size, zero_stage=t.zero_stage,
                              global_batch_size=t.global_batch_size, device=self.device_path.kind)
        background = t.saves_in_background(self.device_path.on_cuda)
        self.pending_save = checkpoint.begin_save(trainer, self.paths.checkpoints_dir, meta, t.keep_checkpoints,
                                                  background=background)
        if wait or not background:
            self.finish_save(blocking=True)

    def finish_save(self, blocking: bool) -> None:
        """Every rank, at the same steps: commit the save under way once every rank's part is on
        disk (``blocking``: wait for that). Rank 0 says what it cost: the save's whole time and what
        training waited for."""
        pending = self.pending_save
        if pending is None or not pending.finished(blocking):
            return
        self.pending_save = None
        self._say(f"saved checkpoint at iteration {pending.meta.iteration} to {pending.final} in "
                  f"{time.monotonic() - pending.started:.1f} s (checksums {pending.checksum_s:.2f} s of it; "
                  f"training waited {pending.waited_s:.2f} s)")

    def close_writers(self, abort: bool = False) -> None:
        """At the end of a run (every save committed by then): the background writers ended, older
        checkpoints' removal done. ``abort`` (the run raised): megatron-core's worker killed, so that
        the process can exit (a save under way stays an unfinished ``.iter_N.saving-*`` folder)."""
        from megatron_ext.training import background_save, checkpoint, cuda_checkpoint

        cuda_checkpoint.close_async_calls_queue(abort)  # megatron-core's save worker (the CUDA trainer's; none on CPU)
        if not abort:
            background_save.close()
            checkpoint.wait_for_removals()

    # -- the whole run --------------------------------------------------------------------------
    def run(self) -> None:
        """:meth:`train`; a rank that raises leaves no checkpoint worker behind to hold its exit."""
        try:
            self.train()
        except BaseException:
            with contextlib.suppress(Exception):  # the run's own error is the one to say
                self.close_writers(abort=True)
            raise

    def train(self) -> None:
        from megatron.core import parallel_state

        self.progress.phase(Phase.SETUP)
        self.set_up()
        built = self.build()
        t, first = self.t, built.start_iteration + 1
        self.gc.start()
        start = time.time()
        interval = _Interval()
        saved_at = None
        preempted = False
        for iteration in range(first, t.train_iters + 1):
            logs = iteration == first or iteration % t.log_interval == 0 or iteration == t.train_iters
            self.progress.phase(Phase.STEP, iteration)
            step_start = time.time()
            with built.trainer.first_iteration() if iteration == first else contextlib.nullcontext(), self.busy_clock.counting():
                loss, grad_norm, skipped = self.train_step(built, iteration, sample_memory=logs)
            if logs:  # the step's time, at log intervals only (Megatron-LM: train_sync_interval); nothing to wait for on CPU
                self.device_path.synchronize()
            step_s = time.time() - step_start
            self.progress.step_done(step_s)
            interval.step_s += step_s
            if skipped:  # Megatron-LM's training_log: a skipped step's loss is counted, not averaged (~L1804-1823)
                interval.skipped += 1
                interval.nan += int(not math.isfinite(float(loss.item())))
            else:
                interval.loss_sum = loss if interval.loss_sum is None else interval.loss_sum + loss
                interval.advanced += 1
            interval.iterations += 1
            self.gc.after_step(iteration)
            self.finish_save(blocking=False)  # Megatron-LM: maybe_finalize_async_save(blocking=False) each step
            last = iteration == t.train_iters
            valid_loss = None
            if t.eval_iters and ((t.eval_interval and iteration % t.eval_interval == 0) or last):
                self.progress.phase(Phase.EVAL, iteration)
                valid_loss = self.evaluate(built)
                self._say(f" validation loss at iteration {iteration} | lm loss value: {valid_loss:.6E} |", every_node=True)
            if t.save_interval and (iteration % t.save_interval == 0 or last):
                self.progress.phase(Phase.CHECKPOINT, iteration)
                self.save_checkpoint(built.trainer, iteration, wait=last)
                saved_at = iteration
            if logs:
                self.log(built, iteration, interval, grad_norm, valid_loss, time.time() - start)
                interval = _Interval()
            if not last and self.save_request.agreed():  # every rank, the same step: save here and end
                self.progress.phase(Phase.CHECKPOINT, iteration)
                if saved_at != iteration:
                    self.save_checkpoint(built.trainer, iteration, wait=True)
                self.finish_save(blocking=True)
                if interval.iterations:
                    self.log(built, iteration, interval, grad_norm, valid_loss, time.time() - start)
                preempted = True
                break
        self.progress.phase(Phase.PREEMPTED if preempted else Phase.DONE)
        self._say(f"preempted: saved a checkpoint at iteration {self.progress.iteration} of {t.train_iters} and ended "
                  f"(a start of this run resumes there); metrics {self.paths.metrics_path}" if preempted else
                  f"done: {t.train_iters} iterations in {time.time() - start:.1f}s; metrics {self.paths.metrics_path}",
                  every_node=True)
        for writer in (built.writer, built.tensorboard, built.wandb):
            if writer:
                writer.close()
        self.gc.stop()
        self.close_writers()
        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
