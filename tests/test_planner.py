"""The memory planner: exact parameter counts without torch, model states per stage, activations,
data-parallel traffic, the stage that fits, and plan_memory.sh."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction

import pytest

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import list_models, load_model
from megatron_ext.run_spec.model_size import count_model_parameters
from orchestration.analysis.memory_plan import (CUBLAS_WORKSPACE_BYTES, DEFAULT_BUS_BANDWIDTH_GBS, DEVICES, GB,
                                                MemoryRequest, dp_traffic, dp_traffic_bytes, estimate_activation_bytes,
                                                estimate_mfu, fp8_flops_share, layer_saved_tensors,
                                                parameters_outside_layers, plan_memory, plan_memory_request,
                                                state_bytes_per_parameter)
from orchestration.analysis.tables import format_memory_plan

from conftest import REPO, TEST_DATA, clean_env, run_script

QWEN3_1P7B = 1_720_574_976
ON_32_GPUS = dict(vocab_size=None, nnodes=4, nproc_per_node=8, seq_length=4096)  # 4 nodes x 8 GPUs, 4096 tokens
GBS2048 = dict(micro_batch_size=4, global_batch_size=2048, **ON_32_GPUS)  # qwen3_1p7b_gbs2048's batch on them


def moved(elements: int, nbytes: int, d: int = 32) -> int:
    """The bytes a ring collective over ``d`` GPUs moves per GPU: (d-1)/d of the buffer."""
    return math.ceil(elements * nbytes * Fraction(d - 1, d))


def stage_rows(text: str) -> dict[str, list[str]]:
    """The plan table's rows by stage: stage, params, grads, optimizer, states, ..."""
    return {line.split()[0]: line.split() for line in text.splitlines() if line[:2] in ("0 ", "1 ", "2 ", "3 ")}


@pytest.mark.parametrize("model", list_models())
def test_analytic_parameter_count_equals_the_megatron_core_model(model):
    import torch

    from megatron_ext.training.model import build_gpt_model, count_parameters

    preset = load_model(model)
    vocab = None if preset.vocab_size else 2048  # the smoke presets take the smoke tokenizer's 2,048
    ours, theirs = count_model_parameters(preset, vocab), count_parameters(preset, vocab)
    assert (ours.total, ours.embedding) == (theirs.total, theirs.embedding)
    with torch.device("meta"):  # what Megatron-FSDP's stage 3 gathers once a step: outside its TransformerLayer units
        built = build_gpt_model(preset, ours.padded_vocab, preset.max_position_embeddings, perform_initialization=False)
    in_layers = {id(p) for p in built.decoder.layers.parameters()}
    outside = sum(p.numel() for p in built.parameters() if id(p) not in in_layers)
    assert parameters_outside_layers(preset, vocab) == outside


def test_known_parameter_counts():
    assert count_model_parameters(load_model("gpt2")).total == 124_475_904
    qwen = count_model_parameters(load_model("qwen3_1p7b"))
    assert (qwen.total, qwen.non_embedding, qwen.padded_vocab) == (QWEN3_1P7B, 1_409_410_048, 151_936)
    untied = count_model_parameters(replace(load_model("qwen3_1p7b"), tie_embeddings=False))
    assert untied.total == 2_031_739_904
    with pytest.raises(UserError, match="give DATA or --vocab-size"):
        count_model_parameters(load_model("gpt_smoke"))


def test_qwen3_1p7b_on_32_gpus_model_states_exactly():
    plan = plan_memory(load_model("qwen3_1p7b"), micro_batch_size=1, **ON_32_GPUS)
    assert plan.parameters == QWEN3_1P7B and plan.num_gpus == 32
    assert plan.stage(0).states_bytes == 18 * QWEN3_1P7B == 30_970_349_568
    assert plan.stage(1).states_bytes == 6 * QWEN3_1P7B + 12 * QWEN3_1P7B // 32 == 10_968_665_472
    assert plan.stage(2).states_bytes == 2 * QWEN3_1P7B + 16 * QWEN3_1P7B // 32  # fp32 gradient shards: 4/d
    assert plan.stage(3).states_bytes == 18 * QWEN3_1P7B // 32
    assert plan.stage(2).grads_bytes == plan.stage(3).grads_bytes == 4 * QWEN3_1P7B // 32
    bf16 = plan_memory(load_model("qwen3_1p7b"), micro_batch_size=1, grad_reduce_in_bf16=True, **ON_32_GPUS)
    assert bf16.stage(2).states_bytes == 2 * QWEN3_1P7B + 14 * QWEN3_1P7B // 32  # the ZeRO paper's, bf16 shards
    assert bf16.stage(3).states_bytes == 16 * QWEN3_1P7B // 32
    assert [bf16.stage(s).states_bytes for s in (0, 1)] == [plan.stage(s).states_bytes for s in (0, 1)]
    s0 = plan.stage(0)
    assert (s0.params_bytes, s0.grads_bytes, s0.optimizer_bytes) == (2 * QWEN3_1P7B, 4 * QWEN3_1P7B, 12 * QWEN3_1P7B)
    row = stage_rows(format_memory_plan(plan))
    assert row["0"][4] == "31.0" and row["1"][4] == "11.0", row


@pytest.mark.parametrize("d", [2, 4])
def test_cpu_model_states_follow_the_formula_the_training_tests_measure(d):
    """tests/test_compare.py (2 CPU processes, every stage) and tests/test_training.py (4, stage 2) assert these figures against
    what the ranks hold."""
    from run_checks import expected_model_state

    psi = count_model_parameters(load_model("gpt_smoke"), 2048).total
    plan = plan_memory(load_model("gpt_smoke"), vocab_size=2048, nnodes=1, nproc_per_node=d, seq_length=128,
                       micro_batch_size=4, precision="fp32", device=DEVICES["cpu"])
    for stage, (between, peak) in expected_model_state(psi, d).items():
        assert plan.stage(stage).states_bytes == pytest.approx(between, abs=1)
        assert plan.stage(stage).states_peak_bytes == pytest.approx(peak, abs=1)


def test_bytes_per_parameter_tables():
    d = 8
    assert [state_bytes_per_parameter(s, d, "bf16").total for s in range(4)] == [
        18, 6 + Fraction(12, d), 2 + Fraction(16, d), Fraction(18, d)]
    assert [state_bytes_per_parameter(s, d, "bf16", grad_bytes=2).total for s in range(4)] == [
        18, 6 + Fraction(12, d), 2 + Fraction(14, d), Fraction(16, d)]
    assert [state_bytes_per_parameter(s, d, "fp32").total for s in range(4)] == [
        16, 8 + Fraction(8, d), Fraction(16, d), Fraction(16, d)]
    peak2 = state_bytes_per_parameter(2, d, "fp32")
    assert peak2.total + peak2.peak_extra == 4 + Fraction(12, d)


def test_activation_estimate_reproduces_korthikanti_for_the_gpt_layer():
    """GPT-2's layer with dropout: Korthikanti's 34 s*b*h bytes (their eq. 1 without the s x s
    score terms, which flash attention does not store; SdpaAttention's output reshape is a view)
    plus the fp32 norm statistics and log-sum-exp (2 x 2 + 12 values per token). The loss is 10
    bytes per logit where it was 6 (the bf16 logits and one fp32 copy): at its peak, the backward's
    start, the bf16 logits are freed and the fp32 softmax, its fp32 copy and the bf16 gradient held."""
    gpt = replace(load_model("gpt2"), hidden_dropout=0.1)
    s, b, h = 1024, 4, gpt.hidden_size
    acts = estimate_activation_bytes(gpt, s, b, 50_304, value_bytes=2, vocab=50_257)
    assert acts.per_layer == 34 * s * b * h + s * b * 16 * 4
    assert acts.outside_layers == s * b * (2 * 2 * h + 2 * 4 + h)  # final norm and output layer inputs, embedding mask
    assert acts.loss == s * b * 50_257 * 10 and acts.workspace == CUBLAS_WORKSPACE_BYTES
    assert acts.full == 12 * acts.per_layer + acts.outside_layers + acts.loss + acts.workspace
    assert acts.recompute == 12 * 2 * s * b * h + acts.outside_layers + acts.loss + acts.workspace
    cpu = estimate_activation_bytes(gpt, s, b, 50_304, value_bytes=4)  # the unfused, in-place fp32 cross entropy
    assert cpu.loss == s * b * 50_304 * 4 and cpu.workspace == 0


def test_qwen3_layer_keeps_what_megatron_core_and_torch_save():
    """Qwen3-1.7B's layer (GQA with 2 query heads per group, QK-norm, rotary, SwiGLU): 37,888 bf16
    values per token (4h + 4q + 3k + 3F: the grouped query's copy that its norm saves and the
    rotary outputs SDPA saves beside the QKV output it keeps through the key and value views) and
    42 fp32 (2 norms' rstd, the QK-norms' 16 + 8 rows, the 16 heads' log-sum-exp), plus the four
    rotary tables of s x 128 values."""
    qwen = load_model("qwen3_1p7b")
    tensors = layer_saved_tensors(qwen)
    assert sum(t.values for t in tensors if t.value_bytes is None) == 37_888
    assert sum(t.values for t in tensors if t.value_bytes == 4) == 42
    assert estimate_activation_bytes(qwen, 4096, 1, 151_936, 2).per_layer == 4096 * (37_888 * 2 + 42 * 4) + 4 * 4096 * 128 * 2
    llama = load_model("llama3_8b")  # no QK-norm: the grouped query's copy feeds rotary only and is freed
    assert not any("query regrouped" in t.what for t in layer_saved_tensors(llama))


def test_plan_within_5_percent_of_the_gpu_peak_at_every_stage_measured():
    """The GPU check's peak (torch.cuda.max_memory_allocated, tests/data/gpu_peak_memory.json, from
    benchmarks/results.md): Qwen3-1.7B, sequence 4096, micro batch 4, DP=1, 84.78 GiB at every stage
    with megatron-core 0.16.1 and 0.19.2. At one rank every stage's model states are 18 bytes per
    parameter (stages 2-3 ran as no_shard), so one plan serves every row: 84.77 GiB, where the
    plan before was 78.9 GB (73.5 GiB, 13% low)."""
    figures = json.loads((TEST_DATA / "gpu_peak_memory.json").read_text())
    plan = plan_memory(load_model(figures["model"]), vocab_size=None, nnodes=1, nproc_per_node=figures["data_parallel_size"],
                       seq_length=figures["seq_length"], micro_batch_size=figures["micro_batch_size"])
    assert len({s.states_peak_bytes for s in plan.stages}) == 1 and plan.stage(0).states_peak_bytes == 18 * QWEN3_1P7B
    for row in figures["rows"]:
        measured, planned = row["peak_gib"] * 2**30, plan.stage(row["stage"]).total_bytes
        assert abs(planned - measured) <= 0.05 * measured, (row, planned / 2**30)
    assert abs(plan.stage(0).total_bytes / 2**30 - 84.78) < 0.1  # what the terms add up to today


def test_data_parallel_traffic_per_micro_batch_as_megatron_core_moves_it():
    """Per GPU per step of a micro-batches (benchmarks/dp_traffic.py measures these within 0.2% on
    megatron-core's objects): DDP reduces once, Megatron-FSDP at every micro-batch; stage 3 gathers
    every layer before each forward and backward and the rest (Psi_o) once."""
    psi, d, outside = QWEN3_1P7B, 32, 311_166_976
    v = lambda elements, nbytes: moved(elements, nbytes, d)  # noqa: E731
    for a in (1, 4, 16):
        for g in (4, 2):
            got = [dp_traffic_bytes(s, psi, d, g, 2, micro_batches=a, outside_layers=outside) for s in range(4)]
            assert got == [2 * v(psi, g), v(psi, g) + v(psi, 2), a * v(psi, g) + v(psi, 2),
                           a * v(psi, g) + (2 * a) * v(psi - outside, 2) + v(outside, 2)], (a, g)
    assert dp_traffic_bytes(0, psi, 1, 4, 2, micro_batches=8) == 0
    # what each part hides behind (estimate_mfu reads these)
    assert dp_traffic(1, psi, d, 4, 2, 16) == dp_traffic(1, psi, d, 4, 2, 1)  # once a step, whatever a
    t2, t3 = dp_traffic(2, psi, d, 4, 2, 16), dp_traffic(3, psi, d, 4, 2, 16, outside)
    assert (t2.backwards, t2.after_step) == (16 * v(psi, 4), v(psi, 2))
    assert (t3.forwards, t3.backwards) == (16 * v(psi - outside, 2) + v(outside, 2), 16 * (v(psi, 4) + v(psi - outside, 2)))
    # the CPU path (torch, fp32): DDP once; ZeRO broadcasts the update; FSDP2 gathers every forward
    # (stage 3 every backward too) and reduce-scatters once
    cpu = [dp_traffic_bytes(s, psi, d, 4, 4, micro_batches=4, precision="fp32") for s in range(4)]
    assert cpu == [2 * v(psi, 4), 3 * v(psi, 4), 5 * v(psi, 4), 9 * v(psi, 4)]
    with pytest.raises(UserError, match="micro_batches=0 must be >= 1"):
        dp_traffic(2, psi, d, 4, 2, micro_batches=0)


def test_qwen3_1p7b_gbs2048_on_32_gpus_traffic_as_the_command_plans_it():
    """Issue 39's geometry: 16 micro-batches per GPU per step; Megatron-FSDP's per-micro-batch
    reduce-scatters make stages 2-3 ~110 and ~195 GB per GPU per step (the plan said 10.0 and
    13.3 GB, the ZeRO paper's once-a-step volumes)."""
    plan = plan_memory_request(MemoryRequest(model="qwen3_1p7b", data="qwen3_1p7b_gbs2048"), 4, 8, None)
    assert (plan.num_gpus, plan.gradient_accumulation_steps, plan.global_batch_size) == (32, 16, 2048)
    psi, outside = plan.parameters, plan.parameters_outside_layers
    assert outside == 311_166_976  # embedding (tied) + final norm
    traffic = [plan.stage(s).traffic_bytes for s in range(4)]
    assert traffic[2] == 16 * moved(psi, 4) + moved(psi, 2)
    assert traffic[3] == 16 * moved(psi, 4) + 32 * moved(psi - outside, 2) + moved(outside, 2)
    assert [round(t / GB, 1) for t in traffic] == [13.3, 10.0, 110.0, 194.7]
    assert plan.stage(2).traffic_s == pytest.approx(traffic[2] / (DEFAULT_BUS_BANDWIDTH_GBS * GB))
    rows = stage_rows(format_memory_plan(plan))
    assert [rows[s][-4:-2] for s in "0123"] == [["13.3", "GB"], ["10.0", "GB"], ["110.0", "GB"], ["194.7", "GB"]]
    bf16 = plan_memory_request(MemoryRequest(model="qwen3_1p7b", data="qwen3_1p7b_gbs2048", grad_reduce_in_bf16=True), 4, 8, None)
    assert bf16.stage(2).traffic_bytes == 16 * moved(psi, 2) + moved(psi, 2)
    proc = run_script("plan_memory.sh", "qwen3_1p7b", "qwen3_1p7b_gbs2048", env=clean_env(NNODES="4", NPROC_PER_NODE="8"))
    assert proc.returncode == 0, proc.stderr
    assert [stage_rows(proc.stdout)[s][-4] for s in "0123"] == ["13.3", "10.0", "110.0", "194.7"], proc.stdout
    assert "traffic per step of 16 micro-batches per GPU, megatron-core" in proc.stdout
    with pytest.raises(UserError, match=r"global_batch_size=100 is not divisible by micro_batch_size\(4\) x "
                                        r"data-parallel size\(32\) = 128; change one of them \(e.g. global_batch_size=128\)"):
        plan_memory(load_model("qwen3_1p7b"), micro_batch_size=4, global_batch_size=100, **ON_32_GPUS)


def test_the_sequence_planned_is_one_the_model_holds():
    """plan-memory plans no sequence the model cannot train: --seq-length longer than its positions is
    refused as a data set's is; without one, 4096 or the model's positions where fewer."""
    with pytest.raises(UserError, match=r"^--seq-length=1024 is longer than model gpt_smoke's max_position_embeddings=256: "
                                        r".*set it to at most 256"):
        plan_memory_request(MemoryRequest(model="gpt_smoke", vocab_size=2048, seq_length=1024), 1, 2, None)
    assert plan_memory_request(MemoryRequest(model="gpt_smoke", vocab_size=2048), 1, 2, None).seq_length == 256
    assert plan_memory_request(MemoryRequest(model="qwen3_1p7b"), 1, 2, None).seq_length == 4096


def test_lowest_stage_that_fits():
    qwen = load_model("qwen3_1p7b")
    kwargs = dict(micro_batch_size=1, **ON_32_GPUS)
    assert plan_memory(qwen, **kwargs).lowest_fitting_stage == 0  # H200: 46 GB of 126.9 GB usable
    small = plan_memory(qwen, device_bytes=24 * GB, **kwargs)
    assert [s.fits for s in small.stages] == [False, False, True, True] and small.lowest_fitting_stage == 2
    assert "lowest stage that fits in 24.0 GB with 10% headroom: stage 2" in format_memory_plan(small)
    tiny = plan_memory(qwen, device_bytes=13 * GB, **kwargs)  # recompute keeps the loss's 6.2 GB: stage 2 at 11.1 GB
    assert tiny.lowest_fitting_stage is None and tiny.lowest_fitting_stage_recompute == 2
    assert "with full activation recomputation: stage 2" in format_memory_plan(tiny)
    none = plan_memory(qwen, device_bytes=4 * GB, **kwargs)
    assert "no stage fits" in format_memory_plan(none) and none.lowest_fitting_stage_recompute is None


def test_plan_memory_script_for_32_gpus():
    proc = run_script("plan_memory.sh", "qwen3_1p7b", "qwen3_1p7b_smoke", "--device", "h100", env=clean_env(NNODES="4", NPROC_PER_NODE="8"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1,720,574,976 parameters" in out and "32 GPUs (4 node(s) x 8)" in out and "H100 80 GB" in out
    rows = stage_rows(out)
    assert rows["0"][4] == "31.0" and rows["1"][4] == "11.0"
    assert "lowest stage that fits in 80.0 GB with 10% headroom: stage 0" in out
    assert "at 331 GB/s" in out and "Korthikanti et al. 2022" in out and "compute per step at 40% MFU" in out
    as_json = run_script("plan_memory.sh", "qwen3_1p7b", "--gpus", "1024", "--json", env=clean_env(GPU_MEMORY_GB="80"))
    plan = json.loads(as_json.stdout)
    assert plan["num_gpus"] == 1024 and plan["device_bytes"] == 80 * GB
    assert plan["stages"][1]["states_bytes"] == 6 * QWEN3_1P7B + 12 * QWEN3_1P7B // 1024
    bad = run_script("plan_memory.sh", "qwen3_1p7b", env=clean_env(GPU_MEMORY_GB="lots"))
    assert bad.returncode == 2 and bad.stderr.strip() == "error: GPU_MEMORY_GB='lots' must be a number of GB, e.g. 80"


def test_launcher_side_never_imports_torch():
    code = ("import sys, orchestration.cli, orchestration.analysis.memory_plan, orchestration.analysis.comparison_files, "
            "orchestration.runner.sweep; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_mfu_estimate_for_the_users_geometry():
    """qwen3_1p7b_gbs2048's geometry on 4 x 8 H200: compute dominates (~7.8 s a step at the assumed
    40%), so every stage's estimate is near 40%; stage 2's one gather after the update is the
    exposed traffic; stage 3's ~195 GB hide behind 16 forwards and backwards."""
    plan = plan_memory(load_model("qwen3_1p7b"), **GBS2048)
    assert plan.peak_tflops == 989.0 and [e.stage for e in plan.mfu_estimates] == [0, 1, 2, 3]
    assert plan.gradient_accumulation_steps == 16 and plan.fp8_peak_tflops is None
    for e in plan.mfu_estimates:
        assert 0.39 < e.mfu <= plan.assumed_mfu and e.step_s == pytest.approx(e.compute_s + e.exposed_traffic_s + e.optimizer_s)
    after_update = dp_traffic(2, plan.parameters, 32, 4, 2, 16).after_step
    assert plan.mfu_estimates[2].exposed_traffic_s == pytest.approx(after_update / (DEFAULT_BUS_BANDWIDTH_GBS * GB))
    assert plan.mfu_estimates[3].exposed_traffic_s == 0
    text = format_memory_plan(plan)
    assert "MFU estimate against the dense BF16 peak (989 TFLOP/s): stage 0 40.0%" in text, text
    # The traffic shows once compute no longer hides it: one GPU's worth of work spread over 32.
    small = estimate_mfu(0, plan.parameters, 32, 1e12, 989.0, 0.4, 4, 4800.0, 50.0)
    assert small.exposed_traffic_s > 0 and small.mfu < 0.1


def test_reductions_hide_behind_the_compute_they_overlap():
    """DDP's one all-reduce overlaps only the last micro-batch's backward (no_sync before it);
    Megatron-FSDP's reduce-scatters spread over every backward."""
    psi, d, bus = QWEN3_1P7B, 32, 331.0
    allreduce_s = dp_traffic_bytes(0, psi, d, 4, 2) / (bus * GB)  # ~40 ms
    flops = allreduce_s * 3 * d * 989e12 * 0.4  # backward = 2/3 of the compute = 2 x the all-reduce
    one = estimate_mfu(0, psi, d, flops, 989.0, 0.4, 4, 4800.0, bus)
    eight = estimate_mfu(0, psi, d, flops, 989.0, 0.4, 4, 4800.0, bus, micro_batches=8)
    assert one.exposed_traffic_s == 0
    assert eight.exposed_traffic_s == pytest.approx(allreduce_s - 2 * allreduce_s / 8)
    stage2 = estimate_mfu(2, psi, d, flops, 989.0, 0.4, 4, 4800.0, bus, micro_batches=8)
    t = dp_traffic(2, psi, d, 4, 2, 8)
    assert stage2.exposed_traffic_s == pytest.approx(max(0.0, t.backwards / (bus * GB) - 2 * allreduce_s)
                                                     + t.after_step / (bus * GB))


def test_fp8_mfu_is_against_the_bf16_peak():
    """Issue 39, finding 5: MFU against the dense BF16 peak with FP8 too; the compute time takes
    the FP8 peak for the linear layers' share (core attention and logits, ~28% for Qwen3-1.7B at
    4096, stay BF16)."""
    qwen = load_model("qwen3_1p7b")
    share = fp8_flops_share(qwen, 4096, 151_936)
    assert share == pytest.approx(8_455_716_864 / 11_731_992_576) and 0.71 < share < 0.73
    bf16, fp8 = plan_memory(qwen, **GBS2048), plan_memory(qwen, fp8=True, **GBS2048)
    assert (fp8.peak_tflops, fp8.fp8_peak_tflops, fp8.fp8_flops_share) == (989.0, 1979.0, share)
    assert fp8.compute_s == pytest.approx(bf16.compute_s * ((1 - share) + share * 989.0 / 1979.0))
    for b, f in zip(bf16.mfu_estimates, fp8.mfu_estimates):  # the same FLOPs over the same peak, in less time
        assert f.mfu == pytest.approx(b.mfu * b.step_s / f.step_s) and f.mfu > b.mfu
    assert 0.60 < fp8.mfu_estimates[1].mfu < 0.64  # 0.40 / (0.28 + 0.72 / 2)
    text = format_memory_plan(fp8)
    assert "MFU estimate against the dense BF16 peak (989 TFLOP/s, with FP8 too): stage 0 " in text, text
    assert "FP8 peak (1979 TFLOP/s) for the linear layers' 72% of the FLOPs, BF16 for core attention and logits" in text
