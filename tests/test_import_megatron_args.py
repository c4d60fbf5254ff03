"""``import-megatron-args``: Megatron-LM argument files -> model preset + data set YAML.

    python -m pytest -q tests/test_import_megatron_args.py

Pure apart from two ``python -m orchestration import-megatron-args`` processes (the CLI path and a
bad input). The round trip renders the written YAML back with the megatron-lm engine's renderer
and compares flag by flag with the files (Megatron-LM's defaults standing in for absent flags).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TEST_DATA, clean_env
from megatron_ext.data.prepare import PreparedData
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.params import load_model, load_run_params, with_batch_geometry
from megatron_ext.run_spec.run_paths import RunPaths
from megatron_ext.run_spec.zero import megatron_lm_flags_for_stage
from orchestration import cli
from orchestration.import_args import given_flags
from orchestration.import_args import importer as mli
from orchestration.import_args import yaml_files as mly
from orchestration.import_args.flag_reader import FIXED, LAUNCHER, NOT_IMPORTED
from orchestration.import_args.importer import load_flag_table
from orchestration.import_args.shell import read_files
from orchestration.megatron_lm.flags import SHIPPED_TABLE, parse_flag_table, split_flags
from orchestration.megatron_lm.render import data_flags, logging_and_checkpoint_flags, model_flags, training_flags
from orchestration.launch_env import read_launch_env

ARGS = TEST_DATA / "megatron_lm" / "args"
QWEN3 = [ARGS / "params" / "qwen3_1p7b" / "model.sh", ARGS / "params" / "qwen3_1p7b" / "data.sh"]
GPT3 = ARGS / "train_gpt3_175b_distributed.sh"
TABLE = load_flag_table(None)

MEGATRON_LM_DEFAULTS = {
    # Megatron-LM core_v0.16.1's argparse defaults (dumped from its parser), for flags the
    # renderer always emits; the import must write exactly these when the files omit the flag.
    "--normalization": "LayerNorm", "--norm-epsilon": "1e-05", "--position-embedding-type": "learned_absolute",
    "--rotary-base": "10000", "--hidden-dropout": "0.1", "--attention-dropout": "0.1",
    "--make-vocab-size-divisible-by": "128", "--min-lr": "0.0", "--lr-warmup-iters": "0", "--weight-decay": "0.01",
    "--adam-beta1": "0.9", "--adam-beta2": "0.999", "--adam-eps": "1e-08", "--clip-grad": "1.0", "--seed": "1234",
    "--eval-iters": "100", "--log-interval": "100",
}
CONVERTED_INTO = {"--lr-warmup-iters": "--lr-warmup-fraction", "--train-iters": "--train-samples",
                  "--lr-decay-iters": "--lr-decay-samples"}
"""Rendered flag -> the flag the import converted into it."""
LAUNCHER_RENDERED = {"--log-throughput", "--tensorboard-dir", "--data-cache-path", "--save", "--load"}


def import_paths(paths, variables=None):
    return mli.import_files(mli.read_arg_files([str(p) for p in paths]), TABLE, variables)


def import_texts(*texts, variables=None):
    return mli.import_files([(f"f{i}.sh", t) for i, t in enumerate(texts)], TABLE, variables)


def written_params(result, tmp_path: Path):
    """The params of the model preset and data set YAML files the import writes for ``result``."""
    model, data = tmp_path / "imported_model.yaml", tmp_path / "imported_data.yaml"
    model.write_text(mly.render_model_yaml(result))
    data.write_text(mly.render_data_yaml(result))
    return load_run_params(str(model), str(data))


def norm(values) -> tuple[str, ...]:
    out = []
    for v in values:
        try:
            out.append(repr(float(v)))
        except ValueError:
            out.append(v)
    return tuple(out)


def rendered(p, tmp_path: Path, bf16: bool):
    if p.training.global_batch_size is None:
        p, _ = with_batch_geometry(p, 1)
    tok = p.data.tokenizer
    path = tok.model_path
    if tok.type == "huggingface":  # the renderer looks into the directory: a stand-in for the cluster's
        (tmp_path / "tokenizer").mkdir(exist_ok=True)
        (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
        path = str(tmp_path / "tokenizer")
    prepared = PreparedData(prefixes=p.data.paths, weights=p.data.weights, tokenizer_type=tok.type, tokenizer_path=path,
                            vocab_size=tok.vocab_size, eod=0)
    args = (model_flags(p) + data_flags(p, prepared) + training_flags(p, bf16)
            + logging_and_checkpoint_flags(p, RunPaths(tmp_path, "r")))
    out = {flag: norm(values) for flag, values in split_flags(args)}
    if tok.type == "huggingface":
        assert out["--tokenizer-model"] == (path,)
        out["--tokenizer-model"] = (tok.model_path,)
    return p, out


def input_flags(paths=(), variables=None, texts=()) -> dict[str, tuple[str, ...]]:
    """Every flag the files (or ``texts``, as import_texts names them) give, as Megatron-LM would parse them (later files override)."""
    files = read_files(mli.read_arg_files([str(p) for p in paths]) + [(f"f{i}.sh", t) for i, t in enumerate(texts)], variables)
    per_file = [given_flags.collect_flags(f.args, TABLE)[0] for f in files]
    return {f: tuple(w.text for w in g.values) for f, g in given_flags.merge_flags(per_file, TABLE).items()}


def assert_round_trip(result, tmp_path: Path, paths=(), variables=None, texts=()):
    """Every flag the files give is imported, converted or listed; rendering the YAML back gives every
    imported flag as given, and for every flag the files omit, Megatron-LM's default (or what the listed
    entries explain)."""
    given = input_flags(paths, variables, texts)
    accounted = {f for f, _ in result.imported} | {f for f, _ in result.converted} | {n.flag for n in result.not_imported}
    assert set(given) - accounted == set()
    p, out = rendered(written_params(result, tmp_path), tmp_path, bf16="--bf16" in given)
    listed = {n.flag for n in result.not_imported}
    converted = {f for f, _ in result.converted}
    for flag, values in result.imported:
        assert out.get(flag) == norm(values), (flag, values, out.get(flag))
    for flag, values in out.items():
        if flag in given or flag in LAUNCHER_RENDERED or flag in listed:
            continue
        if flag == "--tokenizer-model" and "--tokenizer-type" in listed:  # a placeholder for the listed tokenizer
            continue
        if CONVERTED_INTO.get(flag, "-") in converted:
            continue  # checked where the conversion is
        if flag == "--global-batch-size":
            assert values == norm([str(p.training.micro_batch_size)])  # micro x data-parallel (1), Megatron-LM's default
        elif flag in ("--lr-decay-iters", "--eval-interval", "--save-interval"):
            assert values == norm([str(p.training.train_iters)]), (flag, values)  # Megatron-LM's default, or equivalent
        elif flag == "--ffn-hidden-size":
            assert values == norm([str(4 * p.model.hidden_size)]), values
        elif flag == "--split":
            assert values == ("969,30,1",)
        else:
            assert values == norm([MEGATRON_LM_DEFAULTS[flag]]), (flag, values)
    stage_flags = set(megatron_lm_flags_for_stage(p.training.zero_stage))
    zero_given = {f for f in given if f in ("--use-distributed-optimizer", "--use-megatron-fsdp",
                                               "--data-parallel-sharding-strategy")}
    assert zero_given <= stage_flags
    return p


# -- the Qwen3-1.7B pair --------------------------------------------------------------------------


def test_qwen3_pair_imports_the_shipped_preset_field_by_field():
    result = import_paths(QWEN3)
    shipped = load_model("qwen3_1p7b")
    for f in dataclasses.fields(shipped):
        if f.name != "name":  # (fields without a Megatron-LM flag, as hf_checkpoint, keep their defaults)
            assert result.model.get(f.name, f.default) == getattr(shipped, f.name), f.name


def test_qwen3_data_and_schedule(tmp_path):
    result = import_paths(QWEN3)
    assert result.data == {"source": "files", "paths": ["/data/a_text_document", "/data/b_text_document"],
                           "weights": [0.7, 0.3], "split": "99,1,0",
                           "tokenizer": {"type": "huggingface", "model_path": "/models/Qwen3-1.7B"}}
    t = result.training
    assert (t["seq_length"], t["micro_batch_size"], t["global_batch_size"], t["train_iters"]) == (4096, 1, 256, 20000)
    assert (t["lr"], t["min_lr"], t["lr_warmup_iters"], t["lr_decay_iters"]) == (3e-4, 3e-5, 2000, 20000)
    assert t["zero_stage"] == 1 and t["grad_reduce_in_bf16"] and t["log_interval"] == 10
    launcher = ("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16 --save --load --tensorboard-dir "
                "--data-cache-path --log-throughput --num-workers --transformer-impl --attention-backend").split()
    fixed = ["--use-mcore-models", "--rotary-percent", "--init-method-std"]
    assert {n.flag: n.kind for n in result.not_imported} == {**dict.fromkeys(launcher, LAUNCHER), **dict.fromkeys(fixed, FIXED)}
    assert_round_trip(result, tmp_path, QWEN3)


def test_later_files_override_earlier_ones_and_share_variables(tmp_path):
    files = mli.read_arg_files([str(p) for p in QWEN3])
    override = ("# a shorter run on another corpus\n"
                "TRAINING_ARGS=( --train-iters 100 --lr 1e-4 --seed 7 )\n"
                "DATA_ARGS=( --data-path ${DATA_ROOT}/c_text_document )\n"
                "MODEL_ARGS+=( --hidden-dropout 0.05 )\n")
    result = mli.import_files(files + [("override.sh", override)], TABLE)
    assert result.training["train_iters"] == 100 and result.training["lr"] == 1e-4 and result.training["seed"] == 7
    assert result.training["lr_decay_iters"] == 20000  # still data.sh's
    assert result.data["paths"] == ["/data/c_text_document"] and result.data["weights"] == []
    assert result.model["hidden_dropout"] == 0.05 and result.model["num_layers"] == 28


# -- Megatron-LM's GPT-3 175B example -------------------------------------------------------------


def test_gpt3_example_without_its_data_path_argument_names_file_and_line():
    with pytest.raises(UserError) as err:
        import_paths([GPT3])
    message = str(err.value)
    assert f"{GPT3}:63: --data-path $DATA_PATH" in message and "$5" in message and "--var 5=" in message


def test_gpt3_example_imports_with_megatron_defaults_and_lists_the_rest(tmp_path):
    variables = {"5": "/data/gpt3_text_document"}
    result = import_paths([GPT3], variables)
    m, t = result.model, result.training
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["max_position_embeddings"]) == (96, 12288, 96, 2048)
    assert m["ffn_hidden_size"] == 4 * 12288 and "Megatron-LM default" in result.comments["model.ffn_hidden_size"]
    assert (m["hidden_dropout"], m["attention_dropout"], m["normalization"], m["position_embedding_type"]) == \
        (0.1, 0.1, "LayerNorm", "learned_absolute")
    assert m["add_bias_linear"] and m["tie_embeddings"] and not m["swiglu"]
    assert t["lr_warmup_iters"] == 430 and "--lr-warmup-fraction" in result.comments["training.lr_warmup_iters"]
    assert (t["lr"], t["min_lr"], t["adam_eps"], t["seed"]) == (6e-5, 6e-6, 1e-8, 1234)
    assert result.data["split"] == "949,50,1" and result.data["paths"] == ["/data/gpt3_text_document"]
    listed = {n.flag: n for n in result.not_imported}
    for flag in ("--rampup-batch-size", "--init-method-std", "--fp16", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--vocab-file", "--merge-file", "--tokenizer-type"):
        assert listed[flag].kind == NOT_IMPORTED, flag
    assert "tokenizer.json" in listed["--tokenizer-type"].reason  # the fix for GPT2BPETokenizer
    for flag in ("--save", "--load", "--tensorboard-dir", "--attention-backend", "--nproc_per_node", "--master_port"):
        assert listed[flag].kind == LAUNCHER, flag
    assert listed["--save"].values == ("$CHECKPOINT_PATH",)  # unresolved, and not needed
    assert_round_trip(result, tmp_path, [GPT3], variables)
    data_yaml = mly.render_data_yaml(result)
    assert str(GPT3) in data_yaml and "--rampup-batch-size 16 16 5859375" in data_yaml
    report = mly.render_report(result)
    assert "not imported: --fp16" in report and "handled by the launcher: --save $CHECKPOINT_PATH" in report
    assert "model.hidden_dropout = 0.1" in report


# -- the shell reader -----------------------------------------------------------------------------

MINIMAL = """
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 128 --seq-length 128
--micro-batch-size 2 --train-iters 10 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 512 --mock-data
"""


def test_a_command_line_with_continuations_quotes_defaults_and_arithmetic(tmp_path):
    text = r"""#!/bin/bash
set -euo pipefail
GPUS=8; NODES=2
WORLD=$(( GPUS * NODES ))
LAYERS=${LAYERS:-12}    # default unless set
export CUDA_DEVICE_MAX_CONNECTIONS=1
NAME="gpt 125m"
mkdir -p "/logs/${NAME}"
CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node $GPUS --nnodes "$NODES" \
    /opt/Megatron-LM/pretrain_gpt.py \
    --num-layers ${LAYERS} --hidden-size 768 \
    --num-attention-heads 12 \
    --seq-length=1024 --max-position-embeddings 1024 \
    --micro-batch-size 4 --global-batch-size $(( WORLD * 4 )) \
    --train-samples 6400 \
    --lr 6e-4 --lr-decay-style cosine \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model '/models/sp.model' \
    --data-path /data/corpus_text_document \
    --wandb-exp-name "${NAME}" 2>&1 | tee "/logs/${NAME}/log.txt"
"""
    result = import_texts(text)
    assert result.sources == ("f0.sh (the command at line 9)",)
    assert result.model["num_layers"] == 12 and result.training["seq_length"] == 1024
    assert result.training["global_batch_size"] == 64 and result.training["train_iters"] == 100
    assert "--train-samples 6400" in result.comments["training.train_iters"]
    assert result.data["tokenizer"] == {"type": "sentencepiece", "model_path": "/models/sp.model"}
    listed = {n.flag: n for n in result.not_imported}
    assert listed["--nnodes"].values == ("2",) and listed["--wandb-exp-name"].values == ("gpt 125m",)
    assert dict(result.imported)["--lr-decay-style"] == ("cosine",)
    assert result.training["lr_warmup_iters"] == 0 and result.training["weight_decay"] == 0.01
    result = import_texts(text, variables={"LAYERS": "24"})
    assert result.model["num_layers"] == 24


def test_bare_flags_mock_data_and_the_decay_default(tmp_path):
    result = import_texts(MINIMAL)
    assert result.data == {"source": "mock", "tokenizer": {"type": "null", "vocab_size": 512}}
    decay = next(n for n in result.not_imported if n.flag == "--lr-decay-style")
    assert decay.values == ("linear",) and decay.where == "not in the files" and "cosine" in decay.reason
    p = written_params(result, tmp_path)
    assert p.model.hidden_dropout == 0.1 and p.training.adam_beta2 == 0.999 and p.training.min_lr == 0.0
    assert p.training.eval_iters == 100 and p.training.log_interval == 100


@pytest.mark.parametrize("text, where, words", [
    ("X=$(hostname)\nA=( --num-layers $X )\n", "f1.sh:2", ["--num-layers $X", "command substitution $(hostname)"]),
    ("A=( --hidden-size `echo 64` )\n", "f1.sh:1", ["--hidden-size", "`echo 64`"]),
    ("A=( --lr $LR )\n", "f1.sh:1", ["LR is not set in these files", "--var LR="]),
    ("if [ -n \"$BIG\" ]; then\n  L=48\nfi\nA=( --num-layers $L )\n", "f1.sh:4", ["inside the 'if' block at f1.sh:1"]),
    ("A=( --seq-length $1 )\n", "f1.sh:1", ["$1 is the script's argument 1"]),
])
def test_unresolvable_shell_in_a_needed_flag_is_one_error_naming_file_and_line(text, where, words):
    with pytest.raises(UserError) as err:
        import_texts(MINIMAL, text)
    message = str(err.value)
    assert message.startswith(where + ":"), message
    for word in words:
        assert word in message, (word, message)


def test_unresolvable_shell_in_a_flag_without_counterpart_is_listed():
    result = import_texts(MINIMAL, 'A=( --save "$(date +%F)/ckpt" --wandb-project $PROJECT )\n')
    listed = {n.flag: n for n in result.not_imported}
    assert listed["--save"].values == ('"$(date +%F)/ckpt"',) and listed["--save"].kind == LAUNCHER
    assert listed["--wandb-project"].values == ("$PROJECT",)


def test_arrays_append_quote_and_split_as_bash():
    text = ('BLEND="0.5 /d/a 0.5 /d/b"\nDATA=( --data-path $BLEND )\nDATA+=( --split "90, 10, 0" )\n'
            'ALL=( "${DATA[@]}" )\nunset nothing\n')
    result = import_texts(MINIMAL.replace("--mock-data", ""), text)
    assert result.data["paths"] == ["/d/a", "/d/b"] and result.data["weights"] == [0.5, 0.5]
    assert result.data["split"] == "90, 10, 0"


@pytest.mark.parametrize("text", ["A='open\n", "X=${Y:-'open}\n"])
def test_a_single_quote_never_closed_is_one_error_naming_the_line(text):
    """In a ``${X:-word}`` default too (the reader used to loop there for ever)."""
    with pytest.raises(UserError, match="t.sh:1: a single quote is never closed"):
        read_files([("t.sh", text)])


# -- flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, words", [
    ("--num-layer 3", ["defines no --num-layer", "did you mean --num-layers?", "--megatron-lm-dir"]),
    ("--swiglu 1", ["'1' after --swiglu, which takes no value"]),
    ("--normalization Foo", ["--normalization Foo is not one of Megatron-LM's choices (LayerNorm, RMSNorm)"]),
    ("--hidden-dropout", ["--hidden-dropout takes one value"]),
    ("--num-layers twelve", ["--num-layers 'twelve' is not an integer"]),
    ("--rampup-batch-size 1 2", ["--rampup-batch-size takes 3 values"]),
    ("--position-embedding-type none", ["--position-embedding-type none has no counterpart"]),
    (("--num-layers 2 ", ""), ["the files give no --num-layers"]),  # (old, new): a required flag missing
    (("NullTokenizer --vocab-size 512", "HuggingFaceTokenizer --tokenizer-model /m"),  # mock data needs the null tokenizer
     ["add --tokenizer-type NullTokenizer --vocab-size N"]),
])
def test_bad_flags_are_one_clear_error(extra, words):
    """``extra`` flags after MINIMAL's, or an ``(old, new)`` replacement in them."""
    with pytest.raises(UserError) as err:
        import_texts(MINIMAL.replace(*extra) if isinstance(extra, tuple) else MINIMAL + extra + "\n")
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize("flags, stage", [
    ("", 0),
    ("--use-distributed-optimizer", 1),
    ("--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads --ckpt-format fsdp_dtensor", 2),
    ("--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params", 3),
    ("--use-distributed-optimizer --data-parallel-sharding-strategy optim_grads", 1),  # ignored without Megatron-FSDP
])
def test_zero_stage_from_the_distributed_flags(flags, stage):
    result = import_texts(MINIMAL + flags + "\n")
    assert result.training["zero_stage"] == stage
    for flag in flags.split():
        if flag.startswith("--"):
            entry = next(n for n in result.not_imported if n.flag == flag)
            assert entry.kind == LAUNCHER, entry
    if stage:
        assert set(f for f in flags.split() if f.startswith("--") and f != "--data-parallel-sharding-strategy") \
            <= set(megatron_lm_flags_for_stage(stage))


def test_model_fields_with_their_megatron_lm_flags(tmp_path):
    text = (MINIMAL + "--add-qkv-bias --disable-bias-linear --use-rope-scaling --rope-scaling-factor 32 "
            "--position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights --swiglu "
            "--ffn-hidden-size 176 --group-query-attention --num-query-groups 2 --kv-channels 32\n")
    result = import_texts(text)
    m = result.model
    assert m["add_qkv_bias"] and not m["add_bias_linear"] and m["rope_scaling"] and m["rope_scaling_factor"] == 32.0
    assert m["rotary_base"] == 500000 and not m["tie_embeddings"] and m["num_query_groups"] == 2 and not m["gelu_tanh"]
    assert_round_trip(result, tmp_path, texts=[text])


@pytest.mark.parametrize("tokenizer, expected", [
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model /m/tokenizer.json",
     {"type": "huggingface", "model_path": "/m/tokenizer.json"}),
    ("--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model /m/sp.model",
     {"type": "sentencepiece", "model_path": "/m/sp.model"}),
    ("--tokenizer-type Llama2Tokenizer --tokenizer-model /m/llama.model --vocab-size 32000",
     {"type": "sentencepiece", "model_path": "/m/llama.model"}),
])
def test_tokenizers(tokenizer, expected):
    text = MINIMAL.replace("--tokenizer-type NullTokenizer --vocab-size 512 --mock-data", "--data-path /d/x") + tokenizer
    result = import_texts(text)
    assert result.data["tokenizer"] == expected
    if "--vocab-size" in tokenizer:
        entry = next(n for n in result.not_imported if n.flag == "--vocab-size")
        assert "does not read it" in entry.reason


def test_the_shipped_flag_table_is_megatron_lm_core_v0_16_1s():
    """Same flags and choices as the table made by importing Megatron-LM core_v0.16.1."""
    reference = {}
    for line in (TEST_DATA / "megatron_lm" / "flags_core_v0.16.1.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            flag, choices = line.split("\t")
            reference[flag] = tuple(c for c in choices.split(",") if c)
    assert {f: s.choices for f, s in TABLE.flags.items()} == reference
    assert TABLE.release == "core_v0.16.1"
    nargs = {f: s.nargs for f, s in TABLE.flags.items()}
    assert (nargs["--swiglu"], nargs["--num-layers"], nargs["--data-path"], nargs["--rampup-batch-size"]) == ("0", "1", "*", "3")
    assert parse_flag_table(SHIPPED_TABLE.read_text(), "x") == TABLE


# -- the command ----------------------------------------------------------------------------------


def _run_command(argv, tmp_path, **env):
    args = cli.build_parser().parse_args(["import-megatron-args", *argv])
    launch = read_launch_env(env, 0, None, sys.executable, str(tmp_path))
    return cli.run_command(args, launch)


def test_the_command_refuses_to_overwrite_and_dry_run_writes_nothing(tmp_path, capsys):
    model, data = tmp_path / "m.yaml", tmp_path / "d.yaml"
    argv = [*map(str, QWEN3), "--model-out", str(model), "--data-out", str(data)]
    assert _run_command(argv + ["--dry-run"], tmp_path) == 0
    out = capsys.readouterr().out
    assert not model.exists() and f"--- {model} (dry run: not written)" in out and "num_layers: 28" in out
    assert _run_command(argv, tmp_path, DRY_RUN="1") == 0 and not model.exists()
    model.write_text("keep me\n")
    with pytest.raises(UserError, match="already exist.*--force"):
        _run_command(argv, tmp_path)
    assert model.read_text() == "keep me\n"
    assert _run_command(argv + ["--force"], tmp_path) == 0
    assert load_run_params(str(model), str(data)).model.num_layers == 28


def test_cli_writes_both_files_and_lists_what_it_did_not_import(tmp_path):
    model, data = tmp_path / "qwen3_imported.yaml", tmp_path / "qwen3_imported_data.yaml"
    proc = subprocess.run([sys.executable, "-m", "orchestration", "import-megatron-args", *map(str, QWEN3),
                           "--model-out", str(model), "--data-out", str(data)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "handled by the launcher: --save /checkpoints/qwen3_1p7b" in proc.stdout
    assert "fixed in this project: --rotary-percent 1.0" in proc.stdout and f"wrote {model}" in proc.stdout
    p = load_run_params(str(model), str(data))
    assert p.model == dataclasses.replace(load_model("qwen3_1p7b"), name="qwen3_imported")
    assert model.read_text().startswith("# Model preset imported from Megatron-LM arguments")


def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orchestration", "import-megatron-args", str(GPT3),
                           "--model-out", str(tmp_path / "m.yaml"), "--data-out", str(tmp_path / "d.yaml")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert ":63: --data-path $DATA_PATH" in lines[0] and not (tmp_path / "m.yaml").exists()


def test_functions_case_blocks_heredocs_and_declare_are_read_as_bash_sources_them():
    text = r'''
declare -a A=( --a "x y" 'z' )
C="${A[*]}"
f() {
  X=1
}
g()
{
  Y=2
}
case "$MODE" in
  big) L=48 ;;
  *) L=12 ;;
esac
cat <<END
--not-a-flag 1
END
ARR=( --c $C --l $L --x $X --y $Y --z "${A[1]}" )
'''
    args = read_files([("t.sh", text)])[0].args
    words = [(w.text, w.unresolved is not None) for w in args]
    assert words[:3] == [("--a", False), ("x y", False), ("z", False)]
    assert words[3:] == [("--c", False), ("--a", False), ("x", False), ("y", False), ("z", False), ("--l", False),
                         ("$L", True), ("--x", False), ("$X", True), ("--y", False), ("$Y", True), ("--z", False),
                         ("x y", False)]
    assert "inside the 'case' block at t.sh:11" in next(w.unresolved for w in args if w.text == "$L")


def test_a_checkout_gives_the_flags_and_their_nargs(tmp_path):
    """--megatron-lm-dir: flags and nargs read from the checkout's arguments.py with ast."""
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "training").mkdir()
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 99\nPATCH = 0\n")
    (tmp_path / "megatron" / "training" / "config.py").write_text(
        "from dataclasses import dataclass, field\n"
        "@dataclass\nclass TrainConfig:\n"
        "    train_iters: int | None = None\n    exit_on_nan: bool = False\n    overlap: bool = True\n"
        "    ramp: list[int] | None = field(default=None, metadata={'argparse_meta': {'nargs': 3}})\n"
        "    levels: list[int] | None = None\n")
    (tmp_path / "megatron" / "training" / "arguments.py").write_text(
        "import argparse\n"
        "def add(parser):\n"
        "    g = parser.add_argument_group('x')\n"
        "    g.add_argument('--num-layers', type=int)\n"
        "    g.add_argument('--swiglu', action='store_true')\n"
        "    g.add_argument('--data-path', nargs='*')\n"
        "    g.add_argument('--fuse', action=argparse.BooleanOptionalAction)\n"
        "    g.add_argument('--normalization', choices=['LayerNorm', 'RMSNorm'])\n"
        "    ArgumentGroupFactory(TrainConfig).build_group(parser)\n")
    table = load_flag_table(str(tmp_path))
    assert table.release.startswith("0.99.0")
    nargs = {f: s.nargs for f, s in table.flags.items()}
    assert nargs == {"--num-layers": "1", "--swiglu": "0", "--data-path": "*", "--fuse": "0", "--no-fuse": "0",
                     "--normalization": "1", "--train-iters": "1", "--exit-on-nan": "0", "--no-overlap": "0",
                     "--disable-overlap": "0", "--ramp": "3", "--levels": "+"}
    assert table.flags["--normalization"].choices == ("LayerNorm", "RMSNorm")


def test_manual_gc_and_fp8_are_imported_into_their_fields():
    result = import_texts(MINIMAL + "--manual-gc --manual-gc-interval 100 --fp8-format hybrid --fp8-amax-history-len 1024 "
                                    "--fp8-amax-compute-algo max\n")
    t = result.training
    assert (t["manual_gc"], t["manual_gc_interval"]) == (True, 100)
    assert (t["fp8"], t["fp8_amax_history_len"], t["fp8_amax_compute_algo"]) == ("hybrid", 1024, "max")
    assert not {"--manual-gc", "--manual-gc-interval", "--fp8-format"} & {n.flag for n in result.not_imported}
    plain = import_texts(MINIMAL).training
    assert plain["manual_gc"] is False and "fp8" not in plain  # BF16 and Python's own GC, as Megatron-LM's defaults


@pytest.mark.parametrize("main, comm, in_bf16, listed", [
    ("bf16", "bf16", True, False),
    ("fp32", "fp32", False, False),
    ("bf16", "fp32", False, True),
    ("auto", "auto", False, True),
    ("fp16", "fp16", False, True),
])
def test_megatron_fsdp_gradient_dtypes_import_as_one_reduction_dtype(main, comm, in_bf16, listed):
    """Megatron-LM 0.17+'s --megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype: both bf16 is
    training.grad_reduce_in_bf16 (rendered back as that pair at stages 2-3), both fp32 the default; any other
    pair has no counterpart here (one reduction dtype for both) and is listed, not silently changed."""
    from orchestration.megatron_lm.flags import FlagSpec, FlagTable

    names = ("--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype")
    table = FlagTable("core_v0.19.0", {**TABLE.flags, **{n: FlagSpec("1", ("fp32", "bf16", "fp16", "auto")) for n in names}})
    result = mli.import_files([("f.sh", MINIMAL + f"{names[0]} {main} {names[1]} {comm}\n")], table)
    assert result.training["grad_reduce_in_bf16"] is in_bf16
    not_imported = {n.flag: n for n in result.not_imported}
    assert [n in not_imported for n in names] == [listed, listed], not_imported
    if listed:
        assert "training.grad_reduce_in_bf16" in not_imported[names[0]].reason


def test_a_user_s_own_background_saves_are_kept():
    """--async-save was dropped as the launcher's business, and a user who moved from their scripts lost
    background saves without a word: it is training.async_save now (rendered back with Megatron-LM's
    worker flags, tests/test_megatron_lm.py); without it, Megatron-LM's default, synchronous saves."""
    kept = import_texts(MINIMAL + "--save-interval 100 --async-save --use-persistent-ckpt-worker\n")
    assert kept.training["async_save"] is True and "--async-save" not in {n.flag for n in kept.not_imported}
    worker = next(n for n in kept.not_imported if n.flag == "--use-persistent-ckpt-worker")
    assert worker.kind == LAUNCHER, worker
    assert import_texts(MINIMAL).training["async_save"] is False
    # --verify-integrity: the project's default too (an integrity.json at each save); without it, said
    from orchestration.megatron_lm.flags import FlagSpec, FlagTable

    table = FlagTable("core_v0.19.0", {**TABLE.flags, "--verify-integrity": FlagSpec("0")})  # 0.17.1 and later
    checked = mli.import_files([("f.sh", MINIMAL + "--save-interval 100 --verify-integrity\n")], table)
    assert checked.training["verify_integrity"] is True and "--verify-integrity" not in {n.flag for n in checked.not_imported}
    unchecked = import_texts(MINIMAL)
    assert "verify_integrity" not in unchecked.training and "integrity.json" in unchecked.comments["training.verify_integrity"]
