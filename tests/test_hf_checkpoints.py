"""Hugging Face checkpoints in and out, against transformers itself (models built from configs with
random weights: nothing downloaded). fp32 on CPU; the logits within 1e-5."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.flops import padded_vocab_size
from megatron_ext.run_spec.hf_config import hf_model_type, preset_from_hf_config
from megatron_ext.run_spec.params import ModelPreset, build_dataclass, load_model, load_run_params
from megatron_ext.run_spec.model_size import count_model_parameters

from conftest import REPO, TEST_DATA, clean_env, free_port

transformers = pytest.importorskip("transformers")  # the `hf` extra (setup_env.sh installs it)

CONFIGS = sorted((TEST_DATA / "hf_configs").glob("*.json"))


@pytest.mark.parametrize("config_file", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_published_configs_give_presets_with_transformers_parameter_counts(config_file):
    """The preset derived from a published config.json has transformers' parameter count (the
    model built on the meta device), and the YAML preset of that name is the same preset."""
    config = json.loads(config_file.read_text())
    fields = preset_from_hf_config(config, config_file.name)
    preset = build_dataclass(ModelPreset, {"name": config_file.stem, **fields}, config_file.name)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    unpadded = dataclasses.replace(preset, make_vocab_size_divisible_by=1)
    assert count_model_parameters(unpadded).total == sum(p.numel() for p in hf.parameters())
    assert hf_model_type(preset) == config["model_type"]
    yaml_preset = REPO / "params" / "models" / f"{config_file.stem}.yaml"
    if yaml_preset.is_file():
        ours = load_model(config_file.stem)
        differs = {f.name for f in dataclasses.fields(ModelPreset)
                   if getattr(ours, f.name) != getattr(preset, f.name)} - {"hidden_dropout", "attention_dropout"}
        # params/models/gpt2.yaml is GPT-2 small as Megatron-LM's pretrain_gpt.py builds it: the exact GELU
        # (Megatron-LM has no tanh GELU for megatron-core models); MODEL=<a GPT-2 directory> gets the tanh one.
        assert differs == ({"gelu_tanh"} if config_file.stem == "gpt2" else set()), differs


def test_what_megatron_core_cannot_be_is_refused():
    base = json.loads((TEST_DATA / "hf_configs" / "llama3p1_8b.json").read_text())
    for change, message in [({"rope_scaling": {**base["rope_scaling"], "rope_type": "yarn"}}, "rope_scaling.rope_type='yarn'"),
                            ({"rope_scaling": {**base["rope_scaling"], "original_max_position_embeddings": 4096}},
                             "original_max_position_embeddings=4096 is not supported"),
                            ({"mlp_bias": True}, "mlp_bias=True"), ({"model_type": "mistral"}, "model_type='mistral'")]:
        with pytest.raises(UserError, match=message):
            preset_from_hf_config({**base, **change}, "config.json")


TINY = {
    "qwen3": dict(vocab_size=403, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rope_theta=1e6, tie_word_embeddings=True),
    "qwen2": dict(vocab_size=403, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False),
    "llama": dict(vocab_size=403, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=128, rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "gpt2": dict(vocab_size=403, n_embd=64, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=400, eos_token_id=400),
}
"""Small models of each architecture: two layers, grouped-query attention where the architecture
has it, Llama 3.1's RoPE scaling, untied embeddings for Qwen2 and Llama; vocabulary 403 (the test
tokenizer's), which Megatron pads to 512."""


def tiny_hf_model(kind: str, directory: Path, seed: int = 0):
    """A transformers model of ``kind`` with random weights, saved with the test tokenizer."""
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(kind, **TINY[kind])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(directory)
    for f in (TEST_DATA / "hf_tokenizer" / "qwen_style").iterdir():
        shutil.copy2(f, directory / f.name)
    return model


@pytest.fixture(scope="module")
def cpu_megatron():
    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.model import ensure_model_parallel

    ensure_model_parallel()
    install_megatron_on_cpu(1234)


@pytest.mark.parametrize("kind", sorted(TINY))
def test_import_gives_transformers_logits_and_loss_and_export_gives_back_the_tensors(kind, tmp_path, cpu_megatron):
    from megatron_ext.training.hf_weights import load_hf_weights, megatron_to_hf, restrict_logits
    from megatron_ext.training.model import build_gpt_model

    hf = tiny_hf_model(kind, tmp_path / kind)
    preset = load_model(str(tmp_path / kind))
    assert preset.hf_checkpoint == str((tmp_path / kind).resolve()) and hf_model_type(preset) == kind
    padded = padded_vocab_size(preset.vocab_size, preset.make_vocab_size_divisible_by)
    assert padded == 512 > preset.vocab_size
    model = build_gpt_model(preset, padded, 32).eval()
    load_hf_weights(model, preset, kind, padded)
    restrict_logits(model, preset.vocab_size, padded)
    tokens = torch.randint(0, preset.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(inputs, positions, None)
        theirs = hf(inputs).logits
        our_loss = model(inputs, positions, None, labels=labels).mean()
        their_loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, theirs.shape[-1]), labels.reshape(-1))
    assert ours.shape == theirs.shape == (2, 32, preset.vocab_size)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    assert abs(our_loss.item() - their_loss.item()) < 1e-5
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert torch.count_nonzero(state["embedding.word_embeddings.weight"][preset.vocab_size:]) == 0  # padded rows
    exported = megatron_to_hf(state, preset, kind, preset.vocab_size)
    original = {k: v for k, v in hf.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    if preset.tie_embeddings:
        original.pop("lm_head.weight")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)


def train_and_export(tmp_path: Path, model_dir: Path, stage: str, run: str) -> tuple[subprocess.CompletedProcess, Path]:
    """A user's own data set: two indexed prefixes (the bytes Megatron-LM's preprocess_data.py
    writes with this tokenizer, see test_prepare_data.py) blended 0.7/0.3, the tokenizer from the
    model directory."""
    from megatron_ext.data.prepare import chunks_from_files, write_indexed_dataset
    from megatron_ext.run_spec.params import TokenizerParams

    tokenizer = TokenizerParams("huggingface", str(model_dir))
    prefixes = [write_indexed_dataset(chunks_from_files([TEST_DATA / "prepare" / "small.jsonl"]), tokenizer,
                                      tmp_path / "corpus" / name, workers=1) for name in ("web", "code")]
    data = tmp_path / "hf_data.yaml"
    data.write_text(f"data:\n  source: files\n  paths: [{prefixes[0]}, {prefixes[1]}]\n  weights: [0.7, 0.3]\n"
                    "  split: \"100,0,0\"\n  tokenizer: {type: huggingface}\n"
                    "training:\n  seq_length: 16\n  micro_batch_size: 2\n  train_iters: 2\n  lr: 0.0\n  min_lr: 0.0\n"
                    "  lr_warmup_iters: 0\n  eval_iters: 0\n  save_interval: 2\n")
    art = tmp_path / "art"
    env = clean_env(ARTIFACT_ROOT=str(art), NPROC_PER_NODE="2", ZERO_STAGE=stage, MASTER_PORT=str(free_port()))
    train = subprocess.run([sys.executable, "-m", "orchestration", "train", str(model_dir), str(data), run], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert f"initialised from the Hugging Face weights in {model_dir.resolve()}" in train.stdout
    out = tmp_path / "exported"
    export = subprocess.run(["bash", str(REPO / "training_scripts" / "export_hf.sh"), run, str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    return export, out


@pytest.mark.slow
def test_hf_directory_as_model_trained_sharded_then_exported_loads_in_transformers(tmp_path):
    """MODEL = a Hugging Face directory (its tokenizer too), ZeRO stage 3 over 2 ranks (FSDP2 shards
    in the checkpoint), learning rate 0: the export loads in AutoModelForCausalLM with no missing or
    unexpected key, holds the imported tensors exactly, and its tokenizer and generation config."""
    hf = tiny_hf_model("qwen3", tmp_path / "qwen3_tiny")
    export, out = train_and_export(tmp_path, tmp_path / "qwen3_tiny", "3", "hf_z3")
    assert export.returncode == 0, export.stdout + export.stderr
    assert "exported iter_0000002 of run hf_z3 (qwen3, float32, vocabulary 403, 109 padded rows dropped)" in export.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    original = hf.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], original[k]) for k in original)
    tokens = torch.randint(0, 403, (1, 16))
    assert torch.allclose(loaded(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == 400 == json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    again = subprocess.run(["bash", str(REPO / "training_scripts" / "export_hf.sh"), "hf_z3", str(out)], cwd=REPO,
                           env=clean_env(ARTIFACT_ROOT=str(tmp_path / "art")), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr and "Traceback" not in again.stderr


def test_safetensors_shard_above_the_limit_with_an_index(tmp_path):
    from megatron_ext.training.hf_weights import read_hf_state_dict, write_hf_state_dict

    state = {f"w{i}": torch.full((256,), float(i)) for i in range(5)}
    files = write_hf_state_dict(state, tmp_path, shard_bytes=2048)
    assert files[-1] == "model.safetensors.index.json" and len(files) == 4
    assert all(torch.equal(read_hf_state_dict(tmp_path)[k], v) for k, v in state.items())


def test_megatron_lm_says_what_to_run_for_hf_weights(tmp_path):
    tiny_hf_model("qwen3", tmp_path / "m")
    data = tmp_path / "d.yaml"
    data.write_text("data:\n  source: embedded\n  tokenizer: {type: huggingface}\n")
    env = clean_env(DRY_RUN="1", ENGINE="megatron-lm", MEGATRON_LM_DIR=str(tmp_path), ARTIFACT_ROOT=str(tmp_path / "a"))
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", str(tmp_path / "m"), str(data), "r"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "convert them first with Megatron-Bridge" in proc.stderr, proc.stderr
    params = load_run_params(str(tmp_path / "m"), str(data))
    assert params.data.tokenizer.model_path == str((tmp_path / "m").resolve())  # the model directory's tokenizer
