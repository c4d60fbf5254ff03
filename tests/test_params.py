"""Parameter sets: every preset loads, unknown keys and bad values are clear errors."""

from __future__ import annotations

import re

import pytest

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import (
    RunOverrides, TrainingParams, batch_geometry, list_data_sets, list_models, load_data_set, load_model, load_run_params,
    read_overrides,
)
from megatron_ext.training.loop import cpu_threads, learning_rate
from megatron_ext.training.megatron_core_releases import check_megatron_core
from megatron_ext.run_spec.zero import ZeroStage, parse_zero_stage


@pytest.mark.parametrize("model", list_models())
@pytest.mark.parametrize("data", list_data_sets())
def test_every_model_loads_with_every_data_set_whose_sequence_it_holds(model, data):
    """A pair loads as written, or is refused: a data set's sequence longer than the model's positions
    (gpt2_smoke's 1024 on gpt_smoke's 256) is never cut to fit without a word."""
    seq_length = load_data_set(data)[1].seq_length
    positions = load_model(model).max_position_embeddings
    if seq_length > positions:
        with pytest.raises(UserError) as refused:
            load_run_params(model, data)
        assert (f"data/{data}.yaml:training.seq_length={seq_length} is longer than model {model}'s "
                f"max_position_embeddings={positions}") in str(refused.value)
        assert f"set it to at most {positions}" in str(refused.value)
        return
    p = load_run_params(model, data)
    assert p.training.seq_length == seq_length and p.training.zero_stage == 0


@pytest.mark.parametrize("model,data", [("gpt_smoke", "smoke"), ("qwen3_smoke", "smoke"), ("gpt2", "gpt2_smoke"),
                                        ("qwen3_1p7b", "qwen3_1p7b_smoke"), ("qwen3_1p7b", "qwen3_1p7b_gbs2048"),
                                        ("llama3_8b", "qwen3_1p7b_smoke")])
def test_the_pairs_the_docs_and_scripts_use_hold_their_sequence(model, data):
    assert load_run_params(model, data).training.seq_length == load_data_set(data)[1].seq_length


def test_required_presets_exist():
    assert {"gpt_smoke", "gpt2", "qwen3_1p7b"} <= set(list_models())
    assert {"smoke", "qwen3_1p7b_smoke"} <= set(list_data_sets())


@pytest.mark.parametrize("positions,kind,fix", [
    (256, "learned_absolute", "use a model with at least that many positions"),
    (64, "rope", "raise max_position_embeddings in a preset of your own"),
])
def test_a_sequence_longer_than_the_model_s_positions_is_refused(tmp_path, positions, kind, fix):
    """Value, rule and fix in one error (it used to train at the model's length and say nothing)."""
    model = tmp_path / "short.yaml"
    model.write_text("num_layers: 1\nhidden_size: 32\nffn_hidden_size: 64\nnum_attention_heads: 2\n"
                     f"max_position_embeddings: {positions}\nposition_embedding_type: {kind}\n")
    data = tmp_path / "long.yaml"
    data.write_text("data: {source: embedded}\ntraining: {seq_length: 100000000}\n")
    with pytest.raises(UserError) as refused:
        load_run_params(str(model), str(data))
    assert str(refused.value).startswith(
        f"{data}:training.seq_length=100000000 is longer than model short's max_position_embeddings={positions}: "
        f"a sequence cannot have more tokens than the model has positions; set it to at most {positions}, or {fix}")


def test_zero_stage_from_environment_overrides_params():
    assert [parse_zero_stage(str(i)) for i in range(4)] == list(ZeroStage)
    assert load_run_params("gpt_smoke", "smoke", read_overrides({"ZERO_STAGE": "3"})).training.zero_stage == 3
    assert load_run_params("gpt_smoke", "smoke", RunOverrides(engine="megatron-lm")).training.engine == "megatron-lm"
    with pytest.raises(UserError, match="ENGINE='deepspeed' is not an engine"):
        read_overrides({"ENGINE": "deepspeed"})


@pytest.mark.parametrize("value", ["7", "-1", "two", "1.5", ""])
def test_bad_zero_stage_is_one_clear_error(value):
    with pytest.raises(UserError, match="is not a ZeRO stage; use 0"):
        parse_zero_stage(value)


@pytest.mark.parametrize("text,message", [
    ("data: {source: embedded}\ntraining: {micro_batch_sise: 4}\n", r"unknown key 'micro_batch_sise'.*known keys:.*micro_batch_size"),
    ("data:\n  source: files\n  paths: [a, b\ntraining: {train_iters: 3}\n", r"{bad}:4:9: not valid YAML \(expected ',' or '\]'"),
    ("training: {train_iters: ten}\n", r"train_iters='ten' must be int"),
], ids=["unknown_key", "not_yaml", "wrong_type"])
def test_a_bad_data_file_is_one_clear_error(tmp_path, text, message):
    """An unknown key names the known ones; YAML that does not parse names file, line and column; a wrong type is named."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(UserError, match=message.replace("{bad}", re.escape(str(bad)))):
        load_run_params("gpt_smoke", str(bad))


@pytest.mark.parametrize("model,data,message", [
    ("gpt_smoke", "/nope/data.yaml", r"^data set file /nope/data\.yaml does not exist; give an existing \.yaml file, or one of the "
                                     r"data sets under .*smoke"),  # named as a file, with the data sets there are
    ("gpt5", "smoke", r"unknown model 'gpt5'.*gpt_smoke"),  # with the choices
], ids=["data_file_not_there", "unknown_model"])
def test_a_missing_model_or_data_set_is_named(model, data, message):
    with pytest.raises(UserError, match=re.compile(message, re.S)):
        load_run_params(model, data)


def test_batch_geometry_message_names_all_three():
    t = TrainingParams(micro_batch_size=16, global_batch_size=512)
    with pytest.raises(UserError) as err:
        batch_geometry(t, 24)
    assert "global_batch_size=512 is not divisible by micro_batch_size(16) x data_parallel_size(24) = 384" in str(err.value)
    assert "global_batch_size=384" in str(err.value)
    assert batch_geometry(t, 8).accumulation_steps == 4


def test_learning_rate_warmup_then_cosine():
    t = TrainingParams(lr=1.0, min_lr=0.1, lr_warmup_iters=4, train_iters=20)
    assert learning_rate(t, 1) == pytest.approx(0.25)
    assert learning_rate(t, 4) == pytest.approx(1.0)
    assert learning_rate(t, 20) == pytest.approx(0.1)
    lrs = [learning_rate(t, i) for i in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("omp, cpus, local_ranks, threads", [
    (None, 8, 2, 4), (None, 2, 1, 2), (None, 2, 4, 1), (None, None, 1, 1),  # the cores, shared by the node's ranks
    ("", 8, 2, 4), (" ", 2, 1, 2),  # set empty: OpenMP ignores it, and so does the rank
    ("1", 8, 1, None), ("6", 8, 2, None),  # OMP_NUM_THREADS set (the user's, torchrun's): torch's own reading stands
])
def test_a_cpu_rank_takes_its_share_of_the_cores_unless_omp_num_threads_is_set(omp, cpus, local_ranks, threads):
    assert cpu_threads(omp, cpus, local_ranks) == threads


def test_megatron_core_version_gate():
    for tested in ("0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2", "0.16.0rc1"):
        assert check_megatron_core(tested) == (tested, None)
    for old in ("0.13.1", "0.9.0"):
        with pytest.raises(UserError, match=r"outside the tested range 0.14-0.19 \(tested: 0.14.0, .*0.19.2\)") as err:
            check_megatron_core(old, allow_untested=True)  # never for older releases
        assert "MEGATRON_EXT_ALLOW_UNTESTED" not in str(err.value)
    with pytest.raises(UserError, match=r"megatron-core 0.20.0 is outside .* set MEGATRON_EXT_ALLOW_UNTESTED=1"):
        check_megatron_core("0.20.0")
    version, warning = check_megatron_core("0.20.0", allow_untested=True)
    assert version == "0.20.0" and warning.startswith("warning: megatron-core 0.20.0 is newer than the tested releases")
