"""Reading the merged flags of argument files: each taken once, for a field or for the list of what is not imported.

    python -m orchestration import-megatron-args model.sh data.sh --model-out m.yaml --data-out d.yaml

:class:`FlagReader` hands :mod:`orchestration.import_args.mapping` the flags' values (checked, as
the field needs them) and records what it took, the comments and conversions; a flag without a
field goes to the list (:class:`NotImported`): without a counterpart, handled by the launcher
(:data:`LAUNCHER_FLAGS`, torchrun's own), or fixed in this project (:data:`FIXED_VALUES`).
:func:`list_the_rest` lists every flag no field took. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_ext.run_spec.errors import UserError
from orchestration.import_args.given_flags import GivenFlag

NOT_IMPORTED, LAUNCHER, FIXED = "not imported", "handled by the launcher", "fixed in this project"

TORCHRUN_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
                  "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
                  "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--rdzv_conf", "--rdzv-conf", "--standalone",
                  "--max_restarts", "--max-restarts", "--monitor_interval", "--log_dir", "--log-dir", "--redirects",
                  "--tee", "--local_addr", "--local-addr"}
TORCHRUN_REASON = "the launcher runs torchrun itself (HOSTS, NNODES, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT)"
_LAUNCHER_REASONS = {
    ("--save", "--load", "--ckpt-format", "--use-dist-ckpt", "--auto-detect-ckpt-format", "--use-persistent-ckpt-worker",
     "--async-strategy"):
        "checkpoints live under $ARTIFACT_ROOT/<run>/checkpoints (training.save_interval, keep_checkpoints)",
    ("--tensorboard-dir", "--data-cache-path", "--log-throughput"):
        "the launcher sets the run's paths and logging under $ARTIFACT_ROOT/<run>",
    ("--bf16",): "the launcher trains in bf16 on GPUs and fp32 on CPU",
    ("--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--overlap-grad-reduce",
     "--overlap-param-gather"): "the launcher renders the ZeRO stage's flags from training.zero_stage "
                                "(megatron_ext/run_spec/zero.py)",
    ("--exit-signal-handler", "--exit-signal", "--exit-duration-in-mins", "--distributed-backend",
     "--distributed-timeout-minutes"): "the launcher's supervisor stops, saves and times out runs",
    ("--attention-backend", "--transformer-impl", "--use-flash-attn", "--no-masked-softmax-fusion",
     "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
     "--cross-entropy-loss-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
     "--use-cpu-initialization"):
        "the engine picks kernels per device (megatron_ext/training/model.py, KernelChoices)",
    ("--num-workers",): "the engine sets up data loading itself",
}
LAUNCHER_FLAGS = {flag: reason for flags, reason in _LAUNCHER_REASONS.items() for flag in flags}
_LAUNCHER_PREFIXES = ("--log-", "--tensorboard-", "--wandb-", "--timing-log-")
FIXED_VALUES = {
    **dict.fromkeys(("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"),
                    ("1", "this project trains with data parallelism only (TP = PP = CP = 1)")),
    "--rotary-percent": ("1.0", "this project rotates the whole head dimension"),
    "--init-method-std": ("0.02", "this project initialises with megatron-core's init_method_std 0.02"),
    "--optimizer": ("adam", "this project's optimizer is Adam with decoupled weight decay (AdamW), as Megatron-LM's adam"),
    "--weight-decay-incr-style": ("constant", "this project's weight decay is constant"),
    "--lr-warmup-init": ("0.0", "this project's warmup starts at 0"),
    "--vocab-extra-ids": ("0", "this project adds no extra vocabulary ids"),
}
"""Flags whose value this project always uses: listed as fixed when the file gives that value, as
not imported otherwise."""
FIXED_SWITCHES = {"--use-mcore-models": "this project builds megatron-core models (Megatron-LM's default too)",
                  **dict.fromkeys(("--override-opt_param-scheduler", "--override-opt-param-scheduler"),
                                  "this project takes the learning-rate schedule from the run's params at every start "
                                  "(a longer train_iters extends the run)")}
"""Flags without a value that say what this project always does."""


@dataclass(frozen=True, kw_only=True)
class NotImported:
    flag: str
    values: tuple[str, ...]
    reason: str
    where: str
    kind: str = NOT_IMPORTED
    """:data:`NOT_IMPORTED` (no counterpart), :data:`LAUNCHER` or :data:`FIXED`."""
    section: str = "other"
    """model / data / training / other: which YAML lists it."""

    def describe(self) -> str:
        return f"{' '.join([self.flag, *self.values])} ({self.where}): {self.reason}"


@dataclass(kw_only=True)
class FlagReader:
    flags: dict[str, GivenFlag]
    used: set[str] = field(default_factory=set)
    skipped: list[NotImported] = field(default_factory=list)
    imported: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    comments: dict[str, str] = field(default_factory=dict)
    conversions: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    def given(self, flag: str) -> bool:
        return flag in self.flags

    def _take(self, flag: str, counterpart: bool = True) -> GivenFlag | None:
        given = self.flags.get(flag)
        if given is not None and flag not in self.used:
            self.used.add(flag)
            if counterpart:
                self.imported.append((flag, tuple(w.text for w in given.values)))
        return given

    def switch(self, flag: str) -> bool:
        return self._take(flag) is not None

    def texts(self, flag: str, needed_for: str) -> list[str] | None:
        given = self._take(flag)
        if given is None:
            return None
        for w in given.values:
            if w.unresolved:
                raise UserError(f"{w.where}: {flag} {w.text}: {w.unresolved}; the value is needed for {needed_for}")
        return [w.text for w in given.values]

    def text(self, flag: str, needed_for: str) -> str | None:
        values = self.texts(flag, needed_for)
        return values[0] if values else None

    def number(self, flag: str, kind: type, needed_for: str) -> Any:
        text = self.text(flag, needed_for)
        if text is None:
            return None
        try:
            return kind(text)
        except ValueError:
            raise UserError(f"{self.flags[flag].where}: {flag} {text!r} is not {'an integer' if kind is int else 'a number'} "
                            f"(Megatron-LM reads it as {kind.__name__}); fix the file") from None

    def required(self, flag: str, kind: type, needed_for: str) -> Any:
        value = self.number(flag, kind, needed_for)
        if value is None:
            raise UserError(f"the files give no {flag}, which Megatron-LM needs (for {needed_for}); add it to a file")
        return value

    def converted(self, flag: str) -> None:
        """``flag`` was read into a field in another form (it does not render back as given)."""
        self.conversions += [(f, v) for f, v in self.imported if f == flag]
        self.imported = [(f, v) for f, v in self.imported if f != flag]

    def untake(self, flag: str) -> None:
        """Undo :meth:`_take` (a flag read first, then found to have no counterpart)."""
        self.used.discard(flag)
        self.imported = [(f, v) for f, v in self.imported if f != flag]

    def skip(self, flag: str, reason: str, kind: str = NOT_IMPORTED, section: str = "other") -> None:
        if flag in self.used:
            return
        given = self._take(flag, counterpart=False)
        if given is not None:
            self.skipped.append(NotImported(flag=flag, values=tuple(w.text for w in given.values), reason=reason, where=given.where,
                                            kind=kind, section=section))


def list_the_rest(r: FlagReader) -> None:
    """Every flag not yet taken: launcher business, a fixed value, or no counterpart."""
    for flag, given in list(r.flags.items()):
        if flag in r.used:
            continue
        values = tuple(w.text for w in given.values)
        if flag in TORCHRUN_FLAGS:
            r.skip(flag, TORCHRUN_REASON, LAUNCHER)
        elif flag in LAUNCHER_FLAGS or flag.startswith(_LAUNCHER_PREFIXES):
            default = ("the launcher logs to W&B from WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY, WANDB_DIR"
                       if flag.startswith("--wandb-") else "the launcher writes its own logs and metrics under $ARTIFACT_ROOT/<run>")
            r.skip(flag, LAUNCHER_FLAGS.get(flag, default), LAUNCHER)
        elif flag in FIXED_SWITCHES:
            r.skip(flag, FIXED_SWITCHES[flag], FIXED)
        elif flag in FIXED_VALUES:
            fixed, reason = FIXED_VALUES[flag]
            same = len(values) == 1 and _same_number(values[0], fixed)
            r.skip(flag, reason if same else f"no counterpart: {reason}", FIXED if same else NOT_IMPORTED,
                   "model" if flag in ("--rotary-percent", "--init-method-std", "--vocab-extra-ids") else "other")
        elif flag == "--fp16":
            r.skip(flag, "no counterpart: this project trains in bf16 on GPUs (no fp16 loss scaling)")
        elif flag == "--rampup-batch-size":
            r.skip(flag, "no counterpart: this project keeps the global batch fixed", section="training")
        else:
            r.skip(flag, "no counterpart in ModelPreset, DataParams or TrainingParams")


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b
