"""Exact parameter counts and FLOPs of the presets, on the meta device (no memory)."""

from __future__ import annotations

import pytest

from megatron_ext.run_spec.flops import flops_per_token, padded_vocab_size
from megatron_ext.run_spec.iteration_log import IterationRecord, format_iteration_line, parse_iteration_line
from megatron_ext.training.model import count_parameters

from conftest import TEST_DATA
from megatron_ext.run_spec.params import load_model


def test_qwen3_1p7b_exact():
    c = count_parameters(load_model("qwen3_1p7b"))
    assert c.total == 1_720_574_976
    assert c.non_embedding == 1_409_410_048


def test_gpt2_small_exact():
    # GPT-2 small in megatron-core: vocab 50,257 padded to 50,304 (multiple of 128), tied.
    h, L, V, P, F = 768, 12, padded_vocab_size(50257, 128), 1024, 3072
    per_layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * F + F) + (F * h + h)
    expected = V * h + P * h + L * per_layer + 2 * h
    c = count_parameters(load_model("gpt2"))
    assert V == 50304
    assert c.total == expected == 124_475_904
    assert c.total - (V - 50257) * h == 124_439_808  # the published (unpadded) GPT-2 small size


@pytest.mark.parametrize("seq,gflop", [(2048, 11.03), (4096, 11.73), (8192, 13.14)])
def test_qwen3_flops_per_token(seq, gflop):
    assert flops_per_token(load_model("qwen3_1p7b"), seq, 151936) / 1e9 == pytest.approx(gflop, abs=0.005)


def test_iteration_line_is_megatron_format():
    """The same bytes Megatron-LM core_v0.16.1's training_log prints for the same values (the line in
    tests/data was produced by running that function's own statements, see make_iteration_line.py)."""
    real = (TEST_DATA / "megatron_lm" / "iteration_line_core_v0.16.1.txt").read_text().splitlines()
    for line, (it, ms, tflops, lr, loss, gnorm) in zip(real, [(1, 2050.3, 310.2, 6e-5, 11.95312, 12.345),
                                                              (2, 1000.0, 455.1, 1.2e-4, 11.02344, 8.5)], strict=True):
        r = IterationRecord(iteration=it, train_iters=10, consumed_samples=32 * it, lm_loss=loss, lr=lr, grad_norm=gnorm,
                            step_time_s=ms / 1000, tokens_per_s=1.0, tflops_per_gpu=tflops, global_batch_size=32,
                            world_size=32, zero_stage=1)
        timestamp = line[2:line.index("]")]
        assert format_iteration_line(r, timestamp=timestamp) == line
        back = parse_iteration_line(line, seq_length=4096)
        assert (back.iteration, back.consumed_samples, back.lm_loss, back.grad_norm) == (it, 32 * it, loss, gnorm)


def test_iteration_line_round_trip():
    """The one parser reads back what the program prints (both engines print this line)."""
    r = IterationRecord(iteration=7, train_iters=30, consumed_samples=112, lm_loss=6.123456, lr=2.5e-3, grad_norm=0.75,
                        step_time_s=0.25, tokens_per_s=16 * 128 / 0.25, tflops_per_gpu=0.1, global_batch_size=16,
                        world_size=2, zero_stage=3)
    back = parse_iteration_line(format_iteration_line(r), seq_length=128, world_size=2, zero_stage=3)
    for field in ("iteration", "train_iters", "consumed_samples", "global_batch_size", "world_size", "zero_stage"):
        assert getattr(back, field) == getattr(r, field), field
    for field in ("lm_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "tflops_per_gpu"):
        assert getattr(back, field) == pytest.approx(getattr(r, field), rel=1e-3), field
