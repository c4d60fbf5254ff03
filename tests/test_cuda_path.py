"""The CUDA path, checked on CPU as far as it can be: kernel choices, construction of every preset
with the CUDA path's configuration, Megatron's weight decay and learning-rate schedule, gradient
norms, MFU peaks, and the SDPA attention against megatron-core's DotProductAttention.

What cannot run here (no GPU on these machines): the transformer-engine layer spec itself (it
needs transformer-engine, which needs CUDA), megatron-core's DDP / distributed optimizer /
Megatron-FSDP at run time, and the Megatron-FSDP checkpoint preparation; tests/gpu runs those on a
GPU (see README)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_ext.run_spec.flops import peak_tflops_for
from megatron_ext.run_spec.params import RunOverrides, TrainingParams, list_models, load_model, load_run_params
from megatron_ext.training.loop import learning_rate
from megatron_ext.training.model import CPU_KERNELS, build_gpt_model, choose_kernels, ensure_model_parallel


def _no_extensions(name):
    return None


def test_kernel_choices_follow_what_is_installed():
    bare = choose_kernels(on_cuda=True, transformer_engine=False, zero_stage=0, find_spec=_no_extensions)
    assert (bare.transformer_engine, bare.attention, bare.persist_layer_norm, bare.masked_softmax_fusion) == (False, "sdpa", False, False)
    assert (bare.apply_rope_fusion, bare.gradient_accumulation_fusion) == (False, False)
    assert bare.bias_dropout_fusion and bare.bias_activation_fusion and bare.cross_entropy_loss_fusion  # jit kernels: any GPU
    apex = choose_kernels(True, False, 0, find_spec=lambda name: object())  # compiled extensions present
    assert apex.masked_softmax_fusion and apex.gradient_accumulation_fusion and not apex.persist_layer_norm
    te = choose_kernels(True, True, 1, find_spec=_no_extensions)
    assert te.attention == "transformer-engine" and te.persist_layer_norm and te.apply_rope_fusion
    # A pip-installed transformer-engine without apex: the GPT output layer (megatron-core's own
    # ColumnParallelLinear) would raise at build with the fusion on, so it is off.
    assert not te.gradient_accumulation_fusion
    assert choose_kernels(True, True, 1, find_spec=lambda name: object()).gradient_accumulation_fusion  # NGC: TE + apex
    assert not choose_kernels(True, True, 2, find_spec=_no_extensions).gradient_accumulation_fusion  # not with Megatron-FSDP
    cpu = choose_kernels(False, True, 0)
    assert cpu == CPU_KERNELS and cpu.attention == "sdpa" and not any(
        getattr(cpu, f.name) for f in dataclasses.fields(cpu) if f.type in (bool, "bool"))
    assert "transformer-engine no, attention sdpa" in bare.describe()


@pytest.mark.parametrize("model", list_models())
@pytest.mark.parametrize("stage", [0, 2])
def test_every_preset_builds_with_the_cuda_configuration(model, stage):
    """What a GPU without transformer-engine builds (bf16, fusions where their kernels exist, the
    local spec with SDPA attention), on the meta device: megatron-core's construction-time
    assertions (e.g. persist_layer_norm with torch's LayerNorm) run here. With transformer-engine
    the configuration is validated; its layer spec needs transformer-engine (GPU only)."""
    from megatron_ext.training.model import transformer_config, transformer_engine_available

    preset = load_model(model)
    config = transformer_config(preset, torch.bfloat16, choose_kernels(True, False, stage), use_cpu_initialization=True)
    assert config.bf16 and not config.persist_layer_norm
    te_kernels = choose_kernels(on_cuda=True, transformer_engine=True, zero_stage=stage)
    if transformer_engine_available():
        assert transformer_config(preset, torch.bfloat16, te_kernels, use_cpu_initialization=True).persist_layer_norm
    else:  # megatron-core itself refuses transformer-engine's fusions without it: they are chosen only with it
        with pytest.raises(ValueError, match="TE"):
            transformer_config(preset, torch.bfloat16, te_kernels, use_cpu_initialization=True)
    kernels = choose_kernels(on_cuda=True, transformer_engine=False, zero_stage=stage)
    with torch.device("meta"):
        gpt = build_gpt_model(preset, 151_936 if preset.vocab_size else 2048, 128, params_dtype=torch.bfloat16,
                              kernels=kernels, use_cpu_initialization=True, perform_initialization=False)
    attention = gpt.decoder.layers[0].self_attention.core_attention
    assert type(attention).__name__ == "SdpaAttention"
    assert gpt.config.bf16 and not gpt.config.persist_layer_norm


def test_weight_decay_skips_biases_and_norms():
    from megatron_ext.training.trainers import param_groups

    ensure_model_parallel()
    torch.manual_seed(0)
    model = build_gpt_model(load_model("gpt_smoke"), 256, 32)
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

    t = TrainingParams(lr=3e-3, min_lr=3e-4, lr_warmup_iters=warmup, lr_decay_iters=decay, train_iters=20,
                       global_batch_size=16)
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
    from megatron_ext.training.trainers import NonFiniteGradients, wrap_cpu

    ensure_model_parallel()
    torch.manual_seed(0)
    module = build_gpt_model(load_model("gpt_smoke"), 256, 16)
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
    from megatron_ext.run_spec.run_paths import RunPaths
    from orchestration.megatron_lm.program import plan_program
    from orchestration.launch_env import read_launch_env

    params = load_run_params("gpt_smoke", "smoke", RunOverrides(stage))
    program = plan_program(params, "gpt_smoke", "smoke", RunPaths(tmp_path, "r"), read_launch_env({}))
    assert program.env == {"CUDA_DEVICE_MAX_CONNECTIONS": value}
    assert program.argv[program.argv.index("--zero-stage") + 1] == str(stage)


@pytest.mark.parametrize("groups,dropout", [(4, 0.0), (2, 0.0), (1, 0.0)])
def test_sdpa_attention_equals_megatron_dot_product_attention(groups, dropout):
    """Outputs and gradients within 1e-5 of megatron-core's DotProductAttention (causal, fp32, CPU),
    for multi-head, grouped-query and multi-query attention."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext.training.cpu_compat import install_cpu_compat
    from megatron_ext.training.sdpa_attention import SdpaAttention

    ensure_model_parallel()
    install_cpu_compat(1234)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                               attention_dropout=dropout, use_cpu_initialization=True, masked_softmax_fusion=False)
    torch.manual_seed(0)
    s, b, heads, hn = 24, 3, 4, 16
    q = torch.randn(s, b, heads, hn, requires_grad=True)
    k = torch.randn(s, b, groups, hn, requires_grad=True)
    v = torch.randn(s, b, groups, hn, requires_grad=True)
    causal_mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    ref = DotProductAttention(config, 1, AttnMaskType.causal, "self")(q, k, v, causal_mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out = SdpaAttention(config, 1, AttnMaskType.causal, "self")(q, k, v, None)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert out.shape == ref.shape == (s, b, heads * hn)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(grads, ref_grads):
        assert torch.allclose(a, r, atol=1e-5, rtol=1e-5)


def test_megatron_fsdp_refuses_one_device_connection_at_the_edge():
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS != 1 for Megatron-FSDP (arguments.py ~L686); a
    plain torchrun of this program at stages 2-3 says so before any process group exists."""
    from megatron_ext.pretrain import check_device_connections
    from megatron_ext.run_spec.errors import UserError

    gpu = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    for stage in (2, 3):
        with pytest.raises(UserError, match="CUDA_DEVICE_MAX_CONNECTIONS=1 with ZERO_STAGE=.*unset it"):
            check_device_connections(stage, gpu)
    check_device_connections(1, gpu)  # the DDP stages keep Megatron-LM's usual 1
    check_device_connections(2, {**gpu, "CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    check_device_connections(2, {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})  # CPU: no such thing


def test_megatron_fsdp_that_cannot_run_on_this_torch_is_refused_at_the_edge():
    """megatron-core 0.14's Megatron-FSDP reads DeviceMesh bookkeeping that newer torch dropped
    (training/compat.py); stages 2-3 on GPUs then stop before the model is built, saying why.
    With the tested release here (0.16.1 in CI) nothing is refused; 0.14.0 was checked by hand."""
    from megatron_ext.pretrain import check_megatron_fsdp
    from megatron_ext.run_spec.errors import UserError
    from megatron_ext.training.compat import megatron_fsdp_incompatibility

    gpu = {"CUDA_VISIBLE_DEVICES": "0"}
    reason = megatron_fsdp_incompatibility()
    check_megatron_fsdp(1, gpu)
    check_megatron_fsdp(2, {"CUDA_VISIBLE_DEVICES": ""})
    if reason is None:
        check_megatron_fsdp(3, gpu)
    else:
        with pytest.raises(UserError, match="ZERO_STAGE=3 runs Megatron-FSDP on GPUs, but .*child_to_root_mapping"):
            check_megatron_fsdp(3, gpu)
