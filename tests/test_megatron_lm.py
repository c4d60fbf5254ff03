"""ENGINE=megatron-lm: pretrain_gpt.py arguments rendered from the same params and ZeRO table,
checked against Megatron-LM's real flag lists (tests/data/megatron_lm) and against checkouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.spec.resolved import ResolvedRun, RunRuntime, read_resolved, write_resolved
from megatron_ext.spec.run_paths import RunPaths
from orchestration.engines.megatron_lm_args import check_flags, render_pretrain_gpt, split_flags
from orchestration.engines.megatron_lm_checkout import read_checkout
from megatron_ext.spec.iteration_log import parse_log
from megatron_ext.spec.errors import UserError
from megatron_ext.spec.params import RunOverrides, list_models, load_run_params, with_batch_geometry
from megatron_ext.data.prepare import planned_prepared

from conftest import REPO, TEST_DATA, clean_env

STAGE_FLAGS = {  # facts.md, exactly
    0: [],
    1: ["--use-distributed-optimizer"],
    2: "--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads --ckpt-format fsdp_dtensor".split(),
    3: "--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor".split(),
}
DATA_FOR = {"gpt_smoke": "smoke", "gpt2": "gpt2_smoke", "qwen3_1p7b": "qwen3_1p7b_smoke"}


def reference_flags(name: str) -> dict[str, tuple[str, ...]]:
    path = TEST_DATA / "megatron_lm" / name
    flags = {}
    for line in path.read_text().splitlines():
        if line.startswith("--"):
            flag, _, choices = line.partition("\t")
            flags[flag] = tuple(c for c in choices.split(",") if c)
    return flags


def render(model: str, data: str, stage: int, version=(0, 16), tmp=Path("/tmp/artifacts"), run="r"):
    params = with_batch_geometry(load_run_params(model, data, RunOverrides(stage, "megatron-lm")), 2)[0]
    paths = RunPaths(tmp, run)
    return render_pretrain_gpt(params, planned_prepared(params.data, paths.data_cache_dir), paths, version)


@pytest.mark.parametrize("tsv,version", [("megatron_lm_args_core_r0.16.0.tsv", (0, 16)), ("megatron_lm_args_main.tsv", (0, 17))])
@pytest.mark.parametrize("model", list_models())
@pytest.mark.parametrize("data", ["preset", "mock"])
@pytest.mark.parametrize("stage", range(4))
def test_render_uses_only_real_flags_and_the_stage_table(tsv, version, model, data, stage):
    known = reference_flags(tsv)
    r = render(model, DATA_FOR[model] if data == "preset" else "mock", stage, version)
    for flag, values in split_flags(r.args):
        assert flag in known, f"{flag} is not a Megatron-LM flag ({tsv})"
        for value in values if known[flag] else ():
            assert value in known[flag], (flag, value, known[flag])
    check_flags(r.args, known, tsv)  # the same check the launcher runs against a checkout
    stage_part = [a for a in r.args if a in {"--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                             "--ckpt-format", "optim_grads", "optim_grads_params", "fsdp_dtensor"}]
    assert stage_part == STAGE_FLAGS[stage]
    assert r.env == {"CUDA_DEVICE_MAX_CONNECTIONS": None if stage >= 2 else "1"}


def test_qwen3_render_holds_the_exact_model_flags():
    args = render("qwen3_1p7b", "qwen3_1p7b_smoke", 0).args
    expected = ("--num-layers 28 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 16 --group-query-attention "
                "--num-query-groups 8 --kv-channels 128 --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-06 --swiglu "
                "--disable-bias-linear --position-embedding-type rope --rotary-base 1000000 --max-position-embeddings 40960 "
                "--hidden-dropout 0.0 --attention-dropout 0.0").split()
    pairs = split_flags(args)
    for flag, values in split_flags(expected):
        assert (flag, values) in pairs
    assert "--untie-embeddings-and-output-weights" not in args and "--bf16" in args
    assert args[args.index("--tokenizer-type") + 1] == "SentencePieceTokenizer"
    for flag in ("--save", "--load", "--save-interval", "--tensorboard-dir", "--log-interval", "--log-throughput", "--data-path", "--split"):
        assert flag in args


def test_gpt2_render_is_gpt2():
    args = render("gpt2", "gpt2_smoke", 1).args
    pairs = dict((f, v) for f, v in split_flags(args))
    assert pairs["--position-embedding-type"] == ["learned_absolute"] and pairs["--normalization"] == ["LayerNorm"]
    assert "--swiglu" not in pairs and "--disable-bias-linear" not in pairs and "--group-query-attention" not in pairs
    assert pairs["--hidden-dropout"] == ["0.0"] and pairs["--max-position-embeddings"] == ["1024"]


def test_qwen3_null_tokenizer_vocabulary_after_megatron_padding():
    args = render("qwen3_1p7b", "mock", 0).args
    pairs = dict(split_flags(args))
    assert pairs["--tokenizer-type"] == ["NullTokenizer"] and "--mock-data" in pairs
    vocab = int(pairs["--vocab-size"][0]) + 1  # NullTokenizer adds end-of-document
    multiple = int(pairs["--make-vocab-size-divisible-by"][0]) * 1  # x tensor-parallel size
    padded = vocab
    while padded % multiple:
        padded += 1
    assert padded == 151_936


def write_checkout(root: Path, version: tuple[int, int, int], flags: list[str], extra: str = "") -> Path:
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = {version[0]}\nMINOR = {version[1]}\nPATCH = {version[2]}\nPRE_RELEASE = ''\n")
    lines = ["import argparse", "def _add(parser):", "    group = parser.add_argument_group('x')"]
    for flag in flags:
        choices = {"--normalization": "['LayerNorm', 'RMSNorm']", "--tokenizer-type": "['SentencePieceTokenizer', 'NullTokenizer']",
                   "--position-embedding-type": "['learned_absolute', 'rope']", "--lr-decay-style": "['constant', 'cosine']",
                   "--data-parallel-sharding-strategy": "['no_shard', 'optim', 'optim_grads', 'optim_grads_params']",
                   "--ckpt-format": "['torch', 'torch_dist', 'fsdp_dtensor']"}.get(flag)
        lines.append(f"    group.add_argument({flag!r}{', choices=' + choices if choices else ''})")
    (root / "megatron" / "training" / "arguments.py").write_text("\n".join(lines) + "\n" + extra)
    (root / "pretrain_gpt.py").write_text("# stand-in: never run here\n")
    return root


def all_rendered_flags(version=(0, 16)) -> list[str]:
    flags = set()
    for stage in range(4):
        flags |= {f for f, _ in split_flags(render("qwen3_1p7b", "qwen3_1p7b_smoke", stage, version).args)}
    return sorted(flags)


def test_fake_0_13_checkout_picks_use_custom_fsdp(tmp_path):
    flags = [f if f != "--use-megatron-fsdp" else "--use-custom-fsdp" for f in all_rendered_flags((0, 13))]
    checkout = read_checkout(write_checkout(tmp_path, (0, 13, 0), flags))
    assert checkout.version == (0, 13, 0)
    r = render("qwen3_1p7b", "qwen3_1p7b_smoke", 2, checkout.version[:2])
    assert "--use-custom-fsdp" in r.args and "--use-megatron-fsdp" not in r.args
    check_flags(r.args, checkout.flags, checkout.version_text)


def test_fake_checkout_refuses_a_missing_flag_and_a_bad_choice(tmp_path):
    flags = [f for f in all_rendered_flags() if f != "--qk-layernorm"]
    checkout = read_checkout(write_checkout(tmp_path / "a", (0, 16, 1), flags))
    r = render("qwen3_1p7b", "qwen3_1p7b_smoke", 0, checkout.version[:2])
    with pytest.raises(UserError, match=r"Megatron-LM 0.16.1 does not define --qk-layernorm"):
        check_flags(r.args, checkout.flags, checkout.version_text)
    old = read_checkout(write_checkout(tmp_path / "b", (0, 14, 0), [f if f != "--use-megatron-fsdp" else "--use-custom-fsdp" for f in all_rendered_flags()]))
    r = render("qwen3_1p7b", "qwen3_1p7b_smoke", 3, (0, 14))
    with pytest.raises(UserError, match=r"does not define --use-megatron-fsdp; the checkout has --use-custom-fsdp"):
        check_flags(r.args, old.flags, old.version_text)
    with pytest.raises(UserError, match=r"--lr-decay-style linear is not accepted by Megatron-LM 0.16.1: choices are constant, cosine"):
        check_flags(["--lr-decay-style", "linear"], checkout.flags, checkout.version_text)


def test_generated_flags_from_config_dataclasses(tmp_path):
    """0.16 generates part of the CLI from dataclasses (ArgumentGroupFactory): --ckpt-format is one."""
    extra = "from megatron.training.training_config import CheckpointConfig\nArgumentGroupFactory(CheckpointConfig, exclude=['hidden']).build_group(None)\n"
    root = write_checkout(tmp_path, (0, 16, 1), ["--save"], extra)
    (root / "megatron" / "training" / "training_config.py").write_text(
        "from dataclasses import dataclass, field\nfrom typing import Literal\n"
        "@dataclass\nclass BaseConfig:\n    async_save: bool = False\n"
        "@dataclass\nclass CheckpointConfig(BaseConfig):\n"
        "    ckpt_format: Literal['torch', 'torch_dist', 'fsdp_dtensor'] = 'torch_dist'\n"
        "    \"\"\"Checkpoint format.\"\"\"\n"
        "    use_persistent_ckpt_worker: bool = True\n"
        "    hidden: int = 1\n"
        "    internal: int = field(default=0, init=False)\n"
        "    renamed: str = field(default='x', metadata={'argparse_meta': {'arg_names': ['--other-name'], 'choices': ['x', 'y']}})\n")
    flags = read_checkout(root).flags
    assert flags["--ckpt-format"] == ("torch", "torch_dist", "fsdp_dtensor")
    assert "--async-save" in flags and "--no-use-persistent-ckpt-worker" in flags and "--disable-use-persistent-ckpt-worker" in flags
    assert "--hidden" not in flags and "--internal" not in flags and "--renamed" not in flags
    assert flags["--other-name"] == ("x", "y")


def test_not_a_checkout(tmp_path):
    with pytest.raises(UserError, match="has no pretrain_gpt.py"):
        read_checkout(tmp_path)


def test_launcher_dry_run_renders_pretrain_gpt(tmp_path):
    checkout = write_checkout(tmp_path / "Megatron-LM", (0, 16, 1), all_rendered_flags())
    env = clean_env(DRY_RUN="1", ENGINE="megatron-lm", MEGATRON_LM_DIR=str(checkout), HOSTS="n0,n1", NPROC_PER_NODE="8",
                    ZERO_STAGE="2", ARTIFACT_ROOT=str(tmp_path / "art"), CUDA_DEVICE_MAX_CONNECTIONS="1")
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", "qwen3_1p7b", "qwen3_1p7b_smoke", "qwen3_16gpu_z2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    nodes = [json.loads(l) for l in proc.stdout.splitlines()]
    argv = nodes[1]["argv"]
    assert argv[2] == "torch.distributed.run" and argv[argv.index("--node-rank") + 1] == "1"
    script = argv.index(str(checkout / "pretrain_gpt.py"))
    assert argv[script - 2:script] == ["--master-port", "6000"]
    assert argv[script + 1:] == render("qwen3_1p7b", "qwen3_1p7b_smoke", 2, tmp=tmp_path / "art", run="qwen3_16gpu_z2").args
    assert "--use-megatron-fsdp" in argv and "optim_grads" in argv
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in nodes[0]["env"]  # Megatron-FSDP: unset, not 1
    assert not (tmp_path / "art" / "data_cache").exists()  # a dry run prepares nothing

    env["MEGATRON_LM_DIR"] = str(write_checkout(tmp_path / "old", (0, 16, 1), [f for f in all_rendered_flags() if f != "--use-megatron-fsdp"]))
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", "qwen3_1p7b", "qwen3_1p7b_smoke", "r"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Megatron-LM 0.16.1 does not define --use-megatron-fsdp" in proc.stderr
    env.pop("MEGATRON_LM_DIR")
    proc = subprocess.run([sys.executable, "-m", "orchestration", "start", "qwen3_1p7b", "qwen3_1p7b_smoke", "r"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "ENGINE=megatron-lm needs MEGATRON_LM_DIR" in proc.stderr


LOG = """\
 > building train, validation, and test datasets ...
[2026-11-29 10:00:01] iteration        1/      10 | consumed samples:           32 | elapsed time per iteration (ms): 2050.3 | throughput per GPU (TFLOP/s/GPU): 310.2 | learning rate: 6.000000E-05 | global batch size:    32 | lm loss: 1.195312E+01 | loss scale: 1.0 | grad norm: 12.345 | number of skipped iterations:   0 | number of nan iterations:   0 |
[2026-11-29 10:00:02] iteration        2/      10 | consumed samples:           64 | elapsed time per iteration (ms): 1000.0 | throughput per GPU (TFLOP/s/GPU): 455.1 | learning rate: 1.200000E-04 | global batch size:    32 | lm loss: 1.102344E+01 | loss scale: 1.0 | grad norm: 8.500 | number of skipped iterations:   0 | number of nan iterations:   0 |
[2026-11-29 10:00:03] iteration        3/      10 | consumed samples:           96 | elapsed time per iteration (ms): garbled | learning rate: 1.8E-04 | global batch size:    32 | lm loss: 1.0E+01 |
[2026-11-29 10:00:04] iteration        4/      10 | consumed samples:
[2026-11-29 10:00:05] iteration        5/      10 | consumed samples:          160 | elapsed time per iteration (ms): 1010.0 | learning rate: 3.000000E-04 | global batch size:    32 | lm loss: 9.500000E+00 | loss scale: 1.0 | grad norm: 4.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def test_log_parser_reads_iteration_lines_and_counts_malformed():
    records, skipped = parse_log(LOG, seq_length=4096, world_size=32, zero_stage=1)
    assert [r.iteration for r in records] == [1, 2, 5] and skipped == 2
    second = records[1]
    assert second.lm_loss == pytest.approx(11.02344) and second.lr == pytest.approx(1.2e-4)
    assert second.step_time_s == pytest.approx(1.0) and second.tokens_per_s == pytest.approx(32 * 4096)
    assert second.tflops_per_gpu == pytest.approx(455.1) and second.grad_norm == pytest.approx(8.5)
    assert second.consumed_samples == 64 and second.global_batch_size == 32 and second.train_iters == 10
    assert records[2].tflops_per_gpu == 0.0  # without --log-throughput


def test_compare_and_status_read_megatron_lm_logs(tmp_path):
    from orchestration.compare import compare_runs
    from orchestration.node import node_status

    root = tmp_path
    (root / "logs").mkdir()
    (root / "logs" / "lm_node0.log").write_text("rank 0 says nothing\n")
    (root / "logs" / "lm_node1.log").write_text(LOG)
    params = with_batch_geometry(load_run_params("qwen3_1p7b", "qwen3_1p7b_smoke", RunOverrides(1, "megatron-lm")), 32)[0]
    runtime = RunRuntime(run="lm", run_id="lm-1", engine="megatron-lm", nnodes=4, nproc_per_node=8, hosts=("a", "b", "c", "d"),
                         gradient_accumulation_steps=1, program_argv=("pretrain_gpt.py",))
    write_resolved(RunPaths(root, "lm").params_path, ResolvedRun(params, runtime))
    [summary] = compare_runs(root, ["lm"])
    assert summary.iterations == 5 and summary.zero_stage == 1 and summary.world_size == 32
    assert summary.last_loss == pytest.approx(9.5)
    status = node_status(RunPaths(root, "lm"), 1, "n1", 4096)
    assert status["last_iteration"] == 5 and status["tokens_per_s"] == pytest.approx(32 * 4096 / 1.01)


STANDIN_PRETRAIN_GPT = '''\
"""Stand-in for Megatron-LM's pretrain_gpt.py: Megatron-LM's training needs CUDA (and main needs
Python >= 3.12), so it cannot run on these machines. This records what it was given and prints
iteration lines in Megatron-LM's exact format from the last rank, as Megatron-LM does."""
import json, os, sys, time
args = sys.argv[1:]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"seen_rank{rank}.json")
json.dump({"argv": args, "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "LAUNCHER_RUN": os.environ.get("LAUNCHER_RUN")}, open(out, "w"))
iters = int(args[args.index("--train-iters") + 1]); gbs = int(args[args.index("--global-batch-size") + 1])
for it in range(1, iters + 1):
    time.sleep(0.2)
    if rank == world - 1:
        print(f"[2026-11-29 10:00:00] iteration {it:8d}/{iters:8d} | consumed samples: {it * gbs:12d} | "
              f"elapsed time per iteration (ms): {200.0:.1f} | throughput per GPU (TFLOP/s/GPU): {1.5:.1f} | "
              f"learning rate: {3e-4:.6E} | global batch size: {gbs:5d} | lm loss: {10.0 / it:.6E} | loss scale: {1.0:.1f} | "
              f"grad norm: {1.0:.3f} | number of skipped iterations: {0:3d} | number of nan iterations: {0:3d} |", flush=True)
'''


def test_launcher_runs_the_checkout_and_reads_its_logs(tmp_path):
    """Start -> node-start -> torchrun -> $MEGATRON_LM_DIR/pretrain_gpt.py with the rendered argv and
    environment, then status and compare from Megatron-LM's log lines (stand-in script, see above)."""
    from conftest import free_port, run_script, tagged_pids, wait_for

    checkout = write_checkout(tmp_path / "Megatron-LM", (0, 16, 1), all_rendered_flags())
    (checkout / "pretrain_gpt.py").write_text(STANDIN_PRETRAIN_GPT)
    data = tmp_path / "lm.yaml"
    data.write_text((REPO / "params" / "data" / "smoke.yaml").read_text().replace("train_iters: 30", "train_iters: 6"))
    root = tmp_path / "art"
    env = clean_env(ENGINE="megatron-lm", MEGATRON_LM_DIR=str(checkout), ZERO_STAGE="3", ARTIFACT_ROOT=str(root),
                    MASTER_PORT=str(free_port()), CUDA_DEVICE_MAX_CONNECTIONS="1")
    start = run_script("start_training.sh", "gpt_smoke", str(data), "lm_run", env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    wait_for(lambda: not tagged_pids("lm_run"), 120, what="the stand-in to finish")
    seen = json.loads((checkout / "seen_rank0.json").read_text())
    params = with_batch_geometry(load_run_params("gpt_smoke", str(data), RunOverrides(3, "megatron-lm")), 2)[0]
    prepared = planned_prepared(params.data, root / "data_cache")
    assert Path(prepared.prefixes[0] + ".bin").is_file()  # the start command prepared the corpus
    assert seen["argv"] == render_pretrain_gpt(params, prepared, RunPaths(root, "lm_run"), (0, 16)).args
    assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] is None and seen["LAUNCHER_RUN"] == "lm_run"
    status = run_script("status_training.sh", "lm_run", "--json", env=env)
    node = json.loads(status.stdout.splitlines()[0])
    assert node["last_iteration"] == 6 and node["tokens_per_s"] == pytest.approx(16 * 128 / 0.2)
    compare = run_script("compare_runs.sh", "lm_run", env=env)
    assert compare.returncode == 0 and "lm_run" in compare.stdout and "1.6667" in compare.stdout, compare.stdout
    resolved = read_resolved(RunPaths(root, "lm_run").params_path)  # written once by the launcher, read back typed
    assert resolved.params == params and resolved.runtime.engine == "megatron-lm" and resolved.runtime.world_size == 2
    assert list(resolved.runtime.program_argv) == [str(checkout / "pretrain_gpt.py"), *seen["argv"]]
