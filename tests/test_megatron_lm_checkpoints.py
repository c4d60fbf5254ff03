"""Megatron-LM checkpoints in and out, without a Megatron-LM process: the folder layout, the keys,
the round trip through this program's writer and reader (and megatron-core's dist_checkpointing
directly), the torch format, bad input as one message, and the render of training.init_checkpoint.

    python3 -m pytest -q tests/test_megatron_lm_checkpoints.py

The keys below are the model tensors Megatron-LM core_v0.16.1's own pretrain_gpt.py wrote for
gpt_smoke (2 CPU ranks through tests/megatron_lm_shim, --transformer-impl local, stage 0): the
local spec's norms under transformer-engine's names, every layer stacked on a leading axis.
tests/test_engines_agree.py loads such checkpoints in both directions with the real program.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from conftest import write_data_set
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.megatron_lm_checkpoints import (
    check_loadable_by_megatron_lm, find_megatron_lm_checkpoint, pretrained_checkpoint_dir,
)
from megatron_ext.run_spec.params import RunOverrides, load_model, load_run_params, with_batch_geometry
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.launch_env import read_launch_env
from orchestration.runner.start_plan import read_start_inputs

MEGATRON_LM_GPT_SMOKE_KEYS = {  # global key -> shape, as Megatron-LM wrote them (vocabulary 2048 rows here)
    "embedding.word_embeddings.weight": (2048, 128), "embedding.position_embeddings.weight": (256, 128),
    "decoder.final_layernorm.weight": (128,), "decoder.final_layernorm.bias": (128,),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (4, 128),
    "decoder.layers.self_attention.linear_qkv.layer_norm_bias": (4, 128),
    "decoder.layers.self_attention.linear_qkv.weight": (4, 384, 128), "decoder.layers.self_attention.linear_qkv.bias": (4, 384),
    "decoder.layers.self_attention.linear_proj.weight": (4, 128, 128), "decoder.layers.self_attention.linear_proj.bias": (4, 128),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (4, 128), "decoder.layers.mlp.linear_fc1.layer_norm_bias": (4, 128),
    "decoder.layers.mlp.linear_fc1.weight": (4, 512, 128), "decoder.layers.mlp.linear_fc1.bias": (4, 512),
    "decoder.layers.mlp.linear_fc2.weight": (4, 128, 512), "decoder.layers.mlp.linear_fc2.bias": (4, 128),
}


@pytest.fixture(scope="module")
def cpu_megatron():
    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.model import ensure_model_parallel

    ensure_model_parallel()
    install_megatron_on_cpu(1234)


def build(preset: str, vocab: int = 2048, dtype=torch.float32, seed: int = 0):
    from megatron_ext.training.model import build_gpt_model

    torch.manual_seed(seed)
    return build_gpt_model(load_model(preset), vocab, 128, params_dtype=dtype)


def tensors(module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def stored(directory: Path) -> dict[str, tuple]:
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(directory)).items()}


# -- the layout (no torch) ----------------------------------------------------------------------------

def test_a_save_folder_or_one_of_its_iteration_folders(tmp_path):
    save = tmp_path / "save"
    for it in (5, 10):
        (save / f"iter_{it:07d}").mkdir(parents=True)
        (save / f"iter_{it:07d}" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (save / "latest_checkpointed_iteration.txt").write_text("10\n")
    latest = find_megatron_lm_checkpoint(save)
    assert (latest.directory.name, latest.iteration, latest.format, latest.latest) == ("iter_0000010", 10, "torch_dist", True)
    older = find_megatron_lm_checkpoint(save / "iter_0000005")
    assert (older.iteration, older.latest, older.save_dir) == (5, False, save.resolve())
    check_loadable_by_megatron_lm(latest)
    with pytest.raises(UserError, match=r"ENGINE=megatron-lm starts from the iteration .*names iter_0000010; give that folder"):
        check_loadable_by_megatron_lm(older)
    data = write_data_set(tmp_path / "init.yaml", 4)  # a start is refused so, before anything starts
    Path(data).write_text(Path(data).read_text() + f"  init_checkpoint: {save / 'iter_0000005'}\n")
    launch = read_launch_env({"ARTIFACT_ROOT": str(tmp_path / "art"), "ENGINE": "megatron-lm"})
    with pytest.raises(UserError, match=r"names iter_0000010; give that folder"):
        read_start_inputs(launch, "gpt_smoke", data, "r", [(0, "localhost")])
    assert pretrained_checkpoint_dir(str(save / "iter_0000005")) == str(save)
    assert pretrained_checkpoint_dir(str(save)) == str(save)
    assert pretrained_checkpoint_dir(str(save / "release")) == str(save)
    (save / "release" / "mp_rank_00").mkdir(parents=True)
    (save / "release" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    release = find_megatron_lm_checkpoint(save)
    assert (release.directory.name, release.iteration, release.format) == ("release", 0, "torch")


@pytest.mark.parametrize("case, message", [
    ("missing", r"training.init_checkpoint=.*/nothing does not exist or is not a folder"),
    ("no_tracker", r"is not a Megatron-LM checkpoint: no latest_checkpointed_iteration.txt \(it holds iter_0000003: give one"),
    ("bad_tracker", r"latest_checkpointed_iteration.txt holds 'soon', neither an iteration nor 'release'"),
    ("tracker_names_missing", r"latest_checkpointed_iteration.txt names iter_0000007, which is missing"),
    ("empty_iteration", r"iter_0000003 is not a Megatron-LM checkpoint: no metadata.json \(torch_dist\) and no "
                        r"mp_rank_00/model_optim_rng.pt \(torch format\); it holds nothing"),
    ("fsdp_dtensor", r"without metadata.json: Megatron-FSDP's fsdp_dtensor format"),
    ("tensor_parallel", r"several model-parallel ranks \(mp_rank_00, mp_rank_01\)"),
    ("other_backend", r"names sharded backend 'zarr'"),
])
def test_what_is_not_a_megatron_lm_checkpoint_is_one_message(tmp_path, case, message):
    save = tmp_path / "save"
    it = save / "iter_0000003"
    it.mkdir(parents=True)
    target = save
    if case == "missing":
        target = tmp_path / "nothing"
    elif case == "bad_tracker":
        (save / "latest_checkpointed_iteration.txt").write_text("soon")
    elif case == "tracker_names_missing":
        (save / "latest_checkpointed_iteration.txt").write_text("7")
    elif case == "empty_iteration":
        target = it
    elif case == "fsdp_dtensor":
        (it / ".metadata").write_bytes(b"")
        target = it
    elif case == "tensor_parallel":
        for rank in ("mp_rank_00", "mp_rank_01"):
            (it / rank).mkdir()
            (it / rank / "model_optim_rng.pt").write_bytes(b"")
        target = it
    elif case == "other_backend":
        (it / "metadata.json").write_text('{"sharded_backend": "zarr"}')
        target = it
    with pytest.raises(UserError, match=message):
        find_megatron_lm_checkpoint(target)


# -- tensors: keys, round trip, dtypes, mismatches --------------------------------------------------------

def test_written_keys_are_megatron_lm_s(cpu_megatron, tmp_path):
    from megatron_ext.training.megatron_lm_weights import write_megatron_lm_checkpoint

    written = write_megatron_lm_checkpoint(build("gpt_smoke"), tmp_path / "save", 0)
    assert stored(written) == MEGATRON_LM_GPT_SMOKE_KEYS
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text() == "0"


@pytest.mark.parametrize("preset, dtype", [("qwen3_smoke", torch.float32), ("gpt_smoke", torch.bfloat16)])
def test_round_trip_through_the_writer_the_reader_and_dist_checkpointing(cpu_megatron, tmp_path, preset, dtype):
    """SwiGLU's fc1 (a sharded factory of gate and up), QK norms and GQA (qwen3_smoke); biases,
    LayerNorm, learned positions in bf16 (gpt_smoke: the dtype stays as written until the model casts it)."""
    from megatron.core import dist_checkpointing
    from megatron_ext.training.megatron_lm_weights import load_megatron_lm_weights, read_megatron_lm_weights, write_megatron_lm_checkpoint
    from megatron_ext.training.model import build_gpt_model

    source = build(preset, dtype=dtype, seed=1)
    write_megatron_lm_checkpoint(source, tmp_path / "save", 12)
    checkpoint = find_megatron_lm_checkpoint(tmp_path / "save")
    assert (checkpoint.iteration, checkpoint.format) == (12, "torch_dist")
    with torch.device("meta"):
        template = build_gpt_model(load_model(preset), 2048, 128, perform_initialization=False)
    read = read_megatron_lm_weights(checkpoint, template, preset)
    want = {k: v for k, v in tensors(source).items() if not k.endswith("_extra_state")}
    assert set(read) == set(want)
    assert all(torch.equal(read[k], want[k]) and read[k].dtype == want[k].dtype for k in want)
    assert read["embedding.word_embeddings.weight"].dtype == dtype
    target = build(preset, seed=2)  # fp32: the load casts
    load_megatron_lm_weights(target, checkpoint, preset)
    assert all(torch.equal(tensors(target)[k], want[k].float()) for k in want)
    # megatron-core's own loader, with the model's sharded state dict as Megatron-LM builds it
    from megatron_ext.training.megatron_lm_weights import sharded_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = dist_checkpointing.load({"model": build(preset, dtype=dtype, seed=3).sharded_state_dict(metadata=sharded_metadata())},
                                         str(checkpoint.directory))
        common = dist_checkpointing.load_common_state_dict(str(checkpoint.directory))
    assert all(torch.equal(direct["model"][k], want[k]) for k in want)
    assert common["iteration"] == 12 and common["checkpoint_version"] == 3.0
    assert (common["args"].tensor_model_parallel_size, common["args"].pipeline_model_parallel_size) == (1, 1)


def test_a_checkpoint_of_another_model_is_one_message(cpu_megatron, tmp_path):
    from megatron_ext.training.megatron_lm_weights import load_megatron_lm_weights, write_megatron_lm_checkpoint
    from megatron_ext.training.model import build_gpt_model

    write_megatron_lm_checkpoint(build("gpt_smoke", vocab=2176), tmp_path / "save", 6)
    checkpoint = find_megatron_lm_checkpoint(tmp_path / "save")
    with pytest.raises(UserError, match=r"iter_0000006 \(torch_dist, iteration 6\): embedding.word_embeddings.weight is "
                                        r"\(2176, 128\) there and \(2048, 128\) in model gpt_smoke: the vocabulary differs"):
        load_megatron_lm_weights(build("gpt_smoke"), checkpoint, "gpt_smoke")
    six = dataclasses.replace(load_model("gpt_smoke"), num_layers=6)
    with pytest.raises(UserError, match=r"decoder.layers.self_attention.linear_qkv.layer_norm_weight is \(4, 128\) there and "
                                        r"\(6, 128\) in model deep: the number of layers differs"):
        load_megatron_lm_weights(build_gpt_model(six, 2176, 128), checkpoint, "deep")
    with pytest.raises(UserError, match=r"holds no decoder.layers.self_attention.k_layernorm.weight .* it is not a "
                                        r"checkpoint of model qwen3_smoke"):
        load_megatron_lm_weights(build("qwen3_smoke", vocab=2176), checkpoint, "qwen3_smoke")


@pytest.mark.parametrize("transformer_engine_names", [False, True])
def test_the_torch_format(cpu_megatron, tmp_path, transformer_engine_names):
    """``mp_rank_00/model_optim_rng.pt`` holding ``state_dict_for_save_checkpoint()`` (checkpointing.py
    L911), as Megatron-LM writes it with --ckpt-format torch, from the local spec or (GPU runs)
    transformer-engine's, whose norms are fused into the next linear layer."""
    from megatron_ext.training.hf_weights import to_model_names
    from megatron_ext.training.megatron_lm_weights import load_megatron_lm_weights

    source = build("qwen3_smoke", seed=4)
    model = source.state_dict_for_save_checkpoint()
    if transformer_engine_names:
        model = to_model_names(model, {"x.layer_norm_weight"})
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model
    folder = tmp_path / "save" / "iter_0000009" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"model": model, "checkpoint_version": 3.0, "iteration": 9, "args": argparse.Namespace()},
               folder / "model_optim_rng.pt")
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("9")
    checkpoint = find_megatron_lm_checkpoint(tmp_path / "save")
    assert checkpoint.format == "torch"
    target = build("qwen3_smoke", seed=5)
    load_megatron_lm_weights(target, checkpoint, "qwen3_smoke")
    assert all(torch.equal(v, tensors(source)[k]) for k, v in tensors(target).items())
    torch.save({"model": model, "checkpoint_version": 2.0}, folder / "model_optim_rng.pt")
    with pytest.raises(UserError, match=r"has checkpoint_version 2.0; versions before 3.0 store query/key/value in another order"):
        load_megatron_lm_weights(target, checkpoint, "qwen3_smoke")


# -- the data set field on both engines ----------------------------------------------------------------------

def test_init_checkpoint_renders_megatron_lm_s_pretrained_checkpoint_and_the_same_vocabulary(tmp_path):
    from megatron_ext.data.prepare import planned_prepared
    from orchestration.megatron_lm.flags import split_flags
    from orchestration.megatron_lm.render import NodeKernels, render_pretrain_gpt

    data = tmp_path / "d.yaml"
    data.write_text("data: {source: embedded, tokenizer: {type: sentencepiece, vocab_size: 2048}}\n"
                    f"training: {{train_iters: 4, init_checkpoint: {tmp_path / 'init' / 'iter_0000004'}}}\n")
    params = with_batch_geometry(load_run_params("gpt_smoke", str(data), RunOverrides(0, "megatron-lm")), 2)[0]
    paths = RunPaths(tmp_path / "art", "r")
    prepared = planned_prepared(params.data, paths.data_cache_dir)
    for load in (False, True):  # rendered on every start: a run with checkpoints of its own loads those (--load wins)
        flags = dict(split_flags(render_pretrain_gpt(params, prepared, paths, (0, 16), NodeKernels(False, False, False),
                                                     load=load).args))
        assert flags["--pretrained-checkpoint"] == [str(tmp_path / "init")]
        assert ("--load" in flags) == load
        # Megatron-LM would size the model by its legacy SentencePieceTokenizer (2,048 pieces + <CLS>, <SEP>, <EOD>,
        # <MASK> -> 2,176 rows); the data's vocabulary padded as this program pads it is the model both build.
        assert flags["--padded-vocab-size"] == ["2048"]
    plain = with_batch_geometry(load_run_params("gpt_smoke", "smoke", RunOverrides(0, "megatron-lm")), 2)[0]
    assert "--pretrained-checkpoint" not in render_pretrain_gpt(plain, planned_prepared(plain.data, paths.data_cache_dir),
                                                                 paths, (0, 16)).args
