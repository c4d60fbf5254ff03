"""The CUDA path, checked on CPU as far as it can be: kernel choices (gradient-accumulation fusion,
the fused bias + activation only where it computes the model's activation), construction of every
preset with the CUDA path's configuration, Megatron's weight decay and learning-rate schedule,
gradient norms, MFU peaks (BF16 and FP8), the FP8 refusal rule, manual garbage collection, the
resharding rule, the SDPA attention (grouped key/value heads passed as they are, or repeated)
against megatron-core's DotProductAttention, and the GPU check's preparation, preflight and plan.

What cannot run here (no GPU on these machines): the transformer-engine layer spec itself (it
needs transformer-engine, which needs CUDA), FP8, and GPU kernels; megatron-core's DDP /
distributed optimizer / Megatron-FSDP run through the device shim in
tests/test_cuda_trainer_on_cpu.py, and tests/gpu on a GPU (docs/training-program.md)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO, clean_env, wait_for
from megatron_ext.pretrain import check_device_connections, check_megatron_fsdp
from megatron_ext.run_spec.checkpoints import CheckpointMeta, check_resumable, reshard_problem
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.flops import bf16_share_under_fp8, describe_mfu_peak, padded_vocab_size, peak_tflops_for
from megatron_ext.run_spec.fp8 import fp8_config_fields, fp8_problem
from megatron_ext.run_spec.params import (RunOverrides, TrainingParams, build_dataclass, list_models, load_model, load_run_params,
                                          validate_run_params)
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.training.loop import learning_rate
from megatron_ext.training.manual_gc import ManualGc
from megatron_ext.training.megatron_core_apis import megatron_fsdp_incompatibility
from megatron_ext.training.model import (CPU_KERNELS, build_gpt_model, choose_kernels, ensure_model_parallel, fsdp_allows_fusion,
                                         installed_megatron_core, transformer_config, transformer_engine_available)
from megatron_ext.training.trainers import NonFiniteGradients, param_groups, wrap_cpu
from orchestration.launch_env import read_launch_env
from orchestration.megatron_lm.program import plan_program
from orchestration.node import preflight
from orchestration.node.wire import CheckRequest, NodeCheckRequest, NodeTarget, decode_request, node_call


TE = "2.10.0"
"""A transformer-engine megatron-core would use (the version is what matters to the rules)."""


def _no_extensions(name):
    return None


def _all_extensions(name):
    return object()


def _cuda_config(preset, kernels, **fields):
    """megatron-core's TransformerConfig as the CUDA path makes it: bf16, initialised on the CPU."""
    return transformer_config(preset, torch.bfloat16, kernels, use_cpu_initialization=True, **fields)


def _fused_with_apex(te, stage, **options) -> bool:
    """The gradient-accumulation fusion choose_kernels picks with apex's compiled extensions present."""
    return choose_kernels(True, te, stage, find_spec=_all_extensions, **options).gradient_accumulation_fusion


def test_kernel_choices_follow_what_is_installed():
    bare = choose_kernels(on_cuda=True, transformer_engine=None, zero_stage=0, find_spec=_no_extensions)
    assert (bare.transformer_engine, bare.attention, bare.persist_layer_norm, bare.masked_softmax_fusion) == (False, "sdpa", False, False)
    assert (bare.apply_rope_fusion, bare.gradient_accumulation_fusion) == (False, False)
    assert bare.bias_dropout_fusion and bare.bias_activation_fusion and bare.cross_entropy_loss_fusion  # jit kernels: any GPU
    apex = choose_kernels(True, None, 0, find_spec=_all_extensions)  # compiled extensions present
    assert apex.masked_softmax_fusion and apex.gradient_accumulation_fusion and not apex.persist_layer_norm
    te = choose_kernels(True, TE, 1, find_spec=_no_extensions)
    assert te.attention == "transformer-engine" and te.persist_layer_norm and te.apply_rope_fusion
    # A pip-installed transformer-engine without apex: the GPT output layer (megatron-core's own
    # ColumnParallelLinear) would raise at build with the fusion on, so it is off.
    assert not te.gradient_accumulation_fusion
    assert _fused_with_apex(TE, 1)  # NGC: TE + apex
    assert not choose_kernels(True, TE, 2, find_spec=_no_extensions).gradient_accumulation_fusion  # no extension
    # Megatron-FSDP: megatron-core's layers write the weight gradient with torch.matmul(out=main_grad),
    # which needs bf16 main grads, and a tied embedding loses one of its two gradients
    # (tests/test_cuda_trainer_on_cpu.py: fp32 raises, tied differs, untied bf16 equals the unfused run).
    for stage in (2, 3):
        assert not _fused_with_apex(TE, stage, tied_embeddings=False) and not _fused_with_apex(TE, stage, grad_reduce_in_bf16=True)
        assert _fused_with_apex(TE, stage, grad_reduce_in_bf16=True, tied_embeddings=False)
    # From megatron-core 0.17 Megatron-FSDP asserts transformer-engine >= 2.10 with the fusion on
    # (mcore_fsdp_adapter.py ~L147-150 at core_v0.19.0; checked in the installed release below): decided
    # by the releases, never left to fail at wrap time; an unknown megatron-core gets the strict rule.
    fsdp_fused = lambda mcore, te: _fused_with_apex(te, 2, grad_reduce_in_bf16=True, tied_embeddings=False, megatron_core=mcore)  # noqa: E731
    assert fsdp_fused((0, 16), "2.9.0") and fsdp_fused((0, 16), None)
    assert not fsdp_fused((0, 17), None) and not fsdp_fused((0, 19), "2.9.0") and not fsdp_fused(None, "2.8")
    assert fsdp_fused((0, 17), "2.10.0") and fsdp_fused((0, 19), "2.12.0+cu13") and fsdp_fused(None, "2.10")
    assert _fused_with_apex("2.9.0", 1, megatron_core=(0, 19))  # DDP
    cpu = choose_kernels(False, TE, 0)
    assert cpu == CPU_KERNELS and cpu.attention == "sdpa" and not any(
        getattr(cpu, f.name) for f in dataclasses.fields(cpu) if f.type in (bool, "bool"))
    assert "transformer-engine no, attention sdpa" in bare.describe()


def test_the_fused_kernels_are_warmed_up_as_the_layers_call_them():
    """The warm-up before the first step (Megatron-LM's _warmup_jit_function, extended to the calls
    this model's layers make) runs on this release's fusions: run here eagerly, as a CPU rank runs
    megatron-core's jit functions (import_hooks.eager_jit_fuser), in a child so that the hook comes
    before megatron-core's import. What the compile costs, and saves the first step, shows on a GPU only
    (tests/gpu/gpu_check.py's rows name the warm-up line)."""
    code = """
import dataclasses, torch
from megatron_ext.import_hooks import eager_jit_fuser
eager_jit_fuser()
from megatron_ext.run_spec.params import load_model
from megatron_ext.training.model import CPU_KERNELS, ensure_model_parallel, warm_up_fusions
ensure_model_parallel()
fused = dataclasses.replace(CPU_KERNELS, device="cuda", bias_activation_fusion=True, bias_dropout_fusion=True,
                            cross_entropy_loss_fusion=True)
state = torch.random.get_rng_state()
for name in ("qwen3_1p7b", "gpt2"):
    preset = dataclasses.replace(load_model(name), hidden_size=64, ffn_hidden_size=128)
    print(name, warm_up_fusions(preset, fused, 16, 2, 256, torch.float32, torch.device("cpu")))
print("cpu", warm_up_fusions(load_model("gpt2"), CPU_KERNELS, 16, 2, 256, torch.float32, torch.device("cpu")))
print("rng kept", torch.equal(state, torch.random.get_rng_state()))
"""
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.splitlines() == ["qwen3_1p7b ['swiglu', 'bias_dropout_add', 'cross_entropy']",
                                        "gpt2 ['bias_dropout_add', 'cross_entropy']",
                                        "cpu []", "rng kept True"], proc.stdout + proc.stderr[-3000:]


def test_the_fsdp_fusion_rule_is_the_installed_megatron_core_s():
    """The release rule of choose_kernels against the adapter's own source, on each release this
    file runs with (0.16.1 here, 0.19.2 on Python 3.12: tests/test_other_python.py)."""
    import inspect

    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    source = inspect.getsource(mcore_fsdp_adapter)
    asserts = "gradient_accumulation_fusion" in source and 'is_te_min_version("2.10")' in source
    assert asserts == (not fsdp_allows_fusion(installed_megatron_core(), "2.9.0")), installed_megatron_core()
    assert fsdp_allows_fusion(installed_megatron_core(), "2.10.0")


@pytest.mark.parametrize("te", ["2.9.0", "2.10.0.dev0+abc123", "2.10.0rc1", "2.10", "2.10.0", "2.10.0+cu13", "2.12.0",
                                "1.0.0.dev0", "1.0", "0.13.0"])
def test_transformer_engine_versions_compare_as_megatron_core_s_own_check(te, monkeypatch):
    """A development build "2.10.0.dev0+..." is below 2.10 for megatron-core, which then asserts at wrap
    time: te_at_least answers what megatron-core's own is_te_min_version answers for that installed
    version (its cached ``_te_version`` set as get_te_version would), for the FSDP fusion rule and for
    the FP8 rule."""
    from megatron.core import utils
    from packaging.version import Version

    from megatron_ext.run_spec.fp8 import MIN_TRANSFORMER_ENGINE, te_at_least

    monkeypatch.setattr(utils, "_te_version", Version(te))
    for minimum in ("2.10", MIN_TRANSFORMER_ENGINE):
        assert te_at_least(te, minimum) == utils.is_te_min_version(minimum), (te, minimum)
    assert fsdp_allows_fusion((0, 19), te) == utils.is_te_min_version("2.10")
    assert (fp8_problem("hybrid", te, (9, 0)) is None) == utils.is_te_min_version(MIN_TRANSFORMER_ENGINE)


@pytest.mark.parametrize("model", list_models())
@pytest.mark.parametrize("stage", [0, 2])
def test_every_preset_builds_with_the_cuda_configuration(model, stage):
    """What a GPU without transformer-engine builds (bf16, fusions where their kernels exist, the
    local spec with SDPA attention), on the meta device: megatron-core's construction-time
    assertions (e.g. persist_layer_norm with torch's LayerNorm) run here. With transformer-engine
    the configuration is validated; its layer spec needs transformer-engine (GPU only)."""
    preset, kernels = load_model(model), choose_kernels(on_cuda=True, transformer_engine=None, zero_stage=stage)
    config = _cuda_config(preset, kernels)
    assert config.bf16 and not config.persist_layer_norm
    te_kernels = choose_kernels(on_cuda=True, transformer_engine="2.10.0", zero_stage=stage)
    if transformer_engine_available():
        assert _cuda_config(preset, te_kernels).persist_layer_norm
    else:  # megatron-core itself refuses transformer-engine's fusions without it: they are chosen only with it
        with pytest.raises(ValueError, match="TE"):
            _cuda_config(preset, te_kernels)
    with torch.device("meta"):
        gpt = build_gpt_model(preset, 151_936 if preset.vocab_size else 2048, 128, params_dtype=torch.bfloat16,
                              kernels=kernels, use_cpu_initialization=True, perform_initialization=False)
    assert type(gpt.decoder.layers[0].self_attention.core_attention).__name__ == "SdpaAttention"
    assert gpt.config.bf16 and not gpt.config.persist_layer_norm


def _smoke_gpt(seq_length: int):
    ensure_model_parallel()
    torch.manual_seed(0)
    return build_gpt_model(load_model("gpt_smoke"), 256, seq_length)


def test_weight_decay_skips_biases_and_norms():
    model = _smoke_gpt(32)
    groups = {g["wd_mult"]: g["params"] for g in param_groups(model)}
    names = {id(p): n for n, p in model.named_parameters()}
    plain = {names[id(p)] for p in groups[0.0]}
    assert plain and all(n.endswith(".bias") or "norm" in n for n in plain)
    assert "embedding.word_embeddings.weight" in {names[id(p)] for p in groups[1.0]}
    # Decoupled decay with zero gradients: weights shrink by (1 - lr x wd), norms and biases stay.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(param_groups(model), lr=0.1, weight_decay=0.5)
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.5 * group["wd_mult"]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for n, p in model.named_parameters():
        factor = 1.0 if n in plain else 1 - 0.1 * 0.5
        assert torch.allclose(p, before[n] * factor), n


@pytest.mark.parametrize("warmup,decay", [(3, None), (0, None), (5, 12)])
def test_learning_rate_equals_megatron_scheduler_step_for_step(warmup, decay):
    """megatron-core's own OptimizerParamScheduler, as Megatron-LM's training loop drives it
    (sample-based steps of one global batch, lr read before the step, logged after it)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = TrainingParams(lr=3e-3, min_lr=3e-4, lr_warmup_iters=warmup, lr_decay_iters=decay, train_iters=20, global_batch_size=16)
    gbs = 16
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=warmup * gbs,
                                    lr_decay_steps=(decay or t.train_iters) * gbs, lr_decay_style="cosine",
                                    start_wd=0.1, end_wd=0.1, wd_incr_steps=t.train_iters * gbs, wd_incr_style="constant")
    for iteration in range(1, t.train_iters + 1):
        assert learning_rate(t, iteration - 1) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)  # trains with
        sched.step(increment=gbs)
        assert learning_rate(t, iteration) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)  # logs


@pytest.mark.parametrize("stage", range(4))
def test_grad_norm_without_clipping_and_non_finite_gradients(stage):
    """clip_grad 0 still reports the global norm; a NaN gradient stops the run before the update
    (Megatron-LM's --check-for-nan-in-loss-and-grad), naming the ranks whose loss was not finite."""
    module = _smoke_gpt(16)
    trainer = wrap_cpu(module, stage, TrainingParams(clip_grad=0.0))
    tokens = torch.randint(0, 256, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    trainer.zero_grad()
    trainer.model(tokens, positions, None, labels=tokens).float().mean().backward()
    norm, skipped = trainer.step(1e-3, 0.1)
    assert math.isfinite(norm) and norm > 0 and not skipped
    for loss in (torch.tensor([2.5]), torch.tensor([float("nan")])):
        trainer.zero_grad()
        trainer.model(tokens, positions, None, labels=tokens).float().mean().backward()
        first = next(p for p in module.parameters() if p.grad is not None)
        first.grad.fill_(float("nan"))
        before = [p.detach().clone() for p in module.parameters()]
        trainer.last_loss = loss
        with pytest.raises(NonFiniteGradients, match="non-finite gradients .*the update was not applied") as raised:
            trainer.step(1e-3, 0.1)
        expected = "the loss of rank(s) 0 was not finite" if loss.isnan().any() else "every rank's loss was finite"
        assert expected in str(raised.value)
        assert all(torch.equal(a, b.detach()) for a, b in zip(before, module.parameters()))


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 4090", None), ("H100", None), ("NVIDIA H100 80GB HBM3 (MIG 1g.10gb)", None),
])
def test_mfu_peak_by_exact_device_name(name, peak):
    assert peak_tflops_for(name) == peak


@pytest.mark.parametrize("stage,value", [(0, "1"), (1, "1"), (2, None), (3, None)])
def test_stage_environment_for_the_megatron_core_engine_too(stage, value, tmp_path):
    params = load_run_params("gpt_smoke", "smoke", RunOverrides(stage))
    program = plan_program(params, "gpt_smoke", "smoke", RunPaths(tmp_path, "r"), read_launch_env({}))
    assert program.env == {"CUDA_DEVICE_MAX_CONNECTIONS": value}
    assert program.argv[program.argv.index("--zero-stage") + 1] == str(stage)


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["enable_gqa", "repeated"])
@pytest.mark.parametrize("groups,dropout", [(4, 0.0), (2, 0.0), (1, 0.0)])
def test_sdpa_attention_equals_megatron_dot_product_attention(groups, dropout, takes_gqa):
    """Outputs and gradients within 1e-5 of megatron-core's DotProductAttention (causal, fp32, CPU),
    for multi-head, grouped-query and multi-query attention: with the key/value heads passed to SDPA
    as they are (``enable_gqa``, this torch) and repeated (torch before 2.5)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.sdpa_attention import SDPA_TAKES_GQA, SdpaAttention

    assert SDPA_TAKES_GQA  # torch 2.13 here: the grouped heads go to SDPA unrepeated
    ensure_model_parallel()
    install_megatron_on_cpu(1234)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                               attention_dropout=dropout, use_cpu_initialization=True, masked_softmax_fusion=False)
    torch.manual_seed(0)
    s, b, heads, hn = 24, 3, 4, 16
    q, k, v = (torch.randn(s, b, n, hn, requires_grad=True) for n in (heads, groups, groups))
    causal_mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")(q, k, v, causal_mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    attention = SdpaAttention(config, 1, AttnMaskType.causal, "self")
    attention.takes_gqa = takes_gqa
    out = attention(q, k, v, None)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert out.shape == ref.shape == (s, b, heads * hn)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads):
        assert torch.allclose(a, r, atol=1e-5, rtol=1e-5)


def test_megatron_fsdp_refuses_one_device_connection_at_the_edge():
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS != 1 for Megatron-FSDP (arguments.py ~L686); a
    plain torchrun of this program at stages 2-3 says so before any process group exists."""
    gpu = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    for stage in (2, 3):
        with pytest.raises(UserError, match="CUDA_DEVICE_MAX_CONNECTIONS=1 with ZERO_STAGE=.*unset it"):
            check_device_connections(stage, gpu)
    check_device_connections(1, gpu)  # the DDP stages keep Megatron-LM's usual 1
    check_device_connections(2, {**gpu, "CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    check_device_connections(2, {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})  # CPU: no such thing


def test_megatron_fsdp_that_cannot_run_on_this_torch_is_refused_at_the_edge():
    """megatron-core 0.14's Megatron-FSDP reads DeviceMesh bookkeeping that newer torch dropped
    (training/megatron_core_apis.py); stages 2-3 on GPUs then stop before the model is built, saying why.
    With the tested release here (0.16.1 in CI) nothing is refused; 0.14.0 was checked by hand."""
    gpu = {"CUDA_VISIBLE_DEVICES": "0"}
    reason = megatron_fsdp_incompatibility()
    check_megatron_fsdp(1, gpu)
    check_megatron_fsdp(2, {"CUDA_VISIBLE_DEVICES": ""})
    if reason is None:
        check_megatron_fsdp(3, gpu)
    else:
        with pytest.raises(UserError, match="ZERO_STAGE=3 runs Megatron-FSDP on GPUs, but .*child_to_root_mapping"):
            check_megatron_fsdp(3, gpu)


@pytest.mark.parametrize("model,fused", [("gpt_smoke", False), ("qwen3_smoke", True), ("gpt_smoke_tanh", True)])
def test_bias_activation_fusion_only_where_it_computes_the_models_activation(model, fused):
    """megatron-core's fused bias + GELU is the tanh approximation (fusions/fused_bias_gelu.py): the
    CUDA configuration fuses SwiGLU and tanh-GELU models, whose logits then equal the unfused
    model's, and not the exact-GELU presets, whose logits the fusion would change (Megatron-LM's
    --bias-gelu-fusion default trains that other function)."""
    import torch._dynamo

    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu

    preset = (dataclasses.replace(load_model("gpt_smoke"), gelu_tanh=True) if model == "gpt_smoke_tanh"
              else load_model(model))
    cuda = choose_kernels(on_cuda=True, transformer_engine=None, zero_stage=0, find_spec=_no_extensions)
    assert _cuda_config(preset, cuda).bias_activation_fusion == fused
    ensure_model_parallel()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)

    def logits(fusion: bool) -> torch.Tensor:
        install_megatron_on_cpu(1234)
        torch.manual_seed(0)
        gpt = build_gpt_model(preset, 256, 16, kernels=dataclasses.replace(CPU_KERNELS, bias_activation_fusion=fusion),
                              **({"bias_activation_fusion": True} if fusion else {}))
        with torch._dynamo.config.patch(disable=True), torch.no_grad():  # megatron's jit_fuser is torch.compile
            return gpt(tokens, positions, None)

    unfused = logits(False)
    assert torch.allclose(logits(fused), unfused, atol=2e-5, rtol=0)  # the configuration the CUDA path chooses
    if not fused:  # megatron-core's fused bias-GELU forced on an exact-GELU model: another function
        assert (logits(True) - unfused).abs().max() > 2e-5


@pytest.mark.parametrize("setting,te,capability,problem", [
    (None, None, None, None),
    ("hybrid", "2.8.0", (9, 0), None),
    ("e4m3", "1.13.0+abc", (8, 9), None),
    ("hybrid", None, (9, 0), "transformer-engine is not installed"),
    ("hybrid", "0.12.0", (9, 0), "needs transformer-engine 1.0 or later"),
    ("hybrid", "2.8.0", (8, 0), "this GPU is 8.0"),
    ("hybrid", None, None, "this run has none"),
])
def test_fp8_is_refused_with_one_message_where_it_cannot_run(setting, te, capability, problem):
    said = fp8_problem(setting, te, capability)
    if problem is None:
        assert said is None
    else:
        assert problem in said and f"training.fp8={setting}" in said and "training.fp8: null" in said, said
    fields = fp8_config_fields(setting, 1024, "max")
    assert fields == ({} if setting is None else {
        "fp8": setting, "fp8_recipe": "delayed", "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"})
    if setting:  # megatron-core's TransformerConfig takes them (its fp8 context reads them on the GPU)
        config = _cuda_config(load_model("qwen3_1p7b"), choose_kernels(True, None, 0, _no_extensions), **fields)
        assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len) == (setting, "delayed", 1024)


def _node_check(tmp_path, **fields):
    """node-check's request for node 0 of a one-node, two-process run "r" on localhost."""
    return NodeCheckRequest(NodeTarget("r", 0, "localhost", tmp_path),
                            CheckRequest(master_addr="localhost", nproc_per_node=2, nnodes=1, **fields))


def test_every_node_s_preflight_refuses_fp8_it_cannot_run(tmp_path, monkeypatch):
    """The launcher asks every node (node-check --fp8): transformer-engine's version and the GPUs'
    compute capability (nvidia-smi, no CUDA initialisation) against fp8_problem, before anything
    starts; the same rule every rank applies at its edge."""
    call = node_call(_node_check(tmp_path, fp8="hybrid"))
    assert decode_request(call.command, call.request) == _node_check(tmp_path, fp8="hybrid")  # the request, as the node reads it
    cpu = preflight.inspect_node(_node_check(tmp_path, fp8="hybrid"), tmp_path / "rs", 0, REPO)
    assert any(p.startswith("training.fp8=hybrid needs a GPU with FP8 tensor cores") for p in cpu.problems), cpu.problems
    monkeypatch.setattr(preflight, "compute_capability", lambda: (8, 0))
    a100 = preflight.inspect_node(_node_check(tmp_path, fp8="e4m3"), tmp_path / "rs", 8, REPO)
    assert any("this GPU is 8.0" in p for p in a100.problems), a100.problems
    monkeypatch.setattr(preflight, "compute_capability", lambda: (9, 0))
    h200 = preflight.inspect_node(_node_check(tmp_path, fp8="hybrid"), tmp_path / "rs", 8, REPO)
    assert any("transformer-engine is not installed" in p for p in h200.problems), h200.problems  # none here
    bf16 = preflight.inspect_node(_node_check(tmp_path), tmp_path / "rs", 8, REPO)
    assert not any("fp8" in p for p in bf16.problems)


def broken_transformer_engine(root):
    """A transformer-engine as a pip install whose PyTorch extension does not load for this torch
    leaves it: the top-level package imports, ``transformer_engine.pytorch`` raises (its library's
    undefined symbol). Made here, as no transformer-engine installs without CUDA."""
    (root / "transformer_engine" / "pytorch").mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text('__version__ = "2.10.0"\n')
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text(
        'raise ImportError("libtransformer_engine.so: undefined symbol: _ZN3c104cuda20CUDACachingAllocator")\n')
    info = root / "transformer_engine-2.10.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.10.0\n")
    return root


def test_a_transformer_engine_megatron_core_cannot_use_is_not_used_and_the_preflight_names_it(tmp_path, monkeypatch):
    """The program asks megatron-core (its HAVE_TE), not the top-level import; every node's preflight
    names such an install in one line, from a child with the ranks' environment."""
    env = clean_env(PYTHONPATH=os.pathsep.join([str(broken_transformer_engine(tmp_path / "site")), str(REPO)]))
    asked = subprocess.run([sys.executable, "-c", "import transformer_engine; from megatron_ext.training.model import "
                            "transformer_engine_available as a, transformer_engine_version as v; print(a(), v())"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert asked.stdout.split() == ["False", "None"], asked.stdout + asked.stderr[-2000:]
    problem = preflight.transformer_engine_problem("2.10.0", env)
    assert problem.startswith("transformer-engine 2.10.0 is installed but megatron-core cannot use it: importing "
                              "transformer_engine.pytorch fails here (ImportError: libtransformer_engine.so: undefined "
                              "symbol"), problem
    assert "reinstall it for this torch" in problem and "\n" not in problem
    assert preflight.transformer_engine_problem("2.10.0", clean_env()) is not None  # none at all: not usable either
    software = preflight.installed_software(REPO)
    monkeypatch.setattr(preflight, "installed_software", lambda _: {**software, "transformer-engine": "2.10.0"})
    report = preflight.inspect_node(_node_check(tmp_path), tmp_path / "rs", 0, REPO, env)
    assert [p for p in report.problems if "transformer-engine" in p] == [problem], report.problems


def test_fp8_settings_load_and_are_checked():
    t = load_run_params("qwen3_1p7b", "smoke").training
    assert (t.fp8, t.fp8_amax_history_len, t.fp8_amax_compute_algo, t.manual_gc, t.manual_gc_interval) == (
        None, 1, "most_recent", False, 0)  # Megatron-LM's defaults
    with pytest.raises(UserError, match=r"training.fp8='e5m2' is not one of \['hybrid', 'e4m3'\]"):
        build_dataclass(TrainingParams, {"fp8": "e5m2"}, "training")
    assert build_dataclass(TrainingParams, {"fp8": "hybrid"}, "training").fp8 == "hybrid"
    params = load_run_params("gpt_smoke", "smoke")
    for bad, message in (({"fp8_amax_history_len": 0}, "fp8_amax_history_len=0 must be > 0"),
                         ({"manual_gc_interval": -1}, "manual_gc_interval=-1 must be >= 0")):
        with pytest.raises(UserError, match=message):
            validate_run_params(dataclasses.replace(params, training=dataclasses.replace(params.training, **bad)))


def test_mfu_is_against_the_bf16_peak_for_every_run_fp8_too():
    """An FP8 run's MFU divided by the FP8 peak understated it (core attention and logits stay in
    BF16) and could not be compared with a BF16 run's: every run divides by the BF16 peak, and the
    FP8 start line says what share of the FLOPs stays in BF16."""
    assert describe_mfu_peak("NVIDIA H100 80GB HBM3") == "MFU against the dense BF16 peak of NVIDIA H100 80GB HBM3: 989 TFLOP/s"
    qwen = load_model("qwen3_1p7b")
    share = bf16_share_under_fp8(qwen, 4096, padded_vocab_size(qwen.vocab_size, qwen.make_vocab_size_divisible_by))
    assert share == pytest.approx(0.28, abs=0.005)  # the figure: Qwen3-1.7B at 4096 tokens
    assert describe_mfu_peak("NVIDIA H200", share) == (
        "MFU against the dense BF16 peak of NVIDIA H200: 989 TFLOP/s, FP8 runs too (comparable with BF16 runs; 28% of "
        "the counted FLOPs, core attention and logits, stay in BF16, so no FP8 peak is a fair ceiling)")
    assert describe_mfu_peak("NVIDIA GeForce RTX 4090").startswith("no MFU: no dense BF16 peak is known")


@pytest.mark.parametrize("enabled,interval,expected", [
    (False, 3, []),
    (True, 0, ["disable", "collect2", "collect2", "collect0", "enable"]),
    (True, 3, ["disable", "collect2", "collect2", "collect2", "collect0", "collect2", "enable"]),
])
def test_manual_gc_collects_on_every_rank_at_the_same_steps(enabled, interval, expected):
    """Megatron-LM's --manual-gc: off at the start with one collection, every ``interval`` steps,
    a full collection before an evaluation and a young one after it; the collector back on at the end."""
    calls = []  # the gc module's calls, recorded
    gc = ManualGc(enabled, interval, types.SimpleNamespace(disable=lambda: calls.append("disable"), enable=lambda: calls.append("enable"),
                                                           collect=lambda generation=2: calls.append(f"collect{generation}")))
    gc.start()
    for step in (1, 2, 3):
        gc.after_step(step)
    with gc.around_evaluation():
        pass
    gc.after_step(6)
    gc.stop()
    assert calls == expected


@pytest.mark.parametrize("device,stage,saved,now,allowed", [
    ("cuda", 0, 2, 1, True), ("cuda", 0, 32, 64, True), ("cuda", 1, 2, 1, True), ("cuda", 1, 32, 24, True),
    ("cuda", 1, 32, 64, False), ("cuda", 2, 32, 24, True), ("cuda", 3, 1, 2, True),
    ("cpu", 1, 2, 4, False), ("cpu", 3, 2, 4, True), ("cpu", 1, 2, 2, True),
])
def test_resharding_rule(device, stage, saved, now, allowed):
    """One pure rule for a resume at another data-parallel size (a lost node continues with fewer):
    the distributed optimizer's dp_reshardable layout follows its buckets, max(4e7, 1e6 x dp) elements."""
    problem = reshard_problem(device, stage, saved, now)
    assert (problem is None) == allowed, problem
    meta = CheckpointMeta(iteration=5, consumed_samples=80, world_size=saved, zero_stage=stage, global_batch_size=16,
                          device=device)
    if allowed:
        note = check_resumable(meta, now, stage, 16, device, "ckpt")
        assert note is None if saved == now else note.startswith(f"resharding the checkpoint of {saved} ranks to {now}")
    else:
        with pytest.raises(UserError, match=f"resume with {saved} ranks"):
            check_resumable(meta, now, stage, 16, device, "ckpt")


# -- the GPU check ---------------------------------------------------------------------------------

def _gpu_module(name: str):
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "tests" / "gpu"))


def test_prepare_device_check_copies_the_wheels_where_they_travel(tmp_path):
    """Both releases' wheels go into .whl/ of the checkout, ignored through .git/info/exclude; the
    carry list, the machine kind and one command per device call (a release each, under ~300 s) are
    printed; a second run changes nothing; a missing wheel is one message, exit 2. (``--no-download``:
    the dependency wheels come from the registry, which a test does not reach for.)"""
    repo, wheels = tmp_path / "checkout", tmp_path / "wheels"
    repo.mkdir(), wheels.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README.md").write_text("x\n")
    script = REPO / "tests" / "gpu" / "prepare_device_check.py"
    argv = [sys.executable, str(script), "--repo", str(repo), "--wheel-dir", str(wheels), "--no-download"]
    wheel = "megatron_core-{}-cp312-cp312-manylinux_2_28_x86_64.whl".format
    (wheels / wheel("0.16.1")).write_bytes(b"wheel")
    missing = subprocess.run(argv, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode == 2 and "no megatron_core-0.19.2-cp312-*.whl in" in missing.stderr, missing.stderr
    (wheels / wheel("0.19.2")).write_bytes(b"wheel2")
    for _ in range(2):
        done = subprocess.run(argv, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        assert 'carry: [".whl"]' in done.stdout and "\nkind: nvidia-h200 (" in done.stdout, done.stdout
        commands = [line.split("): ", 1)[1] for line in done.stdout.splitlines() if line.startswith("command ")]
        assert [c.split(" --only ")[0] for c in commands] == [
            f"DEVICE_CHECK_LIMIT_S=300 bash tests/gpu/device_check.sh --megatron-core {r}" for r in ("0.19.2", "0.16.1")]
        assert "s planned of its 300 s limit" in done.stdout and commands[0].endswith("--only precision,full-z3,full-z2,"
                                                                                          "resume-z3,nan-z2,resume-z2,"
                                                                                          "full-z0-fp8,full-z2-fp8")
    assert [(repo / ".whl" / wheel(release)).read_bytes() for release in ("0.16.1", "0.19.2")] == [b"wheel", b"wheel2"]
    assert (repo / ".git" / "info" / "exclude").read_text().splitlines().count("/.whl/") == 1
    ignored = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--ignored"], capture_output=True, text=True)
    assert "!! .whl/" in ignored.stdout and ".gitignore" not in ignored.stdout


def test_gpu_check_preflight_names_everything_missing_at_once():
    gpu_check = _gpu_module("gpu_check")
    fine = gpu_check.Facts(python=(3, 12), torch="2.11.0", cuda_devices=1, device_name="NVIDIA H200",
                           megatron_core=None, wheel=".whl/megatron_core-0.16.1-cp312.whl", transformer_engine=None,
                           free_gb=60.0, out_dir="/out")

    def problems(**changes) -> list[str]:
        return gpu_check.preflight_problems(dataclasses.replace(fine, **changes))

    assert problems() == []
    # Another release asked than the one installed: its wheel must be carried; a missing module of
    # the program's is installed from the carried dependencies, else named.
    other = problems(megatron_core="0.16.1", release="0.19.2", wheel=None)
    assert "megatron-core 0.19.2 does not import and no megatron_core-0.19.2-cp312-*.whl" in other[0]
    assert problems(megatron_core="0.19.2+abc", release="0.19.2") == []
    assert problems(missing_modules=("pydantic",), carried_deps=True) == []
    assert problems(missing_modules=("pydantic",))[0].startswith("pydantic does not import for python3 here")
    bare = problems(torch="2.11.0", cuda_devices=0, wheel=None, free_gb=4.0)
    assert len(bare) == 3 and "sees no CUDA device" in bare[0]
    assert "prepare_device_check.py" in bare[1] and "carry" in bare[1] and "4.0 GB free" in bare[2]
    no_pip = problems(pip=False, missing_modules=("yaml",))
    assert len(no_pip) == 2 and "pip does not import" in no_pip[0] and no_pip[1].startswith("yaml does not import")
    assert problems(pip=False, megatron_core="0.16.1") == []  # no install
    with pytest.raises(SystemExit, match=r"error: pip could not install megatron_core-0\.0\.0-cp312-none-any\.whl: "):
        gpu_check.install_wheel("/nonexistent/megatron_core-0.0.0-cp312-none-any.whl")


def test_gpu_check_calls_fit_300_s_most_valuable_first():
    """Each prepared device call fits its limit with the setup and the fused kernels' first compile
    counted (two calls and a retry of one in a 15-minute lease with the machine's start), its most
    valuable rows expected rather than left to the time left; no row repeats another: where one rank
    runs no_shard (megatron-core 0.16) stage 3 is stage 2, so its rows are not there nor prepared."""
    gpu_check, prepare = _gpu_module("gpu_check"), _gpu_module("prepare_device_check")
    every = {r.name for r in gpu_check.all_rows(transformer_engine=True)}
    planned = {}
    for call in prepare.CALLS:
        assert set(call.rows.split(",")) <= every, call  # no unknown row
        assert call.limit_s <= 300 and gpu_check.STOP_MARGIN_S == 40
        planned[call.release] = gpu_check.planned_rows(call.rows, call.limit_s - gpu_check.STOP_MARGIN_S)
        assert planned[call.release][2] <= call.limit_s - gpu_check.STOP_MARGIN_S, planned
    assert planned["0.19.2"][:2] == (["precision", "full-z3", "full-z2", "resume-z3", "nan-z2"], ["resume-z2"])
    assert planned["0.16.1"][:2] == (["checkpoint-z0", "resume-z1", "nan-z2"], ["profile-z0", "precision"])
    assert 2 * 300 + 180 <= 900 - 60  # two calls and the machine's start (minutes) leave a lease's last minute
    no_shard = [r.name for r in gpu_check.all_rows(transformer_engine=False, shards_one_rank=False)]
    assert not [n for n in no_shard if "z3" in n] and "precision" in no_shard and "full-z2" in no_shard
    assert not [n for n in prepare.CALLS[1].rows.split(",") if "z3" in n]  # 0.16.1
    with_te = [r.name for r in gpu_check.all_rows(transformer_engine=True)]
    assert {"full-z0-fp8", "full-z2-fp8"} <= set(with_te) - set(no_shard)
    # The full rows peaked at 84.78 GiB with micro batch 4: an H200 (139.8 GiB) runs 4, an H100 (79.2 GiB) 2.
    stages = _gpu_module("test_gpu_stages")
    assert [stages.micro_batch_for(gib) for gib in (139.8, 79.2, None)] == [4, 2, 4] and prepare.KIND == "nvidia-h200"


def test_gpu_check_plan_counts_the_setup_and_one_compile():
    gpu_check = _gpu_module("gpu_check")
    row = gpu_check.Row
    rows = [row("a", 40, print, 50), row("b", 40, print, 50), row("c", 25, print), row("d", 60, print)]
    assert gpu_check.row_costs(rows) == [90, 40, 25, 60]  # the first full-size start compiles, once
    assert gpu_check.row_costs(rows[2:3] + rows[:2]) == [25, 90, 40]
    expected, cut = gpu_check.plan_rows(rows, 200, setup_s=20)
    assert [r.name for r in expected] == ["a", "b", "c"] and [r.name for r in cut] == ["d"]  # 20+90+40+25 = 175
    only, _ = gpu_check.plan_rows(rows, 200, ["d", "c", "z"], setup_s=20)
    assert [r.name for r in only] == ["d", "c"]  # in the order asked; a name this release lacks left out
    assert gpu_check.planned_s(only, setup_s=20) == 105


def _precision_result(dtype: str, norm: float, strategy: str | None, kind: str | None, policy: bool = True) -> dict:
    collectives = {"all_reduce": ["float32"]}
    if kind:
        collectives[kind] = sorted({dtype, *collectives.get(kind, [])})
    return {"policy": {"main_grads_dtype": dtype, "grad_comm_dtype": dtype} if policy else None, "main_grads": [dtype],
            "collectives": collectives, "grad_norm": norm, "strategy": strategy}


def test_gpu_check_precision_verdicts():
    """Sharded at one rank (0.19.2 with the switch): each stage's own strategy, reduce-scattered in the dtype
    asked, the gradient norm of stage 0; a gradient added twice (norm x 2), a bf16 reduce-scatter where fp32 was
    asked, or no_shard where sharding was asked fail. Not sharded (0.16.1): no_shard, all-reduced."""
    rows = _gpu_module("gpu_rows")

    def results(sharded: bool, change: dict | None = None) -> dict:
        out = {0: {asked: _precision_result(dtype, 4.23, "no_shard", "all_reduce") for asked, dtype in
                   (("fp32", "float32"), ("bf16", "bfloat16"))}}
        for stage, strategy in ((2, "optim_grads"), (3, "optim_grads_params")):
            out[stage] = {asked: _precision_result(dtype, 4.23, strategy if sharded else "no_shard",
                                                   "reduce_scatter" if sharded else "all_reduce", policy=sharded)
                          for asked, dtype in (("fp32", "float32"), ("bf16", "bfloat16"))}
        for (stage, asked), fields in (change or {}).items():
            out[stage][asked].update(fields)
        return out

    verdicts = rows.precision_verdicts(results(True), sharded=True)
    assert len(verdicts) == 4 and all(": PASS (" in v for v in verdicts), verdicts
    assert verdicts[0] == ("z2 fp32: PASS (optim_grads, main gradients float32, reduce-scatter in float32, policy "
                           "float32/float32, norm 4.2300 vs stage 0's 4.2300)")
    assert all(": PASS (no_shard" in v for v in rows.precision_verdicts(results(False), sharded=False))
    for change in ({(3, "fp32"): {"grad_norm": 8.46}},
                   {(2, "fp32"): {"collectives": {"reduce_scatter": ["bfloat16"], "all_reduce": ["float32"]}}},
                   {(2, "bf16"): {"strategy": "no_shard"}}):
        failed = [v for v in rows.precision_verdicts(results(True, change), sharded=True) if "FAIL" in v]
        assert len(failed) == 1, (change, failed)
    assert all("FAIL" in v for v in rows.precision_verdicts(results(False), sharded=True))  # no_shard where asked


@pytest.mark.parametrize("release, allowed", [((0, 14), True), ((0, 15), True), ((0, 16), False), ((0, 17), True),
                                              ((0, 19), True)])
def test_one_rank_runs_stages_2_and_3_sharded_only_where_asked_and_allowed(release, allowed):
    """cuda_trainer.one_rank_strategy: one rank runs stages 2-3 as no_shard unless MEGATRON_EXT_SHARD_ONE_RANK=1
    keeps their own strategy, refused with one message on megatron-core 0.16 (it adds a one-rank gradient into
    itself: the gradients double); more ranks and stages 0-1 are never changed."""
    from megatron_ext.training.cuda_trainer import SHARD_ONE_RANK_ENV, one_rank_strategy, shard_one_rank_asked

    assert [shard_one_rank_asked(env) for env in ({}, {SHARD_ONE_RANK_ENV: "0"}, {SHARD_ONE_RANK_ENV: " "},
                                                   {SHARD_ONE_RANK_ENV: "1"})] == [False, False, False, True]
    for stage in (0, 1, 2, 3):
        assert one_rank_strategy(stage, 2, release, True) is None and one_rank_strategy(stage, 8, release, False) is None
        assert one_rank_strategy(stage, 1, release, False) == (None if stage < 2 else "no_shard")
    assert one_rank_strategy(1, 1, release, True) is None
    if allowed:
        assert one_rank_strategy(2, 1, release, True) is None and one_rank_strategy(3, 1, release, True) is None
    else:
        with pytest.raises(UserError, match=r"^MEGATRON_EXT_SHARD_ONE_RANK=1 at ZeRO stage 3 on one rank: megatron-core "
                                            r"0\.16's Megatron-FSDP adds each reduced gradient into itself at one rank "
                                            r"\(the gradients would double every micro-batch\); unset it"):
            one_rank_strategy(3, 1, release, True)


def test_the_program_reads_the_one_rank_switch_at_its_edge(tmp_path):
    """MEGATRON_EXT_SHARD_ONE_RANK is read once, where the program reads its environment (pretrain.resolve),
    and reaches wrap_cuda through RunInputs."""
    from megatron_ext import pretrain

    args = pretrain.parse_args(["--model", "gpt_smoke", "--data", "smoke", "--run-name", "switch"])
    for value, asked in (("1", True), ("0", False), ("", False), (None, False)):
        env = {"ARTIFACT_ROOT": str(tmp_path), **({"MEGATRON_EXT_SHARD_ONE_RANK": value} if value is not None else {})}
        assert pretrain.resolve(args, env).shard_one_rank is asked, value


@pytest.mark.parametrize("name, group", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)", "GEMM"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, FusedAdamMathFunctor>", "optimizer"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("Memcpy DtoD (Device -> Device)", "memory copies"),
    ("aten::mm", "GEMM"),
])
def test_profile_groups_kernels_by_name(name, group):
    profile = _gpu_module("profile_step")
    assert profile.kernel_group(name) == group
    assert profile.kernel_group(name, in_optimizer=True) == "optimizer"  # launched inside the optimizer step


def test_profile_table_gives_each_group_its_share_of_the_step():
    profile = _gpu_module("profile_step")
    k = profile.KernelTime
    summary = profile.summarize([k("nvjet_a", 600.0), k("nvjet_a", 400.0), k("flash_fwd", 500.0),
                                 k("vectorized_elementwise_kernel", 100.0, in_optimizer=True),
                                 k("triton_poi_fused_mul_0", 200.0)], step_s=0.002)
    groups = summary["groups"]
    assert (groups["GEMM"]["ms"], groups["GEMM"]["share"], groups["GEMM"]["count"]) == (1.0, 0.5, 2)
    assert groups["optimizer"]["share"] == 0.05 and groups["elementwise"]["top"] == "triton_poi_fused_mul_0"
    assert [t["name"] for t in summary["top"]][:2] == ["nvjet_a", "flash_fwd"] and summary["kernel_ms"] == 1.8
    table = profile.format_profile(summary, "iteration 7")
    assert table.splitlines()[4] == "| GEMM | 1.0 | 50.0% | 2 | nvjet_a |", table
    assert profile.one_line(summary) == ("step 2 ms: GEMM 50.0%, attention 25.0%, elementwise 10.0%, optimizer 5.0%; "
                                         "no kernel 10.0%")


def test_profile_of_one_step_of_the_program(tmp_path):
    """profile_step.py around the program itself (gpt_smoke on the CPU, 3 iterations, the last profiled): the
    table's groups are the step's operators, their shares of the step at most 100%, GEMM among them; the run
    ends as it would without it."""
    import json

    from conftest import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                           str(free_port()), str(REPO / "tests" / "gpu" / "profile_step.py"), "--at", "3", "--out",
                           str(tmp_path / "keep"), "--", "--model", "gpt_smoke", "--data", "smoke", "--run-name", "prof",
                           "--train-iters", "3"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=clean_env(ARTIFACT_ROOT=str(tmp_path / "art"), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "keep" / "profile.json").read_text())
    groups = summary["groups"]
    assert summary["title"].startswith("iteration 3, ZERO_STAGE=0") and set(groups) == set(_gpu_module("profile_step").GROUPS)
    assert groups["GEMM"]["share"] > 0.1 and groups["optimizer"]["count"] > 0, groups
    assert sum(g["share"] for g in groups.values()) <= 1.0 and summary["top"][0]["name"] == "aten::mm", summary
    assert "| group | time (ms) | share of step |" in (tmp_path / "keep" / "profile.md").read_text()
    assert "profile: step " in proc.stdout and "done: 3 iterations" in proc.stdout


def test_device_check_fails_in_its_first_seconds_saying_what_is_missing():
    """On this machine (no GPU) the one command stops at its preflight, naming the missing device."""
    started = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "tests" / "gpu" / "device_check.sh")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "device check: missing: " in proc.stderr and "sees no CUDA device" in proc.stderr
    assert "plan: " in proc.stdout and time.monotonic() - started < 60


def test_gpu_check_writes_each_row_as_it_ends_and_kills_a_late_rows_group(tmp_path, monkeypatch):
    """The run loop on CPU with stand-in rows: each line reaches $OUT/gpu_check-<release>.txt as its row ends, a
    row past its limit has its whole process group killed (a child and its grandchild), a row the budget left
    cannot hold is not started, what a row keeps lands in $OUT beside the report; the program's answers decide:
    where one rank may shard every row gets MEGATRON_EXT_SHARD_ONE_RANK=1, and a row it leaves out is named."""
    gpu_check, stages = _gpu_module("gpu_check"), _gpu_module("test_gpu_stages")
    facts = gpu_check.Facts(python=(3, 12), torch="2.11.0", cuda_devices=1, device_name="NVIDIA H200",
                            megatron_core="0.16.1", wheel=None, transformer_engine=None, free_gb=60.0, out_dir=str(tmp_path))
    late_group = []

    def late(out):
        code, text = stages.run_in_own_group(["bash", "-c", "sleep 60 & sleep 60"], 1.0)
        late_group.append(int(text.rsplit("process group ", 1)[1].split()[0]))
        return f"late: exit {code}; in the file already: {'quick: done' in (tmp_path / 'gpu_check-0.16.1.txt').read_text()}"

    def keeps(out):
        (out / "keep").mkdir()
        (out / "keep" / "profile.md").write_text("| group |")
        return f"keeps: {os.environ.get('MEGATRON_EXT_SHARD_ONE_RANK')}"

    rows = [gpu_check.Row("quick", 1, lambda out: "quick: done"), gpu_check.Row("late", 5, late),
            gpu_check.Row("big", 1000, lambda out: "big: ran"), gpu_check.Row("keeps", 1, keeps)]
    monkeypatch.setattr(gpu_check, "gather_facts", lambda release: facts)
    stage_3 = gpu_check.Row("full-z3", 1, lambda out: "full-z3: ran")
    monkeypatch.setattr(gpu_check, "all_rows", lambda transformer_engine, shards_one_rank=True, micro=4:
                        rows + [stage_3] * shards_one_rank)
    answers = gpu_check.ProgramAnswers(None, False, "MEGATRON_EXT_SHARD_ONE_RANK")  # 0.16: no_shard at one rank
    monkeypatch.setattr(gpu_check, "ask_program", lambda: answers)
    monkeypatch.setattr(gpu_check.signal, "signal", lambda *a: None)
    monkeypatch.setenv("MEGATRON_EXT_SHARD_ONE_RANK", "0")  # restored after the test: main sets it
    assert gpu_check.main(["--budget-s", "60", "--only", "quick,late,big,keeps,full-z3"]) == 0
    text = (tmp_path / "gpu_check-0.16.1.txt").read_text()
    assert "quick: done" in text and "late: exit 124; in the file already: True" in text, text
    assert "big: ran" not in text and "1 row(s) not run, their estimates past the 60 s budget: big" in text, text
    assert "keeps: 0  [keeps " in text and "kept keeps-0.16.1.md]" in text, text
    assert (tmp_path / "keeps-0.16.1.md").read_text() == "| group |"
    assert "not run on this release: full-z3" in text and "full-z3: ran" not in text, text
    _wait_until_group_ended(late_group[0])  # nothing of the late row's group runs on
    answers = gpu_check.ProgramAnswers(None, True, "MEGATRON_EXT_SHARD_ONE_RANK")  # 0.17 on
    assert gpu_check.main(["--budget-s", "60", "--only", "keeps,full-z3"]) == 0
    text = (tmp_path / "gpu_check-0.16.1.txt").read_text()
    assert "Megatron-FSDP's own strategies" in text and "keeps: 1  [" in text and "full-z3: ran" in text, text


def _wait_until_group_ended(pgid: int) -> None:
    """Within 5 s, no process of process group ``pgid`` but zombies (from /proc: state, ppid, pgrp)."""
    def running() -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else None
            except OSError:
                continue
            if fields and int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
        return out

    wait_for(lambda: not running(), 5, 0.1, f"process group {pgid} to end")


@pytest.mark.parametrize("device, stage, per_parameter", [
    ("cpu", 0, 12), ("cpu", 3, 12), ("cuda", 0, 14), ("cuda", 1, 14), ("cuda", 2, 12), ("cuda", 3, 12)])
def test_a_checkpoint_s_size_per_parameter_follows_the_device_and_stage(device, stage, per_parameter, tmp_path):
    """torch_dist (stages 0-1) on GPUs holds the bf16 weights besides the fp32 main weights and Adam's moments
    (2 + 4 + 8 bytes); fsdp_dtensor (stages 2-3) holds the fp32 main weights in their place (4 + 8), as fp32
    everywhere on the CPU. The preflight's disk check says which (Qwen3-1.7B: 24.1 or 20.6 GB each)."""
    from megatron_ext.run_spec.model_size import checkpoint_bytes, checkpoint_bytes_per_parameter
    from megatron_ext.host.devices import Device

    assert checkpoint_bytes_per_parameter(Device(device), stage) == per_parameter
    assert checkpoint_bytes(1_720_574_976, Device(device), stage) == 1_720_574_976 * per_parameter
    said = preflight.disk_problem(tmp_path / "checkpoints", 10**15, 2, Device(device), stage)
    assert f"x {per_parameter} bytes)" in said, said
