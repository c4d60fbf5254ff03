"""Model presets -> megatron-core ``GPTModel``; exact parameter counts on the meta device.

    python -c "from megatron_ext.training.model import count_parameters; \\
        from megatron_ext.run_spec.params import load_model; print(count_parameters(load_model('qwen3_1p7b')))"

Needs megatron's parallel state for TP=1/PP=1: :func:`ensure_model_parallel` creates it on the
world group (or, with no process group yet, a one-process gloo group on an in-memory store).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from megatron_ext.host.devices import Device
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.fp8 import te_at_least
from megatron_ext.run_spec.flops import padded_vocab_size
from megatron_ext.run_spec.model_size import ParameterCount
from megatron_ext.run_spec.params import ModelPreset
from megatron_ext.training.megatron_core_releases import parse_version


def model_vocab_size(preset: ModelPreset, tokenizer_vocab: int | None) -> int:
    """Unpadded vocabulary: the preset's when it names one (exact models), else the tokenizer's."""
    if preset.vocab_size is None:
        if tokenizer_vocab is None:
            raise UserError(f"model {preset.name} takes its vocabulary from a tokenizer; none given")
        return tokenizer_vocab
    if tokenizer_vocab is not None and tokenizer_vocab > preset.vocab_size:
        raise UserError(
            f"tokenizer vocabulary {tokenizer_vocab} exceeds model {preset.name}'s vocab_size "
            f"{preset.vocab_size}; use a smaller tokenizer or a model without a fixed vocab_size"
        )
    return preset.vocab_size


def ensure_model_parallel() -> None:
    """TP=1, PP=1 parallel state on the default group; creates a 1-process group if none."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """Which fused kernels and which attention a run uses, decided once from what is installed.

    megatron-core's fusions are enabled only where their kernels exist: with transformer-engine
    (its layers, norms, fused attention and rope), or where the compiled extension is found;
    otherwise the unfused path. A GPU without transformer-engine (a plain PyTorch image) gets
    megatron-core's local layers, unfused norms and :class:`SdpaAttention`."""

    device: Device
    """cuda or cpu."""
    transformer_engine: bool
    """Layers from transformer-engine (the TE layer spec)."""
    attention: str
    """transformer-engine (its fused attention), sdpa (torch scaled_dot_product_attention), or
    local (megatron-core's DotProductAttention: needs the attention mask; benchmarks only)."""
    persist_layer_norm: bool
    """Persistent fused layer norm: only transformer-engine's norms have it (torch's LayerNorm asserts)."""
    masked_softmax_fusion: bool
    """Fused scale-mask-softmax: transformer-engine, or the scaled_masked_softmax_cuda extension."""
    bias_dropout_fusion: bool
    """Fused bias + dropout + residual add (megatron-core's jit function): any CUDA device."""
    bias_activation_fusion: bool
    """Fused bias + GeLU / SwiGLU (megatron-core's jit functions): any CUDA device, for the models
    whose activation it computes exactly (:func:`fuses_bias_activation`)."""
    apply_rope_fusion: bool
    """Fused rotary embedding: transformer-engine's kernel."""
    gradient_accumulation_fusion: bool
    """Weight gradients written straight into the fp32 ``main_grad`` buffers by the GEMM (Megatron-LM's
    default): needs apex's fused_weight_gradient_mlp_cuda (megatron-core's own linear layers check it
    at construction); under Megatron-FSDP only with bf16 gradient reduction and untied embeddings
    (see :func:`choose_kernels`)."""
    cross_entropy_loss_fusion: bool
    """Fused vocabulary-parallel cross entropy (megatron-core's native implementation): any CUDA device."""

    def fusions(self) -> dict[str, bool]:
        """The fusion switches, under the names TransformerConfig gives them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.type in (bool, "bool") and f.name != "transformer_engine"}

    def describe(self) -> str:
        fused = [name for name, on in self.fusions().items() if on]
        return (f"{self.device}: transformer-engine {'yes' if self.transformer_engine else 'no'}, attention "
                f"{self.attention}, fusions: {', '.join(fused) if fused else 'none'}")


FSDP_FUSION_NEEDS_TE = ((0, 17), "2.10")
"""From megatron-core 0.17 on, Megatron-FSDP asserts transformer-engine >= 2.10 when
gradient-accumulation fusion is on, at wrap time (mcore_fsdp_adapter.py ~L112 at core_v0.17.0,
~L147-150 at core_v0.19.0; 0.16.1 has no such check): (the first release, the transformer-engine)."""


def fsdp_allows_fusion(megatron_core: tuple[int, int] | None, transformer_engine: str | None) -> bool:
    """Whether Megatron-FSDP accepts gradient-accumulation fusion with these releases
    (:data:`FSDP_FUSION_NEEDS_TE`); an unknown megatron-core (None) gets the strict rule. Pure."""
    since, te_min = FSDP_FUSION_NEEDS_TE
    if megatron_core is not None and megatron_core < since:
        return True
    return transformer_engine is not None and te_at_least(transformer_engine, te_min)


def choose_kernels(on_cuda: bool, transformer_engine: str | None, zero_stage: int, find_spec=None,
                   grad_reduce_in_bf16: bool = False, tied_embeddings: bool = True,
                   megatron_core: tuple[int, int] | None = None) -> KernelChoices:
    """``transformer_engine``: the version megatron-core would use (:func:`transformer_engine_version`),
    or None; ``megatron_core``: its (major, minor). Pure apart from ``find_spec``
    (``importlib.util.find_spec``: is a compiled extension installed)."""
    import importlib.util

    find_spec = find_spec or importlib.util.find_spec
    te = on_cuda and transformer_engine is not None

    def extension(name: str) -> bool:
        try:
            return find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return KernelChoices(
        device=Device.of(on_cuda),
        transformer_engine=te,
        attention="transformer-engine" if te else "sdpa",
        persist_layer_norm=te,
        masked_softmax_fusion=on_cuda and (te or extension("scaled_masked_softmax_cuda")),
        bias_dropout_fusion=on_cuda,
        bias_activation_fusion=on_cuda,
        apply_rope_fusion=te,
        # apex's extension whether or not transformer-engine is there: the GPT output layer is always
        # megatron-core's ColumnParallelLinear, which raises without it (tensor_parallel/layers.py ~L924).
        # Megatron-FSDP (stages 2-3): Megatron-LM keeps the fusion on and only warns (arguments.py ~L677),
        # but megatron-core's own linear layers then write the weight gradient with
        # torch.matmul(..., out=weight.main_grad) (layers.py ~L563), which needs main_grad in the
        # activations' dtype, and Megatron-FSDP's gradient hook ignores the zero_out_wgrad that makes
        # a tied embedding's two gradients add up under DDP (language_module.py ~L201,
        # megatron_fsdp.py ~L561-590): through the device shim, fp32 reduction raises in the first
        # backward, tied embeddings lose a gradient (another loss from the second step), and only
        # untied embeddings with bf16 reduction equal the unfused run; and from megatron-core 0.17
        # only with transformer-engine >= 2.10 (fsdp_allows_fusion).
        gradient_accumulation_fusion=on_cuda and extension("fused_weight_gradient_mlp_cuda")
        and (zero_stage < 2 or (grad_reduce_in_bf16 and not tied_embeddings
                                and fsdp_allows_fusion(megatron_core, transformer_engine))),
        cross_entropy_loss_fusion=on_cuda,
    )


SAME_NAMED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "normalization", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "hidden_dropout", "attention_dropout")
"""The ModelPreset fields TransformerConfig takes under the same name."""


def transformer_config(preset: ModelPreset, params_dtype: torch.dtype, kernels: KernelChoices, **overrides):
    from megatron.core.transformer import TransformerConfig

    same_named = {name: getattr(preset, name) for name in SAME_NAMED}
    return TransformerConfig(**same_named | kernels.fusions() | dict(
        layernorm_epsilon=preset.norm_epsilon,
        gated_linear_unit=preset.swiglu,
        activation_func=activation_function(preset, kernels.bias_activation_fusion),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=kernels.device == Device.CPU,
        bias_activation_fusion=kernels.bias_activation_fusion and fuses_bias_activation(preset),
    ) | overrides)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (transformers' ``gelu_new``, megatron-core's ``openai_gelu``), as torch computes it."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def fuses_bias_activation(preset: ModelPreset) -> bool:
    """Whether megatron-core's fused bias + activation computes this preset's activation.
    megatron/core/transformer/mlp.py (~L171-213) picks the kernel by ``activation_func``: SiLU with
    a gated unit -> ``bias_swiglu_impl`` (the same SwiGLU); ``F.gelu`` -> ``bias_gelu_impl``
    (fusions/fused_bias_gelu.py), which is the *tanh approximation* of GELU. So the fusion serves
    SwiGLU and tanh-GELU presets (with biases: bias_gelu asserts them), never the exact (erf) GELU
    of gpt2 / gpt_smoke, where it would train another function than the model's (Megatron-LM's
    --bias-gelu-fusion default does exactly that)."""
    return preset.swiglu or (preset.gelu_tanh and preset.add_bias_linear)


def activation_function(preset: ModelPreset, bias_activation_fusion: bool = False):
    """The MLP's activation; with the fusion for a tanh-GELU preset, ``F.gelu`` (the name megatron-core's
    MLP dispatches on to its tanh-approximated fused kernel)."""
    if preset.swiglu:
        return torch.nn.functional.silu
    if preset.gelu_tanh:
        return torch.nn.functional.gelu if bias_activation_fusion and fuses_bias_activation(preset) else gelu_tanh
    return torch.nn.functional.gelu


def layer_spec(preset: ModelPreset, kernels: KernelChoices):
    """transformer-engine's layer spec, or megatron-core's local spec with :class:`SdpaAttention`."""
    from megatron.core.models.gpt import gpt_layer_specs

    if kernels.transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=preset.qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=preset.qk_layernorm, normalization=preset.normalization)
    if kernels.attention == "sdpa":
        from megatron_ext.training.sdpa_attention import SdpaAttention

        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def transformer_engine_version() -> str | None:
    """The version of the transformer-engine megatron-core would use, or None where it would not
    (:func:`transformer_engine_available`)."""
    if not transformer_engine_available():
        return None
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "0"))


def transformer_engine_available() -> bool:
    """megatron-core's own answer, ``HAVE_TE`` (megatron/core/extensions/transformer_engine.py
    ~L61-77 at core_v0.16.1 and core_v0.19.0: ``transformer_engine`` and its PyTorch extension,
    ``transformer_engine.pytorch``, import). A pip-installed transformer-engine whose extension does
    not load for this torch passes a top-level import but not this: megatron-core then has no TE
    layers, and this program's TE layer spec would raise at build. The preflight names such an
    install (``orchestration/node/preflight.py``, ``transformer_engine_problem``)."""
    try:
        from megatron.core.extensions import transformer_engine as te_extension
    except Exception:  # a broken install raising anything while megatron-core imports it
        return False
    return bool(te_extension.HAVE_TE)


def installed_megatron_core() -> tuple[int, int]:
    """The installed megatron-core's (major, minor)."""
    from megatron.core import package_info

    return parse_version(package_info.__version__)


CPU_KERNELS = choose_kernels(on_cuda=False, transformer_engine=None, zero_stage=0)


def warm_up_fusions(preset: ModelPreset, kernels: KernelChoices, seq_length: int, micro_batch_size: int,
                    padded_vocab: int, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Compile megatron-core's jit-fused functions before the first step, as Megatron-LM's
    ``_warmup_jit_function`` does at start (initialize.py ~L463-520 at core_v0.16.1, ~L497-553 at
    core_v0.19.0; its jit_fuser is torch.compile since torch 2.2), so that the first iteration's
    time is a step's and not a compile's. Unlike Megatron-LM it calls them as this model's layers
    do (mlp.py ~L195-208: ``bias_swiglu_impl`` or ``bias_gelu_impl``, with the preset's bias or
    without; transformer_layer.py: ``bias_dropout_add_fused_train`` at the preset's dropout;
    language_module.py ~L140-165: ``fused_vocab_parallel_cross_entropy`` on the padded
    vocabulary's logits), with a training micro-batch's shapes and dtype, forward and backward
    (Megatron-LM warms the forward only, ``bias_swiglu`` with a bias where Qwen3 has none, and not
    the cross entropy: on a fresh H200 its first iteration still took 37 s against 1.4-2.6 s once
    compiled, tests/gpu). The random state is left as it was. Returns the names of what it ran;
    none without the fusions (the CPU)."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

    warmed = []
    s, b, h, f = seq_length, micro_batch_size, preset.hidden_size, preset.ffn_hidden_size

    def tensor(*shape):
        return torch.rand(*shape, dtype=dtype, device=device, requires_grad=True)

    with torch.random.fork_rng(devices=[device] if device.type == Device.CUDA else []):
        if kernels.bias_activation_fusion and fuses_bias_activation(preset):
            if preset.swiglu:
                from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

                x, bias = tensor(s, b, 2 * f), tensor(2 * f) if preset.add_bias_linear else None
                bias_swiglu_impl(x, bias).sum().backward()
                warmed.append("bias_swiglu" if bias is not None else "swiglu")
            else:
                from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl

                bias_gelu_impl(tensor(s, b, f), tensor(f)).sum().backward()
                warmed.append("bias_gelu")
        if kernels.bias_dropout_fusion:
            bias = tensor(h) if preset.add_bias_linear else None
            bias_dropout_add_fused_train((tensor(s, b, h), bias), tensor(s, b, h), preset.hidden_dropout).sum().backward()
            warmed.append("bias_dropout_add")
        if kernels.cross_entropy_loss_fusion:
            from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

            labels = torch.randint(0, padded_vocab, (s, b), device=device)
            fused_vocab_parallel_cross_entropy(tensor(s, b, padded_vocab), labels,
                                               parallel_state.get_tensor_model_parallel_group()).sum().backward()
            warmed.append("cross_entropy")
    return warmed


def build_gpt_model(preset: ModelPreset, vocab_size: int, seq_length: int, params_dtype: torch.dtype = torch.float32,
                    kernels: KernelChoices = CPU_KERNELS, **config_overrides):
    """A megatron-core GPTModel for ``preset`` with the padded ``vocab_size`` already applied."""
    from megatron.core.models.gpt import GPTModel

    ensure_model_parallel()
    config = transformer_config(preset, params_dtype, kernels, **config_overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(preset, kernels),
            vocab_size=vocab_size,
            max_sequence_length=max(seq_length, preset.max_position_embeddings),
            share_embeddings_and_output_weights=preset.tie_embeddings,
            position_embedding_type=preset.position_embedding_type,
            rotary_base=preset.rotary_base,
            rope_scaling=preset.rope_scaling,
            rope_scaling_factor=preset.rope_scaling_factor,
        )


def count_parameters(preset: ModelPreset, vocab_size: int | None = None) -> ParameterCount:
    """Exact parameter count of the megatron-core model, built on the meta device (no memory)."""
    vocab = padded_vocab_size(vocab_size or model_vocab_size(preset, None), preset.make_vocab_size_divisible_by)
    with torch.device("meta"):
        model = build_gpt_model(preset, vocab, preset.max_position_embeddings, perform_initialization=False)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embedding.word_embeddings.weight.numel()
    if not preset.tie_embeddings:
        embedding += model.output_layer.weight.numel()
    return ParameterCount(total=total, embedding=embedding, padded_vocab=vocab)
