"""The training program for real: torchrun, gloo, megatron-core GPTModel and GPTDataset on CPU."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import types

import pytest

from megatron_ext.pretrain import QUIET_WARNINGS

from conftest import REPO, clean_env, run_torchrun
from run_checks import check_memory

STAGE_ITERS = 12


class StageRuns(dict):
    """gpt_smoke on the embedded corpus, 2 processes, under a ZeRO stage: each stage run once, when
    a test first asks for it (the tests here ask for stage 0 only: the other stages run in the ZeRO
    sweep of tests/test_compare.py)."""

    def __init__(self, artifact_root):
        super().__init__()
        self.artifact_root = artifact_root

    def __missing__(self, stage: int):
        proc, records = run_torchrun(self.artifact_root, f"stages2_z{stage}", nproc=2, train_iters=STAGE_ITERS,
                                     ZERO_STAGE=str(stage))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert len(records) == STAGE_ITERS
        self[stage] = (proc, records)
        return self[stage]


@pytest.fixture(scope="module")
def stage_runs(artifact_root):
    return StageRuns(artifact_root)


@pytest.mark.smoke
def test_two_processes_train_smoke_and_loss_falls(stage_runs):
    """The fast tier's one torchrun (``-m "not slow"``): 2 processes, 12 iterations, the loss falls."""
    proc, records = stage_runs[0]
    losses = [r["lm_loss"] for r in records]
    first, last5 = losses[0], sum(losses[-5:]) / 5
    # Measured: first 7.656, mean of the last 5 about 6.8 (uniform over 2,048 tokens is 7.62).
    assert last5 < first - 0.6, losses
    assert records[-1]["world_size"] == 2
    assert "iteration       12/      12 | consumed samples:          192" in proc.stdout
    assert "throughput per GPU (TFLOP/s/GPU)" in proc.stdout and "progress: 12/12" in proc.stdout
    assert records[-1]["tokens_per_s"] > 0 and records[-1]["tflops_per_gpu"] > 0
    # rank 0 alone says each warning, once; the listed ones not at all (megatron_ext/pretrain.py)
    shown = [line for line in (proc.stdout + proc.stderr).splitlines() if re.search(r"\w+Warning: ", line)]
    assert len(shown) == len(set(shown)) and not [w for w in shown if any(re.search(m, w) for _, m, _ in QUIET_WARNINGS)], shown


def test_warnings_once_on_rank_0_less_the_listed_ones():
    """megatron-core's deprecations reach rank 0's log once (they say what its next release
    changes); the listed ones, which ask nothing of a user, and every other rank's, do not."""
    import uuid
    import warnings

    from megatron_ext.pretrain import configure_warnings

    def emit(module: str, message: str, category=DeprecationWarning) -> None:  # from two places in the module
        for line in (7, 8):
            warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", line, module=module)

    deprecation = f"Warning: tp_group is None, using default tp group ({uuid.uuid4().hex})"  # not seen before here
    with warnings.catch_warnings(record=True) as seen:
        configure_warnings("0")
        emit("megatron.core.tensor_parallel.layers", deprecation)
        emit("megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back", UserWarning)
        emit("torch.jit._script", "`torch.jit.script_method` is deprecated.")
    assert [str(w.message) for w in seen] == [deprecation]
    with warnings.catch_warnings(record=True) as seen:
        configure_warnings("1")
        emit("megatron.core.tensor_parallel.layers", deprecation + " again")
    assert seen == []


@pytest.mark.slow
def test_rank_0_writes_tensorboard_events(stage_runs, artifact_root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, records = stage_runs[0]  # the run that writes the folder first: the fixture runs stages lazily
    events = EventAccumulator(str(artifact_root / "runs" / "stages2_z0" / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("lm loss")]
    assert losses == pytest.approx([r["lm_loss"] for r in records], rel=1e-6)
    assert {"learning-rate", "grad-norm", "throughput/tokens-per-s", "memory/model-state-bytes"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
def test_qwen3_shaped_smoke_trains_identically_under_stage_0_and_3(artifact_root):
    """RoPE (kept on the CPU on every megatron-core release, see training/megatron_core_apis.py), RMSNorm,
    QK-layernorm, SwiGLU and grouped-query attention through the SDPA core attention."""
    losses = {}
    for stage in (0, 3):
        proc, records = run_torchrun(artifact_root, f"qwen3_smoke_z{stage}", model="qwen3_smoke", train_iters=4,
                                     ZERO_STAGE=str(stage))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "attention sdpa" in proc.stdout
        losses[stage] = [r["lm_loss"] for r in records]
    assert len(losses[0]) == 4
    for a, b in zip(losses[0], losses[3], strict=True):
        assert abs(a - b) / a <= 1e-5


# Every stage at 2 processes (the same loss, these bytes per rank): tests/test_compare.py, on the
# ZeRO sweep's four runs, which check_memory reads too.
@pytest.mark.slow
def test_model_state_bytes_follow_the_stage_at_4_processes(artifact_root):
    """Stage 2 at 4 ranks, the stage whose formula has both terms (4 bytes per parameter whole,
    12 sharded at the peak; 16 sharded between steps): the shards follow d = 4, not only d = 2."""
    proc, records = run_torchrun(artifact_root, "stages4_z2", nproc=4, train_iters=3, ZERO_STAGE="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_memory({2: records}, 4)


BAD_INPUTS = [
    (["--model", "gpt5", "--data", "smoke"], {}, "unknown model 'gpt5'"),
    (["--model", "gpt_smoke", "--data", "nosuch"], {}, "unknown data set 'nosuch'"),
    (["--model", "gpt_smoke", "--data", "smoke"], {"ZERO_STAGE": "7"}, "ZERO_STAGE='7' is not a ZeRO stage"),
    (["--model", "gpt2", "--data", "gpt2_smoke"], {"WORLD_SIZE": "3"},
     "global_batch_size=64 is not divisible by micro_batch_size(2) x data_parallel_size(3) = 6"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,env,message", BAD_INPUTS)
def test_bad_input_is_one_message(args, env, message, tmp_path):
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_ext.pretrain", *args], cwd=REPO,
                          env=clean_env(ARTIFACT_ROOT=str(tmp_path), **env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert time.time() - start < 30


@pytest.mark.slow
def test_unknown_yaml_key_and_missing_data_path(tmp_path):
    bad_key = tmp_path / "bad_key.yaml"
    bad_key.write_text("training:\n  global_batch: 16\n")
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"data:\n  source: files\n  paths: [{tmp_path}/nowhere.jsonl]\n")
    for data, message in ((bad_key, "unknown key 'global_batch'"), (missing, "nowhere.jsonl does not exist")):
        proc, _ = run_torchrun(tmp_path, "bad", nproc=2, data=str(data), timeout=120)
        assert proc.returncode != 0
        assert message in proc.stderr
        assert proc.stderr.count(message) == 1  # rank 0 alone speaks
        # No rank prints a traceback; torchrun's own one-screen failure summary follows.
        assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr


def test_after_import_runs_right_after_the_module_s_own_code(tmp_path, monkeypatch):
    from megatron_ext.import_hooks import _disable_jit_fuser, after_import

    (tmp_path / "hooked_pkg").mkdir()
    (tmp_path / "hooked_pkg" / "__init__.py").write_text("")
    (tmp_path / "hooked_pkg" / "jit.py").write_text("fuser = 'compile'\ndef disable():\n    global fuser\n    fuser = 'eager'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hooked_pkg.jit", "hooked_pkg"):  # gone again after the test
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = list(sys.meta_path)
    seen = []
    assert not after_import("hooked_pkg.jit", lambda m: (m.disable(), seen.append(m.__name__)))
    assert len(sys.meta_path) == len(before) + 1
    from hooked_pkg.jit import fuser  # what an importer takes is what the hook left

    assert fuser == "eager" and seen == ["hooked_pkg.jit"] and sys.meta_path == before  # the finder took itself out
    assert "exec_module" not in vars(sys.modules["hooked_pkg.jit"].__loader__)  # the loader is its own again
    assert after_import("hooked_pkg.jit", lambda m: seen.append("now")) and seen[-1] == "now"
    older = types.SimpleNamespace(jit_fuser=lambda f: "compiled")  # a megatron-core without disable_jit_fuser
    _disable_jit_fuser(older)
    assert older.jit_fuser(len) is len


@pytest.mark.slow
def test_a_cpu_rank_imports_megatron_core_with_its_jit_fuser_eager():
    """What the program does on a rank without CUDA (pretrain.py): megatron-core's functions
    decorated with its jit_fuser stay plain functions: its import calls torch.compile on none of them
    (3 s of every CPU rank's start: docs/training-program.md)."""
    code = ("import torch\n"
            "compiled = []\n"
            "real_compile = torch.compile\n"
            "torch.compile = lambda *a, **k: compiled.append(a) or real_compile(*a, **k)\n"
            "from megatron_ext.import_hooks import eager_jit_fuser\n"
            "assert eager_jit_fuser()\n"
            "import megatron.core\n"
            "from megatron.core import jit\n"
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
            "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser\n"
            "assert not hasattr(bias_gelu, '_torchdynamo_orig_callable'), bias_gelu\n"
            "itself = ('InferenceTopKRouter.',)  # 0.19 compiles this one itself, not through jit_fuser\n"
            "others = [a for a in compiled if not getattr(a[0], '__qualname__', '').startswith(itself)]\n"
            "assert others == [], others\n"
            "assert not eager_jit_fuser()  # too late once megatron-core is imported: said so\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
