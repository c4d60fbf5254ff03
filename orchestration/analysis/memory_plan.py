"""Memory and traffic per GPU for each ZeRO stage, on paper, before anything runs.

    bash training_scripts/plan_memory.sh qwen3_1p7b qwen3_1p7b_smoke                 # NNODES x NPROC_PER_NODE GPUs
    NNODES=4 NPROC_PER_NODE=8 python -m orchestration plan-memory qwen3_1p7b --device h100
    python -m orchestration plan-memory gpt2 gpt2_smoke --gpus 1024 --bus-bandwidth-gbs 331 --json

Per stage and GPU: parameters, gradients and optimizer state (model states), activations (an
estimate, with and without full recomputation), their total against the device, the lowest stage
that fits with a stated headroom, and the data-parallel traffic per step with its time at a given
bus bandwidth. The figures, with the sources they follow:

- Model states, bytes per parameter (Psi parameters, d data-parallel ranks). GPUs (bf16
  parameters, fp32 gradients and fp32 main parameters, as Megatron keeps them): stage 0 = 18 and
  stage 1 = 6 + 12/d (Megatron's table for the plain and the distributed optimizer), stage 2 =
  2 + 16/d and stage 3 = 18/d (Megatron-FSDP's fp32 main-gradient shard, 4/d, and K = 12 for the
  fp32 main parameters and Adam's moments; with ``training.grad_reduce_in_bf16`` the shard is bf16,
  2/d: the ZeRO paper's 2 + 14/d and 16/d). CPU (fp32 AdamW, torch): 16, 8 + 8/d, 16/d (peak
  4 + 12/d while FSDP2 holds every gathered parameter), 16/d.
- Activations: what ``torch.cuda.max_memory_allocated`` (the GPU runs' peak) adds to the model
  states, at its moment, the start of the backward. Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (per layer ``s*b*h*(34 + 5*a*s/h)`` bytes, 16-bit),
  re-derived tensor by tensor from what megatron-core and torch keep for this program's layer
  (:func:`layer_saved_tensors`: local spec, SdpaAttention's flash attention with no s x s scores,
  grouped-query attention, QK-norm, rotary tables, SwiGLU or GELU, dropout masks only where
  dropout is on, the fp32 norm statistics); plus the final norm's and the output layer's inputs;
  plus the loss's peak, 10 bytes per logit (token x vocabulary entry) with megatron-core's fused
  cross entropy (:data:`LOSS_BYTES_PER_LOGIT`: fp32 softmax, an fp32 copy in its backward, the
  bf16 gradient; 24.9 of Qwen3-1.7B's 60.1 GB at sequence 4096 and micro batch 4); plus the
  cuBLAS workspaces, 66 MiB. That configuration on one H200 (DP=1, where every stage holds 18
  bytes per parameter: stages 2-3 run as no_shard): 84.77 GiB planned, 84.78 GiB measured at
  every stage (tests/data/gpu_peak_memory.json). With full recomputation each layer keeps only its
  input, and the peak is the loss's or one layer rebuilt. Not counted:
  the layers' own backward buffers (flash attention's fp32 dQ accumulator, the MLP's gradients:
  after the logits are freed, smaller than the loss's peak unless the vocabulary is small against
  the layer), the optimizer step's (torch's foreach AdamW allocates sqrt(v), 4 bytes per parameter
  it updates, once the activations are freed), Megatron-FSDP's gather and reduce-scatter buffers
  (stages 2-3 at d > 1), and what the allocator does not count: the CUDA context, NCCL's buffers,
  fragmentation (reserved above allocated). The headroom is for those.
- Data-parallel traffic per GPU per optimizer step of a micro-batches per GPU (:func:`dp_traffic`),
  each collective with the ring factor r = (d - 1)/d, so dividing by the NCCL *bus* bandwidth
  gives its time; g = the gradient reduction's bytes (4, or 2 with ``training.grad_reduce_in_bf16``),
  p = the parameters' (2), Psi_o = the parameters outside the transformer layers:

      stage 0  2 r Psi g                         gradients all-reduced once (no_sync on the other micro-batches)
      stage 1  r Psi (g + p)                     gradients reduce-scattered once, parameters gathered once
      stage 2  r Psi (a g + p)                   Megatron-FSDP: gradients reduce-scattered at every
                                                 micro-batch, parameters gathered once after the update
      stage 3  r (a Psi g + (2a (Psi - Psi_o)    + every layer gathered before each forward and each
               + Psi_o) p)                       backward, the rest once a step

  benchmarks/dp_traffic.py counts what megatron-core's objects hand the collectives (gloo, the
  device shim) and finds these within 0.2% (bucket padding). The CPU path (torch, fp32): 2 Psi,
  3 Psi (stage 1 broadcasts the updated parameters), (a + 1) Psi and (2a + 1) Psi (FSDP2 gathers
  before every forward, stage 3 also every backward, and reduce-scatters once), times 4 r bytes.
- MFU estimate per stage (:func:`estimate_mfu`): always against the dense BF16 peak (with
  ``training.fp8`` too, so runs compare). The step's model FLOPs (Megatron's formula,
  megatron_ext/run_spec/flops.py) at ``assumed_mfu`` (the kernels' share of the peak while they
  run) give the compute time: at the BF16 peak, or with FP8 the linear layers' share
  (:func:`fp8_flops_share`, ~72% for Qwen3-1.7B at 4096) at the FP8 peak and core attention and
  the logits at BF16's. Added to it: each part of the traffic not hidden behind the compute it
  overlaps (forward = 1/3, backward = 2/3 of the compute, split evenly over the micro-batches):
  stages 0-1's reduction behind the last micro-batch's backward (the others run under no_sync),
  stage 1's gather behind the first forward, stages 2-3's reduce-scatters behind every backward,
  stage 3's gathers behind every forward and backward, stage 2's one gather after the update
  behind nothing; and the optimizer step, which streams 26 bytes per parameter this GPU updates
  (fp32 main parameter, both moments and gradient read, the three fp32 values written, the bf16
  parameter written) at the device's memory bandwidth. Not modelled: data loading, kernel
  launches, stragglers, and the gap between an NCCL ring's bus bandwidth and what overlapped
  collectives get.

Pure: takes presets and numbers, returns a :class:`MemoryPlan` (its text is
:func:`orchestration.analysis.tables.format_memory_plan`). Parameter counts are computed from the
preset's shapes (no torch on the launcher side); tests check them against the megatron-core model
built on the meta device. :func:`plan_memory_request` turns the command's options (and
``GPU_MEMORY_GB``, as the launcher read it) into a plan, reading the model and data YAML.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Literal

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.flops import bf16_share_under_fp8, flops_per_token
from megatron_ext.run_spec.model_size import count_model_parameters
from megatron_ext.run_spec.params import (ModelPreset, RunOverrides, RunParams, batch_geometry, check_seq_length, load_model,
                                          load_run_params)

Precision = Literal["bf16", "fp32"]
"""bf16: GPUs (Megatron's mixed precision); fp32: the CPU path (torch, gloo)."""

GB = 1e9
DEFAULT_BUS_BANDWIDTH_GBS = 331.0
"""NCCL all-reduce bus bandwidth measured on a 4 x 8 H100 cluster (GB/s)."""
DEFAULT_HEADROOM = 0.10
"""Fraction of device memory kept free for what the plan (the caching allocator's peak allocation)
leaves out: the CUDA context, NCCL's buffers, the allocator's fragmentation (reserved above
allocated), Megatron-FSDP's communication buffers and the transients the module docstring names."""
DEFAULT_ASSUMED_MFU = 0.40
"""Model FLOPs utilisation assumed for the paper compute time of a step."""
DEFAULT_DEVICE = "h200"


@dataclass(frozen=True)
class DeviceModel:
    name: str
    memory_bytes: float | None
    """Memory per device as sold (decimal GB); None = not checked (CPU)."""
    peak_tflops: float | None
    """Dense BF16 peak (TFLOP/s); None = unknown."""
    fp8_peak_tflops: float | None = None
    """Dense FP8 peak (TFLOP/s); None = no FP8."""
    memory_bandwidth_gbs: float | None = None
    """Memory bandwidth as sold (GB/s); None = unknown."""


DEVICES: dict[str, DeviceModel] = {  # NVIDIA's datasheets (SXM)
    "h200": DeviceModel("H200 141 GB", 141 * GB, 989.0, 1979.0, 4800.0),
    "h100": DeviceModel("H100 80 GB", 80 * GB, 989.0, 1979.0, 3350.0),
    "cpu": DeviceModel("CPU", None, None),
}
OPTIMIZER_BYTES_PER_PARAMETER = 26
"""What Adam's step streams per parameter it updates (see the module docstring)."""


@dataclass(frozen=True, kw_only=True)
class MfuEstimate:
    """One stage's step on paper (seconds per optimizer step) and the MFU it gives."""

    stage: int
    compute_s: float
    exposed_traffic_s: float
    optimizer_s: float
    step_s: float
    mfu: float


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes per parameter on one GPU (exact fractions)."""

    params: Fraction
    grads: Fraction
    optimizer: Fraction
    peak_extra: Fraction = Fraction(0)
    """Held on top during forward/backward (CPU stage 2: every gathered parameter)."""

    @property
    def total(self) -> Fraction:
        return self.params + self.grads + self.optimizer


def state_bytes_per_parameter(stage: int, d: int, precision: Precision, grad_bytes: int = 4) -> StateBytes:
    """The table in the module docstring, for ``d`` data-parallel ranks; ``grad_bytes``: the GPU
    gradient shard's element at stages 2-3 (Megatron-FSDP's main gradients: 4 with fp32 reduction,
    2 with ``training.grad_reduce_in_bf16``)."""
    s = Fraction(1, d)
    if precision == "bf16":
        g = grad_bytes * s
        table = {0: (2, 4, 12), 1: (2, 4, 12 * s), 2: (2, g, 12 * s), 3: (2 * s, g, 12 * s)}
        return StateBytes(*(Fraction(x) for x in table[stage]))
    table = {0: (4, 4, 8), 1: (4, 4, 8 * s), 2: (4 * s, 4 * s, 8 * s), 3: (4 * s, 4 * s, 8 * s)}
    extra = 4 - 4 * s if stage == 2 else Fraction(0)
    return StateBytes(*(Fraction(x) for x in table[stage]), peak_extra=extra)


def _bytes(psi: int, per_param: Fraction) -> int:
    return math.ceil(psi * per_param)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a transformer layer keeps for its backward, per token of the micro-batch."""

    what: str
    """The tensor, and (in brackets) who saves it."""
    values: int
    """Values per token."""
    value_bytes: int | None = None
    """Bytes per value; None = the activations' (2 in bf16, 4 in fp32)."""


def layer_saved_tensors(preset: ModelPreset) -> tuple[SavedTensor, ...]:
    """What one layer of this program's GPU model keeps from its forward until its backward
    (megatron-core's local layer spec with :class:`~megatron_ext.training.sdpa_attention.SdpaAttention`,
    no transformer-engine; TP = 1), read from megatron-core (lines at core_v0.16.1 / core_v0.19.0):

    - Norms are ``torch.nn.RMSNorm`` / ``LayerNorm`` (torch_norm.py ~L45 / ~L63) in bf16 after
      Float16Module: torch's fused CUDA kernel saves its input and an fp32 rstd per row (LayerNorm:
      mean and rstd). The layer input is thus kept by the input norm, the attention's residual sum
      by the pre-MLP norm (transformer_layer.py ~L584, ~L679 / ~L626, ~L759).
    - Every linear layer saves its input (tensor_parallel/layers.py ~L465 / ~L548,
      ``ctx.save_for_backward(input, weight)``): the two norm outputs, the attention output, the
      MLP's inner activation.
    - The QKV output: ``torch.split`` gives views (attention.py ~L1460 / ~L1903); the key norm
      and SDPA (value) keep views of it, so all of it (q + 2k) stays. With grouped queries the
      ``query.reshape`` (~L1463 / ~L1906) cannot be a view and copies q values, which the query
      norm saves (~L1478 / ~L1920).
    - Rotary embedding, unfused (rope_utils.py ~L122-126 / ~L133-137): new query and key (q + k,
      which SDPA saves; the norm outputs before it are freed), and per call a bf16 cos and sin table
      of s x head_dim that the multiplications save (:func:`rotary_table_bytes`).
    - SDPA: flash attention (GQA natively) saves query, key, value, its output (q) and an fp32
      log-sum-exp per head. Its output is allocated like the query (``empty_like``, which keeps the
      [s, b, heads, d] order of the rotary output or of the QKV output's views), so SdpaAttention's
      final ``permute``/``reshape`` is a view, which the output projection saves: no copy.
    - The bias-dropout-adds (fused_bias_dropout.py, torch.compile) save nothing at dropout 0 and
      a 1-byte mask per element otherwise; SwiGLU (fused_bias_swiglu.py ~L166) saves its input
      (2F) and returns F, fc2's input; GELU saves its input (F) and returns F.
    """
    h, F = preset.hidden_size, preset.ffn_hidden_size
    heads, groups = preset.num_attention_heads, preset.query_groups
    q, k = heads * preset.head_dim, groups * preset.head_dim
    rotary = preset.position_embedding_type == "rope"
    new_qk = rotary or preset.qk_layernorm  # SDPA gets new query and key, not views of the QKV output
    stats = 1 if preset.normalization == "RMSNorm" else 2  # fp32 values per normalised row
    tensors = [SavedTensor("layer input (input norm)", h), SavedTensor("input norm output (QKV projection)", h),
               SavedTensor("QKV projection output (key norm and SDPA: views)", q + 2 * k)]
    if preset.qk_layernorm and groups < heads:
        tensors.append(SavedTensor("query regrouped, a copy (query norm)", q))
    if new_qk:
        tensors.append(SavedTensor("query and key after norm/rotary (SDPA)", q + k))
    tensors.append(SavedTensor("attention output (SDPA; output projection)", q))
    tensors += [SavedTensor("attention residual sum (pre-MLP norm)", h), SavedTensor("pre-MLP norm output (fc1)", h)]
    if preset.swiglu:
        tensors += [SavedTensor("fc1 output (SwiGLU)", 2 * F), SavedTensor("SwiGLU output (fc2)", F)]
    else:
        tensors += [SavedTensor("GELU input (GELU)", F), SavedTensor("GELU output (fc2)", F)]
    if preset.hidden_dropout > 0:
        tensors.append(SavedTensor("dropout masks (the two bias-dropout-adds)", 2 * h, value_bytes=1))
    fp32 = 2 * stats + (stats * (heads + groups) if preset.qk_layernorm else 0) + heads
    tensors.append(SavedTensor("norm statistics and the attention's log-sum-exp (norms, SDPA)", fp32, value_bytes=4))
    return tuple(tensors)


def rotary_table_bytes(preset: ModelPreset, seq_length: int, value_bytes: int) -> int:
    """One layer's rotary tables: the cos and the sin of s x head_dim (rope_utils.py ~L122-125 /
    ~L133-136, computed and cast per call) for the query's call and the key's, each saved by its
    multiplication; none with learned positions. Independent of the micro batch."""
    return 4 * seq_length * preset.head_dim * value_bytes if preset.position_embedding_type == "rope" else 0


LOSS_BYTES_PER_LOGIT: dict[Precision, int] = {"bf16": 10, "fp32": 4}
"""The loss's peak per logit (token x vocabulary entry), at the start of the backward: the bf16
logits are freed by then (nothing saves them), the output layer's gradient is being made. GPUs:
megatron-core's fused vocab-parallel cross entropy (the 'cross entropy' fusion, language_module.py
~L165 / ~L192; fusions/fused_cross_entropy.py, the same at both releases, its parts compiled by
torch.compile) keeps the softmax in fp32 for the backward: the ``.float()`` copy of the logits
(cross_entropy.py ~L28 / ~L25) turned into exp and softmax in place and saved (fused_cross_entropy.py
~L119), 4. Its backward (~L64-84) subtracts 1 at the targets with an indexed ``-=`` on that saved
softmax (cross_entropy.py ~L114 / ~L111), which the compiled graph does on a fresh fp32 copy, 4
(torch 2.13's inductor allocates it, read from its generated code on CPU; the H200's 84.78 GiB
includes it: a torch that did it in place would make this 6); and it returns the logits' gradient
in bf16 (~L82), 2. The forward holds less: the bf16 logits and the fp32 copy, 6. CPU (fp32, the
unfused cross entropy, eager): every step works in place on the fp32 logits, 4."""

CUBLAS_WORKSPACE_BYTES = 2 * (32 + 1) * 2**20
"""cuBLAS workspaces, counted by the caching allocator (torch/aten CublasHandlePool.cpp,
``getNewWorkspace`` allocates through it): 32 MiB per handle and stream on Hopper (the sm90 default of
``CUBLAS_WORKSPACE_CONFIG``) plus cuBLASLt's 1 MiB, for the forward's thread and the autograd
engine's device thread (a handle each)."""


@dataclass(frozen=True, kw_only=True)
class ActivationBytes:
    """The plan's activations for one micro-batch (bytes): what ``torch.cuda.max_memory_allocated``
    adds to the model states at the peak, the start of the backward."""

    per_layer: int
    """One layer's saved tensors (:func:`layer_saved_tensors`) and rotary tables."""
    outside_layers: int
    """Saved outside the layers: the final norm's input and statistics, the output layer's input,
    the embedding's dropout mask."""
    loss: int
    """The loss's peak (:data:`LOSS_BYTES_PER_LOGIT`)."""
    workspace: int
    """cuBLAS workspaces on GPUs (:data:`CUBLAS_WORKSPACE_BYTES`)."""
    full: int
    """Every layer's saved tensors, the rest above, at the peak."""
    recompute: int
    """Full recomputation: every layer's input plus the larger of the loss's peak and one layer rebuilt."""


def estimate_activation_bytes(preset: ModelPreset, seq_length: int, micro_batch: int, padded_vocab: int,
                              value_bytes: int, vocab: int | None = None) -> ActivationBytes:
    """Activations at the peak for one micro-batch; ``value_bytes`` = 2 for bf16 (the GPU), 4 for
    fp32 (the CPU); ``vocab``: the vocabulary the loss runs over (the real one: the program cuts the
    padded logits, hf_weights.py ``restrict_logits``; default ``padded_vocab``). The peak is at the
    start of the backward: every layer's saved tensors, the final norm's and the output layer's
    inputs, the loss's fp32 softmax, its fp32 copy and the bf16 gradient of the logits (gpt_model.py
    ~L685-714 / ~L762-794 and :data:`LOSS_BYTES_PER_LOGIT`), and the cuBLAS workspaces. Layer
    tensors are the GPU kernels' (:func:`layer_saved_tensors`); on the CPU torch's composite RMSNorm
    and SDPA keep others (no device size is checked there)."""
    tokens = seq_length * micro_batch
    per_token = sum(t.values * (t.value_bytes or value_bytes) for t in layer_saved_tensors(preset))
    per_layer = tokens * per_token + rotary_table_bytes(preset, seq_length, value_bytes)
    h, stats = preset.hidden_size, 1 if preset.normalization == "RMSNorm" else 2
    outside = tokens * (2 * h * value_bytes + 4 * stats + (h if preset.hidden_dropout > 0 else 0))
    loss = tokens * (vocab or padded_vocab) * LOSS_BYTES_PER_LOGIT["bf16" if value_bytes == 2 else "fp32"]
    workspace = CUBLAS_WORKSPACE_BYTES if value_bytes == 2 else 0
    full = preset.num_layers * per_layer + outside + loss + workspace
    recompute = preset.num_layers * tokens * h * value_bytes + outside + max(loss, per_layer) + workspace
    return ActivationBytes(per_layer=per_layer, outside_layers=outside, loss=loss, workspace=workspace, full=full,
                           recompute=recompute)


@dataclass(frozen=True)
class StepTraffic:
    """One stage's data-parallel bytes per GPU per optimizer step, by the compute each can hide behind."""

    first_forward: int
    """During the first micro-batch's forward (stage 1's parameter gather)."""
    last_backward: int
    """During the last micro-batch's backward (stages 0-1's gradient reduction)."""
    forwards: int
    """During every micro-batch's forward (stage 3's parameter gathers)."""
    backwards: int
    """During every micro-batch's backward (stages 2-3's reduce-scatters, stage 3's gathers)."""
    after_step: int
    """After the update, behind no compute (stage 2's parameter gather)."""

    @property
    def total(self) -> int:
        return self.first_forward + self.last_backward + self.forwards + self.backwards + self.after_step


def dp_traffic(stage: int, psi: int, d: int, grad_bytes: int, param_bytes: int, micro_batches: int = 1,
               outside_layers: int = 0, precision: Precision = "bf16") -> StepTraffic:
    """What each GPU sends (and receives) over data-parallel ranks in one optimizer step of
    ``micro_batches`` (a) micro-batches per rank: the module docstring's table (GPUs) and its CPU path
    (FSDP2's one reduce-scatter at the last micro-batch), with g = ``grad_bytes``, p = ``param_bytes``,
    Psi_o = ``outside_layers``; each part by the compute it can hide behind."""
    if micro_batches < 1:
        raise UserError(f"micro_batches={micro_batches} must be >= 1 (micro-batches per rank per optimizer step)")
    ring = Fraction(d - 1, d)
    a = micro_batches

    def volume(elements: int, nbytes: int) -> int:
        return math.ceil(elements * nbytes * ring)

    grads, params = volume(psi, grad_bytes), volume(psi, param_bytes)
    layers, outside = volume(psi - outside_layers, param_bytes), volume(outside_layers, param_bytes)
    if precision == "fp32":
        return {0: StepTraffic(0, 2 * grads, 0, 0, 0), 1: StepTraffic(0, 2 * grads, 0, 0, params),
                2: StepTraffic(0, grads, a * params, 0, 0), 3: StepTraffic(0, grads, a * params, a * params, 0)}[stage]
    return {0: StepTraffic(0, 2 * grads, 0, 0, 0), 1: StepTraffic(params, grads, 0, 0, 0),
            2: StepTraffic(0, 0, 0, a * grads, params),
            3: StepTraffic(0, 0, a * layers + outside, a * (grads + layers), 0)}[stage]


def dp_traffic_bytes(stage: int, psi: int, d: int, grad_bytes: int, param_bytes: int, micro_batches: int = 1,
                     outside_layers: int = 0, precision: Precision = "bf16") -> int:
    """:func:`dp_traffic`'s total: bytes per GPU per optimizer step."""
    return dp_traffic(stage, psi, d, grad_bytes, param_bytes, micro_batches, outside_layers, precision).total


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    stage: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    states_bytes: int
    """Model states between steps."""
    states_peak_bytes: int
    """Model states at their peak (forward/backward)."""
    activation_bytes: int
    activation_recompute_bytes: int
    total_bytes: int
    """Peak model states + activations."""
    total_recompute_bytes: int
    fits: bool | None
    """Within the device's memory less the headroom; None without a device size."""
    fits_recompute: bool | None
    traffic_bytes: int
    """Data-parallel traffic per GPU per optimizer step."""
    traffic_s: float
    """Its time at the bus bandwidth."""


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    model: str
    data_set: str | None
    parameters: int
    embedding_parameters: int
    padded_vocab: int
    num_gpus: int
    nnodes: int
    nproc_per_node: int
    precision: Precision
    device: str
    device_bytes: float | None
    headroom: float
    seq_length: int
    micro_batch_size: int
    global_batch_size: int | None
    gradient_accumulation_steps: int
    """Micro-batches per GPU per optimizer step, what the traffic is for: the data set's (or the
    global batch over micro batch x GPUs); 1 when neither is given."""
    grad_reduce_in_bf16: bool
    bus_bandwidth_gbs: float
    stages: tuple[StagePlan, ...]
    lowest_fitting_stage: int | None
    lowest_fitting_stage_recompute: int | None
    compute_s: float | None
    """Paper compute time of one optimizer step at ``assumed_mfu`` (needs the global batch and the device peak)."""
    assumed_mfu: float
    peak_tflops: float | None = None
    """The dense BF16 peak: what MFU is against, with FP8 too (comparable across runs)."""
    fp8: bool = False
    fp8_peak_tflops: float | None = None
    """With ``fp8``: the dense FP8 peak the compute time assumes for the linear layers' FLOPs."""
    fp8_flops_share: float | None = None
    """With ``fp8``: the linear layers' share of the model FLOPs (:func:`fp8_flops_share`)."""
    parameters_outside_layers: int = 0
    """Outside the transformer layers (:func:`parameters_outside_layers`): stage 3 gathers them once a step."""
    mfu_estimates: tuple[MfuEstimate, ...] = ()
    """Per stage, with the global batch, the device's peak and its memory bandwidth (:func:`estimate_mfu`)."""

    @property
    def usable_bytes(self) -> float | None:
        return self.device_bytes * (1 - self.headroom) if self.device_bytes else None

    def stage(self, stage: int) -> StagePlan:
        return next(s for s in self.stages if s.stage == stage)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def fp8_flops_share(preset: ModelPreset, seq_length: int, padded_vocab: int) -> float:
    """The share of the step's model FLOPs in the linear layers (QKV, projection, MLP), what
    Transformer Engine runs in FP8: the rest of :func:`bf16_share_under_fp8` (core attention and
    the logits stay BF16)."""
    return 1.0 - bf16_share_under_fp8(preset, seq_length, padded_vocab)


def compute_seconds(flops_per_step: float, d: int, peak_tflops: float, assumed_mfu: float,
                    fp8_peak_tflops: float | None = None, fp8_share: float = 0.0) -> float:
    """A step's compute per GPU: its FLOPs at ``assumed_mfu`` of the dense BF16 peak, or, with an
    FP8 peak, ``fp8_share`` of them at that peak and the rest at BF16's."""
    share = fp8_share if fp8_peak_tflops else 0.0
    per_peak = (1 - share) / peak_tflops + (share / fp8_peak_tflops if share else 0.0)
    return flops_per_step * per_peak / (d * 1e12 * assumed_mfu)


def estimate_mfu(stage: int, psi: int, d: int, flops_per_step: float, peak_tflops: float, assumed_mfu: float,
                 grad_bytes: int, memory_bandwidth_gbs: float, bus_bandwidth_gbs: float, *, micro_batches: int = 1,
                 param_bytes: int = 2, outside_layers: int = 0, fp8_peak_tflops: float | None = None,
                 fp8_share: float = 0.0) -> MfuEstimate:
    """One stage's step time and MFU on paper (the module docstring states the assumptions). MFU is
    against the dense BF16 peak, ``peak_tflops``, with FP8 too; the traffic is :func:`dp_traffic`'s,
    each part set against the compute it overlaps."""
    compute = compute_seconds(flops_per_step, d, peak_tflops, assumed_mfu, fp8_peak_tflops, fp8_share)
    forward, backward = compute / 3, 2 * compute / 3
    t = dp_traffic(stage, psi, d, grad_bytes, param_bytes, micro_batches, outside_layers)
    a, bus = micro_batches, bus_bandwidth_gbs * GB
    behind = ((t.first_forward, forward / a), (t.last_backward, backward / a), (t.forwards, forward),
              (t.backwards, backward), (t.after_step, 0.0))
    exposed = sum(max(0.0, volume / bus - window) for volume, window in behind)
    updated = psi if stage == 0 else psi / d
    optimizer = updated * OPTIMIZER_BYTES_PER_PARAMETER / (memory_bandwidth_gbs * GB)
    step = compute + exposed + optimizer
    ideal = flops_per_step / (d * peak_tflops * 1e12)
    return MfuEstimate(stage=stage, compute_s=compute, exposed_traffic_s=exposed, optimizer_s=optimizer, step_s=step,
                       mfu=ideal / step)


def parameters_outside_layers(preset: ModelPreset, vocab_size: int | None) -> int:
    """What sits outside the transformer layers (embedding, learned positions, final norm, an
    untied output layer): Megatron-FSDP's parameters outside its units (TransformerLayer) at
    stage 3, gathered once a step and kept."""
    return count_model_parameters(replace(preset, num_layers=0), vocab_size).total


def plan_memory(preset: ModelPreset, *, vocab_size: int | None, nnodes: int, nproc_per_node: int, seq_length: int,
                micro_batch_size: int, precision: Precision = "bf16", device: DeviceModel = DEVICES[DEFAULT_DEVICE],
                device_bytes: float | None = None, headroom: float = DEFAULT_HEADROOM,
                grad_reduce_in_bf16: bool = False, bus_bandwidth_gbs: float = DEFAULT_BUS_BANDWIDTH_GBS,
                global_batch_size: int | None = None, gradient_accumulation_steps: int | None = None,
                assumed_mfu: float = DEFAULT_ASSUMED_MFU, data_set: str | None = None,
                stages: tuple[int, ...] = (0, 1, 2, 3), fp8: bool = False) -> MemoryPlan:
    """Every stage's plan for ``nnodes x nproc_per_node`` data-parallel GPUs (TP = PP = 1);
    ``gradient_accumulation_steps``: micro-batches per GPU per step (default: the global batch's, else 1)."""
    if not 0 <= headroom < 1:
        raise UserError(f"headroom={headroom} must be in [0, 1); e.g. 0.1 keeps 10% of the device free")
    if bus_bandwidth_gbs <= 0:
        raise UserError(f"bus bandwidth {bus_bandwidth_gbs} GB/s must be > 0; e.g. {DEFAULT_BUS_BANDWIDTH_GBS}")
    count = count_model_parameters(preset, vocab_size)
    psi, d = count.total, nnodes * nproc_per_node
    accumulation = gradient_accumulation_steps or _accumulation_steps(global_batch_size, micro_batch_size, d)
    outside = parameters_outside_layers(preset, vocab_size)
    value_bytes = 2 if precision == "bf16" else 4
    acts = estimate_activation_bytes(preset, seq_length, micro_batch_size, count.padded_vocab, value_bytes,
                                     vocab=vocab_size or preset.vocab_size)
    memory = device_bytes if device_bytes is not None else device.memory_bytes
    usable = memory * (1 - headroom) if memory else None
    grad_bytes = 2 if (precision == "bf16" and grad_reduce_in_bf16) else 4
    param_bytes = value_bytes
    plans = []
    for stage in stages:
        per = state_bytes_per_parameter(stage, d, precision, grad_bytes)
        states, peak = _bytes(psi, per.total), _bytes(psi, per.total + per.peak_extra)
        traffic = dp_traffic_bytes(stage, psi, d, grad_bytes, param_bytes, accumulation, outside, precision)
        total, total_rc = peak + acts.full, peak + acts.recompute
        plans.append(StagePlan(
            stage=stage, params_bytes=_bytes(psi, per.params), grads_bytes=_bytes(psi, per.grads),
            optimizer_bytes=_bytes(psi, per.optimizer), states_bytes=states, states_peak_bytes=peak,
            activation_bytes=acts.full, activation_recompute_bytes=acts.recompute, total_bytes=total,
            total_recompute_bytes=total_rc, fits=None if usable is None else total <= usable,
            fits_recompute=None if usable is None else total_rc <= usable,
            traffic_bytes=traffic, traffic_s=traffic / (bus_bandwidth_gbs * GB),
        ))
    compute_s, estimates = None, ()
    peak_tflops = device.peak_tflops
    fp8_peak = device.fp8_peak_tflops if fp8 else None
    share = fp8_flops_share(preset, seq_length, count.padded_vocab) if fp8_peak else None
    if global_batch_size and peak_tflops:
        flops = flops_per_token(preset, seq_length, count.padded_vocab) * global_batch_size * seq_length
        compute_s = compute_seconds(flops, d, peak_tflops, assumed_mfu, fp8_peak, share or 0.0)
        if device.memory_bandwidth_gbs:
            estimates = tuple(estimate_mfu(p.stage, psi, d, flops, peak_tflops, assumed_mfu, grad_bytes,
                                           device.memory_bandwidth_gbs, bus_bandwidth_gbs, micro_batches=accumulation,
                                           param_bytes=param_bytes, outside_layers=outside, fp8_peak_tflops=fp8_peak,
                                           fp8_share=share or 0.0) for p in plans)
    return MemoryPlan(
        model=preset.name, data_set=data_set, parameters=psi, embedding_parameters=count.embedding,
        padded_vocab=count.padded_vocab, num_gpus=d, nnodes=nnodes, nproc_per_node=nproc_per_node,
        precision=precision, device=device.name if device_bytes is None else f"{device_bytes / GB:g} GB device",
        device_bytes=memory, headroom=headroom, seq_length=seq_length, micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size, gradient_accumulation_steps=accumulation,
        grad_reduce_in_bf16=grad_reduce_in_bf16,
        bus_bandwidth_gbs=bus_bandwidth_gbs, stages=tuple(plans),
        lowest_fitting_stage=next((p.stage for p in plans if p.fits), None),
        lowest_fitting_stage_recompute=next((p.stage for p in plans if p.fits_recompute), None),
        compute_s=compute_s, assumed_mfu=assumed_mfu, peak_tflops=peak_tflops, fp8=fp8, fp8_peak_tflops=fp8_peak,
        fp8_flops_share=share, parameters_outside_layers=outside, mfu_estimates=estimates,
    )


def _accumulation_steps(global_batch_size: int | None, micro_batch_size: int, d: int) -> int:
    """Micro-batches per GPU per step of ``global_batch_size`` sequences; 1 without one."""
    if not global_batch_size:
        return 1
    per_step = micro_batch_size * d
    if global_batch_size % per_step:
        raise UserError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size({micro_batch_size}) "
                        f"x data-parallel size({d}) = {per_step}; change one of them "
                        f"(e.g. global_batch_size={per_step * max(1, round(global_batch_size / per_step))})")
    return global_batch_size // per_step


def tokenizer_vocab(params: RunParams) -> int | None:
    """The data set's vocabulary when the YAML says it (a tokenizer trained on the corpus, or
    the null tokenizer's ids plus end-of-document); None when it lives in a model file."""
    tok = params.data.tokenizer
    if tok.type == "null":
        return tok.vocab_size + 1
    if tok.type == "sentencepiece" and not tok.model_path:
        return tok.vocab_size
    return None


def run_vocab(params: RunParams) -> int | None:
    """The unpadded vocabulary the program builds: the preset's, else the tokenizer's."""
    return params.model.vocab_size or tokenizer_vocab(params)


def plan_for_run(params: RunParams, nnodes: int, nproc_per_node: int, precision: Precision,
                 grad_reduce_in_bf16: bool | None = None) -> MemoryPlan | None:
    """The plan of one resolved run (its stage among all four); None when its vocabulary is unknown
    or its batch does not divide over ``nnodes x nproc_per_node`` ranks (no step to plan)."""
    vocab = run_vocab(params)
    if vocab is None:
        return None
    t = params.training
    try:
        geometry = batch_geometry(t, nnodes * nproc_per_node)
    except UserError:
        return None
    return plan_memory(params.model, vocab_size=vocab, nnodes=nnodes, nproc_per_node=nproc_per_node,
                       seq_length=t.seq_length, micro_batch_size=t.micro_batch_size, precision=precision,
                       device=DEVICES["cpu" if precision == "fp32" else DEFAULT_DEVICE],
                       grad_reduce_in_bf16=t.grad_reduce_in_bf16 if grad_reduce_in_bf16 is None else grad_reduce_in_bf16,
                       global_batch_size=geometry.global_batch_size, gradient_accumulation_steps=geometry.accumulation_steps,
                       data_set=params.data_set, fp8=t.fp8 is not None)


# -- the command's request ------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class MemoryRequest:
    """``plan-memory MODEL [DATA]``'s options (None = the default named in the CLI's help)."""

    model: str
    data: str | None = None
    gpus: int | None = None
    nnodes: int | None = None
    nproc_per_node: int | None = None
    device: str | None = None
    gpu_memory_gb: float | None = None
    headroom: float = DEFAULT_HEADROOM
    bus_bandwidth_gbs: float = DEFAULT_BUS_BANDWIDTH_GBS
    seq_length: int | None = None
    micro_batch_size: int | None = None
    vocab_size: int | None = None
    grad_reduce_in_bf16: bool | None = None


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise UserError(f"{name}={value} must be > 0")


def parse_gpu_memory_gb(text: str | None) -> float | None:
    """``GPU_MEMORY_GB`` as the launcher read it."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"GPU_MEMORY_GB={text!r} must be a number of GB, e.g. 80") from None
    _positive("GPU_MEMORY_GB", value)
    return value


def plan_memory_request(r: MemoryRequest, nnodes: int, nproc_per_node: int, gpu_memory_gb_text: str | None) -> MemoryPlan:
    """The plan for ``nnodes x nproc_per_node`` GPUs (NNODES x NPROC_PER_NODE) unless the request says otherwise."""
    for name in ("gpus", "nnodes", "nproc_per_node", "gpu_memory_gb", "bus_bandwidth_gbs", "seq_length",
                 "micro_batch_size", "vocab_size"):
        _positive(f"--{name.replace('_', '-')}", getattr(r, name))
    nnodes = r.nnodes or nnodes
    nproc = r.nproc_per_node or nproc_per_node
    if r.gpus:  # as nodes of NPROC_PER_NODE where it divides, else one node
        nnodes, nproc = (r.gpus // nproc, nproc) if r.gpus % nproc == 0 else (1, r.gpus)
    memory_gb = r.gpu_memory_gb if r.gpu_memory_gb is not None else parse_gpu_memory_gb(gpu_memory_gb_text)
    device = DEVICES[r.device or DEFAULT_DEVICE]
    precision: Precision = "fp32" if device.memory_bytes is None else "bf16"  # the CPU
    preset = load_model(r.model)
    vocab, seq, micro, gbs, accumulation, bf16_reduce, fp8 = r.vocab_size, r.seq_length, r.micro_batch_size, None, None, False, False
    if r.data:
        params = load_run_params(r.model, r.data, RunOverrides())
        t = params.training
        geometry = batch_geometry(t, nnodes * nproc)
        vocab = vocab or run_vocab(params)
        seq, micro = seq or t.seq_length, micro or t.micro_batch_size
        gbs, accumulation, bf16_reduce = geometry.global_batch_size, geometry.accumulation_steps, t.grad_reduce_in_bf16
        fp8 = t.fp8 is not None
    if r.seq_length is not None:
        check_seq_length(r.seq_length, preset, "--seq-length")
    seq = seq or min(4096, preset.max_position_embeddings)  # the data set's was checked as it loaded
    return plan_memory(preset, vocab_size=vocab, nnodes=nnodes, nproc_per_node=nproc, seq_length=seq,
                       micro_batch_size=micro or 1, precision=precision, device=device,
                       device_bytes=memory_gb * GB if memory_gb else None, headroom=r.headroom,
                       grad_reduce_in_bf16=bf16_reduce if r.grad_reduce_in_bf16 is None else r.grad_reduce_in_bf16,
                       bus_bandwidth_gbs=r.bus_bandwidth_gbs, global_batch_size=gbs,
                       gradient_accumulation_steps=accumulation, data_set=r.data, fp8=fp8)
