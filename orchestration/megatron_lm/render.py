"""Render Megatron-LM ``pretrain_gpt.py`` arguments from the same params and ZeRO table.

    ENGINE=megatron-lm MEGATRON_LM_DIR=/opt/Megatron-LM DRY_RUN=1 python -m orchestration start qwen3_1p7b qwen3_1p7b_smoke r

Pure: a :class:`RunParams`, the prepared data, a stage, a checkout version and the run's paths
in; an argv list and the environment changes out. :func:`check_flags` compares a render with
the flags a checkout defines (:mod:`orchestration.megatron_lm.checkout`). The importer of argument
files (:mod:`orchestration.import_args`) goes the other way, by the same table (:data:`FIELD_FLAGS`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

from megatron_ext.run_spec.engines import MEGATRON_LM
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import RunParams
from megatron_ext.run_spec.wandb_run import WandbSettings
from megatron_ext.run_spec.flops import padded_vocab_size
from megatron_ext.run_spec.megatron_lm_checkpoints import pretrained_checkpoint_dir
from megatron_ext.run_spec.zero import megatron_lm_flags_for_stage, stage_environment
from orchestration.megatron_lm.flags import split_flags
from orchestration.node.wire import NodeReport

if TYPE_CHECKING:
    from megatron_ext.data.prepare import PreparedData

TOKENIZER_TYPES = {"sentencepiece": "SentencePieceTokenizer", "huggingface": "HuggingFaceTokenizer", "null": "NullTokenizer"}


@dataclass(frozen=True)
class NodeKernels:
    """What every node offers Megatron-LM's ranks, as the render needs it: from the preflight's
    answers (each node's GPUs and software), or what a start would assume without them."""

    gpus: bool = True
    transformer_engine: bool = True
    apex: bool = True

    @classmethod
    def from_answers(cls, answers: Sequence[NodeReport]) -> "NodeKernels":
        """What all of the nodes have (one node without it is all it takes to go without)."""
        return cls(gpus=all(r.visible_gpus > 0 for r in answers),
                   transformer_engine=all(r.software.get("transformer-engine") for r in answers),
                   apex=all(r.software.get("apex") for r in answers))

    def describe(self) -> str:
        if not self.gpus:
            return "no GPU: gloo, local layers, every fusion off, fp32"
        return (f"GPUs, {'transformer-engine layers' if self.transformer_engine else 'local layers (no transformer-engine)'}"
                f"{'' if self.apex else ', no apex (its fused kernels off)'}")


def kernel_flags(k: NodeKernels, p: RunParams) -> list[str]:
    """The layers and fusions the nodes can run (Megatron-LM enables fusions whose kernels may be
    missing: it fails at the first step, not at its argument check). Without a GPU, Megatron-LM on
    the CPU with gloo, as the tests run it through a CUDA-on-CPU shim (tests/megatron_lm_shim).
    The exact GELU of a GELU model needs ``--no-bias-gelu-fusion`` everywhere: the fusion computes
    the tanh approximation (megatron/core/fusions/fused_bias_gelu.py, used by mlp.py)."""
    gelu = [] if p.model.swiglu else ["--no-bias-gelu-fusion"]
    if not k.gpus:
        return ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-masked-softmax-fusion",
                "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
                "--no-persist-layer-norm", "--no-rope-fusion", "--use-cpu-initialization"]
    flags = ["--transformer-impl", "transformer_engine" if k.transformer_engine else "local"]
    if not k.transformer_engine:
        flags.append("--no-rope-fusion")  # transformer-engine's kernel (Megatron-LM raises without it)
        if not k.apex:  # torch's norm (WrappedTorchNorm) has no persistent kernel; the fused softmax is apex's
            flags += ["--no-persist-layer-norm", "--no-masked-softmax-fusion"]
    if not k.apex:  # the GPT output layer is megatron-core's ColumnParallelLinear in every spec: apex's extension
        flags.append("--no-gradient-accumulation-fusion")
    return flags + gelu


@dataclass(frozen=True)
class MegatronLMRender:
    args: list[str]
    env: dict[str, str | None]
    """Environment changes for every rank; None = unset the variable."""
    save_signal: str = MEGATRON_LM.save_signal
    """What makes Megatron-LM's ranks save and end (its --exit-signal-handler listens for it)."""


FIELD_FLAGS: dict[str, dict[str, tuple[str, type, Any]]] = {
    "model": {
        "num_layers": ("--num-layers", int, None), "hidden_size": ("--hidden-size", int, None),
        "ffn_hidden_size": ("--ffn-hidden-size", int, None), "num_attention_heads": ("--num-attention-heads", int, None),
        "num_query_groups": ("--num-query-groups", int, 1), "kv_channels": ("--kv-channels", int, None),
        "qk_layernorm": ("--qk-layernorm", bool, False), "normalization": ("--normalization", str, "LayerNorm"),
        "norm_epsilon": ("--norm-epsilon", float, 1e-5), "swiglu": ("--swiglu", bool, False),
        "add_bias_linear": ("--disable-bias-linear", bool, True), "add_qkv_bias": ("--add-qkv-bias", bool, False),
        "position_embedding_type": ("--position-embedding-type", str, "learned_absolute"),
        "rotary_base": ("--rotary-base", int, 10000), "rope_scaling": ("--use-rope-scaling", bool, False),
        "rope_scaling_factor": ("--rope-scaling-factor", float, 8.0),
        "max_position_embeddings": ("--max-position-embeddings", int, None),
        "hidden_dropout": ("--hidden-dropout", float, 0.1), "attention_dropout": ("--attention-dropout", float, 0.1),
        "make_vocab_size_divisible_by": ("--make-vocab-size-divisible-by", int, 128),
        "tie_embeddings": ("--untie-embeddings-and-output-weights", bool, True),
    },
    "training": {
        "seq_length": ("--seq-length", int, None), "micro_batch_size": ("--micro-batch-size", int, None),
        "global_batch_size": ("--global-batch-size", int, None), "train_iters": ("--train-iters", int, None),
        "lr": ("--lr", float, None), "min_lr": ("--min-lr", float, 0.0), "lr_warmup_iters": ("--lr-warmup-iters", int, 0),
        "lr_decay_iters": ("--lr-decay-iters", int, None), "weight_decay": ("--weight-decay", float, 0.01),
        "adam_beta1": ("--adam-beta1", float, 0.9), "adam_beta2": ("--adam-beta2", float, 0.999),
        "adam_eps": ("--adam-eps", float, 1e-8), "clip_grad": ("--clip-grad", float, 1.0), "seed": ("--seed", int, 1234),
        "eval_iters": ("--eval-iters", int, 100), "eval_interval": ("--eval-interval", int, None),
        "log_interval": ("--log-interval", int, 100), "save_interval": ("--save-interval", int, None),
        "grad_reduce_in_bf16": ("--grad-reduce-in-bf16", bool, False), "manual_gc": ("--manual-gc", bool, False),
        "manual_gc_interval": ("--manual-gc-interval", int, None), "fp8": ("--fp8-format", str, None),
        "fp8_amax_history_len": ("--fp8-amax-history-len", int, None),
        "fp8_amax_compute_algo": ("--fp8-amax-compute-algo", str, None),
    },
}
"""The preset fields that are one Megatron-LM flag each, both ways: section -> field -> (flag, type, default).
The render writes a value as ``repr`` (float) or ``str``, a switch (bool) where the field is not the
default; the import (:mod:`orchestration.import_args.mapping`) reads the flag's text as the type, a
switch as the default flipped, and an absent flag as the default: Megatron-LM core_v0.16.1's
argparse default (None: none, or the field's own rule)."""


def field_flags(p: RunParams, section: str, *keys: str, **values: Any) -> list[str]:
    """:data:`FIELD_FLAGS` of ``section``'s fields ``keys``, in that order; ``values``: what Megatron-LM
    takes in place of a field's value (``lr_decay_iters`` 0 means ``train_iters``)."""
    flags: list[str] = []
    for key in keys:
        (flag, kind, default), value = FIELD_FLAGS[section][key], values.get(key, getattr(getattr(p, section), key))
        if kind is not bool:
            flags += [flag, repr(value) if kind is float else str(value)]
        elif value != default:
            flags.append(flag)
    return flags


def model_flags(p: RunParams) -> list[str]:
    m = p.model
    if m.gelu_tanh:
        # Megatron-LM reads --openai-gelu in its legacy model only; its megatron-core GPT always
        # uses F.gelu (arguments.py core_transformer_config_from_args, core_v0.16.1).
        raise UserError(
            f"model {m.name} uses the tanh GELU (gelu_tanh: true, GPT-2's), which Megatron-LM's pretrain_gpt.py "
            "cannot build (--openai-gelu reaches only its legacy model); use ENGINE=megatron-core, or set "
            "gelu_tanh: false for the exact GELU"
        )
    flags = field_flags(p, "model", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
    if m.num_query_groups and m.num_query_groups != m.num_attention_heads:
        flags += ["--group-query-attention", *field_flags(p, "model", "num_query_groups")]
    flags += field_flags(p, "model", *(["kv_channels"] if m.kv_channels else []), "qk_layernorm", "normalization", "norm_epsilon",
                         "swiglu", "add_bias_linear", *([] if m.add_bias_linear else ["add_qkv_bias"]), "position_embedding_type")
    if m.position_embedding_type == "rope":
        flags += field_flags(p, "model", "rotary_base", *(["rope_scaling", "rope_scaling_factor"] if m.rope_scaling else []))
    # Megatron's dropout defaults are 0.1; the presets say what they use.
    return (flags + field_flags(p, "model", "max_position_embeddings") + field_flags(p, "training", "seq_length")
            + field_flags(p, "model", "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by", "tie_embeddings"))


def data_flags(p: RunParams, prepared: PreparedData) -> list[str]:
    tok = p.data.tokenizer
    flags = ["--tokenizer-type", TOKENIZER_TYPES[prepared.tokenizer_type]]
    if prepared.tokenizer_type == "null":
        # NullTokenizer adds one token (end of document): the vocabulary is --vocab-size + 1.
        vocab = p.model.vocab_size or tok.vocab_size + 1
        flags += ["--vocab-size", str(vocab - 1)]
    elif prepared.tokenizer_type == "huggingface":
        from megatron_ext.data.tokenizers import hf_tokenizer_file

        # Megatron-LM builds it with transformers' AutoTokenizer.from_pretrained (both its legacy
        # build_tokenizer and megatron.core.tokenizers): a directory, never the tokenizer.json file.
        flags += ["--tokenizer-model", str(hf_tokenizer_file(prepared.tokenizer_path).parent)]
    else:
        flags += ["--tokenizer-model", str(prepared.tokenizer_path)]
    if prepared.tokenizer_type != "null" and p.model.vocab_size:
        # The preset's vocabulary, not the tokenizer's: Megatron-LM pads len(tokenizer) otherwise
        # (Qwen3: 151,669 -> 151,680, where the model has 151,936 rows).
        flags += ["--padded-vocab-size", str(padded_vocab_size(p.model.vocab_size, p.model.make_vocab_size_divisible_by))]
    elif prepared.tokenizer_type == "sentencepiece" and prepared.vocab_size > 0:
        # The model this program builds: Megatron-LM sizes it by its legacy SentencePieceTokenizer, which
        # appends <CLS>, <SEP>, <EOD>, <MASK> (megatron/training/tokenizer/tokenizer.py L391-441) that the
        # data never holds (2,048 pieces -> 2,176 rows), so a checkpoint of either engine fits the other.
        flags += ["--padded-vocab-size", str(padded_vocab_size(prepared.vocab_size, p.model.make_vocab_size_divisible_by))]
    if p.data.source == "mock":
        flags.append("--mock-data")
    else:
        path = ([part for weight, prefix in zip(prepared.weights, prepared.prefixes) for part in (repr(weight), prefix)]
                if len(prepared.prefixes) > 1 else list(prepared.prefixes))  # weight-prefix pairs, or one prefix
        flags += ["--data-path", *path, "--split", p.data.split]
    return flags


def training_flags(p: RunParams, bf16: bool) -> list[str]:
    t = p.training
    flags = [*field_flags(p, "training", "micro_batch_size", "global_batch_size", "train_iters", "lr", "min_lr"),
             "--lr-decay-style", "cosine",
             *field_flags(p, "training", "lr_warmup_iters", "lr_decay_iters", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                          "clip_grad", "seed", "eval_iters", "eval_interval", lr_decay_iters=t.lr_decay_iters or t.train_iters,
                          eval_interval=t.eval_interval or t.train_iters)]
    if bf16:
        flags.append("--bf16")
    # fp8: transformer-engine's delayed scaling, as this program's fp8_autocast (known_limits needs TE);
    # manual_gc: Megatron-LM's own, gc frozen after setup, collected every N steps on every rank
    fp8 = ["fp8", "fp8_amax_history_len", "fp8_amax_compute_algo"] if t.fp8 else []
    return flags + field_flags(p, "training", "grad_reduce_in_bf16", *fp8, "manual_gc",
                               *(["manual_gc_interval"] if t.manual_gc and t.manual_gc_interval else []))


USE_CHECKPOINT_SCHEDULE = ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler")
"""A user's flag for the checkpoint's schedule, both spellings Megatron-LM's parser takes."""


def schedule_flags(extra_args: Sequence[str] = ()) -> list[str]:
    """The learning-rate schedule from the run's params at every start, as this program's
    (training/loop.py: from ``lr_decay_iters or train_iters`` at each start): Megatron-LM's
    ``--override-opt_param-scheduler``. Without it a resume with another ``train_iters`` (a run
    extended) dies at the load: megatron-core's OptimizerParamScheduler._check_and_set asserts that
    every value equals the checkpoint's ("class input value 128 and checkpointvalue 64 for total
    number of iterations do not match", core_v0.16.1 and core_v0.19.0). A user's own
    ``--use-checkpoint-opt_param-scheduler`` (either spelling: the checkpoint's schedule instead) wins: the two
    together are refused by the same class's constructor."""
    return [] if set(USE_CHECKPOINT_SCHEDULE) & set(extra_args) else ["--override-opt_param-scheduler"]


def logging_and_checkpoint_flags(p: RunParams, paths: RunPaths, wandb: WandbSettings | None = None,
                                 known: Collection[str] = (), load: bool = True, gpus: bool = True) -> list[str]:
    t = p.training
    return [
        *field_flags(p, "training", "log_interval"),
        "--log-throughput",
        "--tensorboard-dir", str(paths.tensorboard_dir),
        *wandb_flags(wandb, paths, known),
        "--data-cache-path", str(paths.data_cache_dir / "megatron_lm_index"),
        *(["--save", str(paths.checkpoints_dir), *field_flags(p, "training", "save_interval")] if t.save_interval else []),
        *async_save_flags(p, known, gpus),
        *(load_flags(paths) if load else []),
        *init_flags(p),
        *flight_recorder_flags(paths, known),
    ]


FLIGHT_RECORDER_PREFIX = "nccl_flight_recorder_rank"
"""The files Megatron-LM's flight recorder writes into the run's hangs folder: ``<prefix><rank>``."""


def flight_recorder_flags(paths: RunPaths, known: Collection[str] = ()) -> list[str]:
    """Where the checkout has ``--flight-recorder-dump-path`` (core_v0.17.1 and later; core_v0.19.0's
    initialize.py L291-320 sets torch's TORCH_FR_DUMP_TEMP_FILE from it, and NCCL's watchdog writes
    every rank's record there when a collective times out), the run's hangs folder, beside the
    stacks the supervisor dumps (pickles: ``python -m torch.distributed.flight_recorder.fr_trace``)."""
    if "--flight-recorder-dump-path" not in known:
        return []
    return ["--flight-recorder-dump-path", str(paths.run_dir / "hangs" / FLIGHT_RECORDER_PREFIX)]


def integrity_flags(stage: int, known: Collection[str] = ()) -> list[str]:
    """``--verify-integrity`` where the checkout has it (core_v0.17.1 and later) and the stage saves
    torch_dist (stages 0-1: Megatron-LM refuses it with fsdp_dtensor, training_config.py L645 at
    core_v0.19.0): each save writes ``integrity.json``, the SHA-256 of every file, and each load
    checks it. Node 0 adds it to an attempt whose checkpoint has one (orchestration/node/resume_point.py)."""
    return ["--verify-integrity"] if "--verify-integrity" in known and stage < 2 else []


def async_save_flags(p: RunParams, known: Collection[str] = (), gpus: bool = True) -> list[str]:
    """``training.async_save`` (true or ``gpu``) on GPU nodes where the run saves, the stage saves torch_dist (stages 0-1: Megatron-LM's
    async save supports that format only, training_config.py L516-517 at core_v0.19.0) and the
    checkout has the flags: ``--async-save --use-persistent-ckpt-worker`` (without the worker
    Megatron-LM turns async saving off again, arguments.py L1138-1144 at core_v0.16.1, L1740-1746
    at core_v0.19.0), and ``--async-strategy mcore`` where the release has it (0.17.1 and later:
    the default, nvrx, needs nvidia-resiliency-ext). Not fsdp_dtensor (stages 2-3), though
    core_v0.17.0 and later have a background path for it: core_v0.16.1 saves it synchronously and
    then asserts an async request (checkpointing.py L643-655, L764), and core_v0.19.0's path with
    the mcore strategy calls megatron-core's ``save_state_dict_async_plan`` with ``enable_cache``,
    which that function does not take (checkpointing.py L876-883 against
    dist_checkpointing/strategies/state_dict_saver.py L41-49): every rank raised TypeError at the
    first save (tried here with --no-save-optim, 2026-12-06). Its train() finalizes every save in flight
    before it returns (training.py L1514, L4120 at core_v0.19.0), so a save on a stop request is
    whole before the rank exits 0. Never on CPU nodes: there the state is already in host memory,
    and Megatron-LM's background save writes the very tensors training goes on changing
    (megatron-core's ``preload_tensors`` copies a GPU tensor to host memory and keeps a host tensor
    as it is: dist_checkpointing/strategies/filesystem_async.py L227-248 at core_v0.19.0). Tried
    here (core_v0.19.0, 2 nodes x 1 rank, tests/test_multinode.py): resumed from the checkpoint of
    iteration 2 written in the background, iteration 3's loss was 7.39993 against 7.48993 in the
    run never stopped; written before training went on, every loss was the same."""
    t = p.training
    if not (t.async_save and gpus and t.save_interval and t.zero_stage < 2 and "--async-save" in known
            and "--use-persistent-ckpt-worker" in known):
        return []
    return ["--async-save", "--use-persistent-ckpt-worker", *(["--async-strategy", "mcore"] if "--async-strategy" in known else [])]


def init_flags(p: RunParams) -> list[str]:
    """``training.init_checkpoint`` as Megatron-LM's own start from a checkpoint's weights: its
    load_checkpoint reads ``--pretrained-checkpoint`` while ``--load`` holds no checkpoint (iteration 0,
    no optimizer, scheduler or RNG state: checkpointing.py L1494-1502), so it is rendered on every
    start and a run with checkpoints of its own resumes from those."""
    path = p.training.init_checkpoint
    return ["--pretrained-checkpoint", pretrained_checkpoint_dir(path)] if path else []


def load_flags(paths: RunPaths) -> list[str]:
    """Resume from the run's checkpoints (``latest_checkpointed_iteration.txt``)."""
    return ["--load", str(paths.checkpoints_dir)]


def wandb_flags(wandb: WandbSettings | None, paths: RunPaths, known: Collection[str] = ()) -> list[str]:
    """WANDB_PROJECT set: Megatron-LM's W&B writer (its last rank logs, global_vars.py
    ``_set_wandb_writer``) under the run name (WANDB_NAME overrides it), its files under the run
    directory (WANDB_DIR overrides it); ``--wandb-entity`` where the checkout defines it (core_v0.15
    and later; older ones take WANDB_ENTITY from the environment, which wandb reads itself)."""
    if wandb is None:
        return []
    flags = ["--wandb-project", wandb.project, "--wandb-exp-name", wandb.exp_name(paths.run),
             "--wandb-save-dir", str(wandb.save_dir(paths))]
    if wandb.entity and "--wandb-entity" in known:
        flags += ["--wandb-entity", wandb.entity]
    return flags


FSDP_GRAD_DTYPE_FLAGS = ("--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype")
"""Megatron-FSDP's gradient precision in Megatron-LM 0.19 and later (arguments.py L3524-3531 at
core_v0.19.0): both default to ``auto``, which validate_args maps to None (L1057-1058), training.py
passes on to the DDP config (L2000-2001), and Megatron-FSDP resolves to the parameters' dtype:
bf16 main gradients, reduce-scattered in bf16 (param_and_grad_buffer.py ~L2310, L2541). core_v0.17.1
and core_v0.18.2 define them too, but there the DDP config's grad_reduce_in_fp32 (Megatron-LM's
``--accumulate-allreduce-grads-in-fp32``, on for bf16 unless ``--grad-reduce-in-bf16``) wins
(mcore_fsdp_adapter.py L117-130 at core_v0.18.2); 0.16.1 and older lack them. Rendered wherever
the checkout has them, they say the same on every release."""


def gradient_precision_flags(p: RunParams, known: Collection[str] = ()) -> list[str]:
    """Stages 2-3 on a checkout with :data:`FSDP_GRAD_DTYPE_FLAGS`: fp32 main gradients and fp32
    reduce-scatter, as this program sets megatron-core's fields (megatron_fsdp_grad_dtypes in
    megatron_ext/training/cuda_trainer.py), or bf16 for both with ``training.grad_reduce_in_bf16``,
    so the two engines reduce in the same precision at every stage. Pure."""
    if p.training.zero_stage < 2 or not all(flag in known for flag in FSDP_GRAD_DTYPE_FLAGS):
        return []
    dtype = "bf16" if p.training.grad_reduce_in_bf16 else "fp32"
    return [part for flag in FSDP_GRAD_DTYPE_FLAGS for part in (flag, dtype)]


def overlap_flags(stage: int) -> list[str]:
    """Communication overlap as the megatron-core engine configures it: gradient reduction with
    backward at every stage, parameter gathers with forward from stage 1 (distributed optimizer
    or Megatron-FSDP; Megatron-LM requires one of them for --overlap-param-gather)."""
    return ["--overlap-grad-reduce", *(["--overlap-param-gather"] if stage >= 1 else [])]


def exit_signal_flags(known: Collection[str]) -> tuple[list[str], str]:
    """Megatron-LM's DistributedSignalHandler (the ranks agree on a signal every iteration, save,
    and exit 0): ``--exit-signal SIGUSR1`` where the checkout has it (core_v0.16 and later), else
    the handler's default, SIGTERM, which the supervisor then sends the ranks directly."""
    if "--exit-signal-handler" not in known:
        return [], "SIGTERM"
    if "--exit-signal" in known:
        return ["--exit-signal-handler", "--exit-signal", "SIGUSR1"], "SIGUSR1"
    return ["--exit-signal-handler"], "SIGTERM"


def render_pretrain_gpt(p: RunParams, prepared: PreparedData, paths: RunPaths, version: tuple[int, int],
                        kernels: NodeKernels = NodeKernels(), known: Collection[str] = (), wandb: WandbSettings | None = None,
                        extra_args: Sequence[str] = (), load: bool = True) -> MegatronLMRender:
    """``pretrain_gpt.py``'s arguments for nodes with ``kernels``; ``known`` (the checkout's flags)
    adds the exit-signal handler the checkout has; ``wandb`` (the launcher's WANDB_* settings)
    Megatron-LM's W&B flags; ``extra_args`` (MEGATRON_LM_EXTRA_ARGS, training.megatron_lm_extra_args)
    come last, so a flag given there wins; ``load``: ``--load`` of the run's checkpoints (only when
    there is one: Megatron-FSDP given an empty --load takes a dummy optimizer step that changes training)."""
    stage = p.training.zero_stage
    signal_flags, save_signal = exit_signal_flags(known)
    args = (
        model_flags(p)
        + data_flags(p, prepared)
        + training_flags(p, kernels.gpus)
        + schedule_flags(extra_args)
        + kernel_flags(kernels, p)
        + logging_and_checkpoint_flags(p, paths, wandb, known, load, kernels.gpus)
        + megatron_lm_flags_for_stage(stage, version)
        + gradient_precision_flags(p, known)
        + overlap_flags(stage)
        + signal_flags
        + list(extra_args)
    )
    return MegatronLMRender(args, stage_environment(stage), save_signal)


FLAG_ALTERNATIVES = {
    "--use-megatron-fsdp": "--use-custom-fsdp (Megatron-LM 0.12-0.13)",
    "--use-custom-fsdp": "--use-megatron-fsdp (Megatron-LM 0.14+)",
}


def check_flags(args: list[str], known: Mapping[str, tuple[str, ...]], version_text: str) -> None:
    """Refuse a flag the checkout does not define, or a value outside its choices; ``known``: option
    string -> choices (empty = any), e.g. :attr:`Checkout.flags <orchestration.megatron_lm.checkout.Checkout.flags>`."""
    for flag, values in split_flags(args):
        if flag not in known:
            alternative = FLAG_ALTERNATIVES.get(flag) or next(iter(difflib.get_close_matches(flag, list(known), n=1, cutoff=0.85)), None)
            hint = f"; the checkout has {alternative}" if alternative else ""
            raise UserError(
                f"Megatron-LM {version_text} does not define {flag}{hint}; use a checkout that has it "
                "(e.g. core_v0.16.1) or change the params that need it"
            )
        choices = known[flag]
        for value in values if choices else ():
            if value not in choices:
                raise UserError(
                    f"{flag} {value} is not accepted by Megatron-LM {version_text}: choices are "
                    f"{', '.join(choices)}; change the params or the checkout"
                )
