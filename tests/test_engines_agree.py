"""Both engines compute the same thing: this program and NVIDIA Megatron-LM's own pretrain_gpt.py,
from the same weights, on the same data, print the same lm loss at every iteration.

    python3 -m pytest -q tests/test_engines_agree.py      # about 2-3 minutes here (2 Megatron-LM launches)

The weights: this program's gpt_smoke after one iteration (learning rate 0 under warmup, so its
initialisation), written as a Megatron-LM checkpoint by ``python -m megatron_ext.export_megatron_lm``;
both engines start from it through the same data set field, ``training.init_checkpoint`` (this
program reads it, Megatron-LM gets ``--pretrained-checkpoint``). The data: the smoke corpus prepared
once for the session, megatron-core's GPTDataset on both sides (same split, seed, batch, schedule).
Megatron-LM runs on the CPU with 2 ranks through the CUDA-on-CPU shim (tests/megatron_lm_shim),
launched by the launcher (ENGINE=megatron-lm). Skipped, saying why, without a Megatron-LM checkout
(MEGATRON_LM_DIR, or core_v0.16.1.tar.gz beside the repository) or without triton and pybind11.
The same again on Python 3.12 (.venv-py312): this program on megatron-core 0.19.2 and Megatron-LM
core_v0.19.0, from the same exported weights, which 0.19's --verify-integrity checks at its load
(skipped, saying why, without that environment or the core_v0.19.0 tarball).

Measured here: the largest relative difference of the lm loss over 20 iterations is 1.4e-7 at
ZeRO stage 0 (1.2e-6 on 0.19; the bound asserted is the issue's 1e-5; 1.3e-7 at stage 1 when this module also ran
stage 1, which now follows from the two sweeps: each engine's stages give the same loss,
tests/test_compare.py and tests/test_megatron_lm_loop.py, and CI pays for two launches fewer). Megatron-LM's line at
iteration 2 averages iterations 1 and 2 (its first line does not reset the interval's sums); the
project's log reader gives iteration 2's own loss back (``MEGATRON_LM.parse_log(...)``,
to the 7 digits the line prints). The final weights agree within 1e-6 (relative, per tensor)
except the attention's key biases, whose gradient is zero in exact arithmetic (a softmax does not
change when every score of a row moves alike): Adam turns the round-off there into steps of the
learning rate's size, so they differ by up to 2e-4 of their largest element.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import REPO, VENV_312_PYTHON, clean_env, free_port, megatron_lm_env, run_torchrun, write_data_set

ITERS = 20
LOSS_BOUND = 1e-5
"""Relative, at every iteration (the issue's target; measured 1.4e-7)."""
WEIGHT_BOUND = 1e-5
"""Relative norm of the difference, per tensor, after 20 iterations (measured 5.7e-7)."""
LOGITS_BOUND = 1e-5


def data_set(path: Path, train_iters: int, init_checkpoint: Path | None = None) -> str:
    """The smoke corpus and schedule (tests/conftest.py's), a checkpoint at the end, optionally the init."""
    write_data_set(path, train_iters, save_interval=train_iters)
    if init_checkpoint:  # the training section is the file's last
        path.write_text(path.read_text() + f"  init_checkpoint: {init_checkpoint}\n")
    return str(path)


def megatron_lm_losses(artifact_root: Path, run: str) -> dict[int, float]:
    from megatron_ext.run_spec.engines import MEGATRON_LM

    records, _ = MEGATRON_LM.parse_log(node_log(artifact_root, run))  # line 2 as iteration 2's own loss
    return {r.iteration: r.lm_loss for r in records}


def train(artifact_root: Path, data: str, run: str, stage: int = 0, checkout: Path | None = None,
          python: Path | None = None, nproc: int = 2):
    """``python -m orchestration train gpt_smoke DATA RUN`` on ``nproc`` processes: this program, or with
    ``checkout`` Megatron-LM's pretrain_gpt.py (ENGINE=megatron-lm, the CPU shim); ``python``: the
    launcher's and so the ranks' (as LAUNCHER_PYTHON makes the scripts). Returns the process and this program's
    metrics records (Megatron-LM's
    losses are in its node log)."""
    extra = dict(ARTIFACT_ROOT=str(artifact_root), NPROC_PER_NODE=str(nproc), ZERO_STAGE=str(stage),
                 MASTER_PORT=str(free_port()))  # its own: the other worker's runs share this machine
    env = megatron_lm_env(checkout, **extra) if checkout else clean_env(**extra)
    proc = subprocess.run([str(python or sys.executable), "-m", "orchestration", "train", "gpt_smoke", data, run], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    metrics = artifact_root / "runs" / run / "metrics.jsonl"
    return proc, [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def node_log(artifact_root: Path, run: str) -> str:
    return (artifact_root / "logs" / f"{run}_node0.log").read_text(errors="replace")


def max_relative(ours: dict[int, float], theirs: dict[int, float]) -> float:
    assert sorted(theirs) == list(range(1, ITERS + 1)), sorted(theirs)
    return max(abs(theirs[i] - ours[i]) / abs(ours[i]) for i in theirs)


@pytest.fixture(scope="module")
def start_weights(artifact_root, tmp_path_factory) -> Path:
    """This program's initial gpt_smoke weights as a Megatron-LM --save folder: one iteration at
    learning rate 0 (warmup), saved, exported by the product's command. One process: the weights
    are the seed's whatever the data-parallel size, and both engines start from the export (a
    rank's start, ~7 s of CPU, fewer)."""
    folder = tmp_path_factory.mktemp("engines")
    init_data = data_set(folder / "init.yaml", 1)
    proc, records = train(artifact_root, init_data, "engines_init", nproc=1)
    assert proc.returncode == 0 and len(records) == 1, (proc.stderr + node_log(artifact_root, "engines_init"))[-3000:]
    out = folder / "start"
    export = subprocess.run([sys.executable, "-m", "megatron_ext.export_megatron_lm", "--artifact-root", str(artifact_root),
                             "--run", "engines_init", "--out", str(out)], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    assert "as a Megatron-LM checkpoint" in export.stdout and (out / "latest_checkpointed_iteration.txt").read_text() == "1"
    return out


@pytest.fixture(scope="module")
def stage0_runs(artifact_root, megatron_lm_checkout, start_weights, tmp_path_factory):
    """Both engines, 20 iterations at stage 0 from the same weights: (this program's losses, Megatron-LM's)."""
    data = data_set(tmp_path_factory.mktemp("engines_s0") / "from_start.yaml", ITERS, start_weights)
    proc, records = train(artifact_root, data, "engines_mc_s0")
    assert proc.returncode == 0 and len(records) == ITERS, (proc.stderr + node_log(artifact_root, "engines_mc_s0"))[-3000:]
    assert f"initialised from the Megatron-LM checkpoint {start_weights}/iter_0000001" in node_log(artifact_root, "engines_mc_s0")
    lm, _ = train(artifact_root, data, "engines_lm_s0", checkout=megatron_lm_checkout)
    log = node_log(artifact_root, "engines_lm_s0")
    assert lm.returncode == 0, (lm.stderr + log)[-4000:]
    assert re.search(rf"pretrained_checkpoint \.+ {re.escape(str(start_weights))}\n", log)  # Megatron-LM's argument dump
    assert f"successfully loaded checkpoint from {start_weights}" in log and "at iteration 0" in log, log[-3000:]
    return {r["iteration"]: r["lm_loss"] for r in records}, megatron_lm_losses(artifact_root, "engines_lm_s0"), data


@pytest.fixture(scope="module")
def stage0_runs_019(artifact_root, megatron_lm_019_checkout, start_weights, tmp_path_factory):
    """The same on Python 3.12: this program on megatron-core 0.19.2, Megatron-LM core_v0.19.0, from
    the same exported weights (their integrity.json checked by Megatron-LM's --verify-integrity)."""
    data = data_set(tmp_path_factory.mktemp("engines_s0_019") / "from_start.yaml", ITERS, start_weights)
    proc, records = train(artifact_root, data, "engines_mc_s0_019", python=VENV_312_PYTHON)
    assert proc.returncode == 0 and len(records) == ITERS, (proc.stderr + node_log(artifact_root, "engines_mc_s0_019"))[-3000:]
    lm, _ = train(artifact_root, data, "engines_lm_s0_019", checkout=megatron_lm_019_checkout, python=VENV_312_PYTHON)
    log = node_log(artifact_root, "engines_lm_s0_019")
    assert lm.returncode == 0, (lm.stderr + log)[-4000:]
    assert re.search(r"verify_integrity \.+ True\n", log)  # so the export's manifest passed megatron-core's check
    assert f"successfully loaded checkpoint from {start_weights}" in log and "at iteration 0" in log, log[-3000:]
    return {r["iteration"]: r["lm_loss"] for r in records}, megatron_lm_losses(artifact_root, "engines_lm_s0_019")


@pytest.mark.slow
def test_same_loss_at_every_iteration_at_stage_0_on_0_19(stage0_runs_019):
    ours, theirs = stage0_runs_019
    measured = max_relative(ours, theirs)
    print(f"stage 0, megatron-core 0.19.2 / Megatron-LM core_v0.19.0: max relative difference {measured:.2e}")
    assert measured <= LOSS_BOUND, {i: (ours[i], theirs[i]) for i in theirs}


@pytest.mark.slow
def test_same_loss_at_every_iteration_at_stage_0(stage0_runs):
    ours, theirs, _ = stage0_runs
    measured = max_relative(ours, theirs)
    print(f"stage 0: lm loss of the two engines over {ITERS} iterations: max relative difference {measured:.2e}")
    assert measured <= LOSS_BOUND, {i: (ours[i], theirs[i]) for i in theirs}


@pytest.mark.slow
def test_final_weights_agree_and_megatron_lm_s_checkpoint_exports_to_transformers(stage0_runs, artifact_root, tmp_path):
    """Megatron-LM's checkpoint of iteration 20, read by this program, holds this program's weights
    of iteration 20; export_hf on the Megatron-LM run writes a directory transformers loads, with
    the logits of this program's model holding those weights."""
    from transformers import AutoModelForCausalLM

    from megatron_ext.export_hf import read_model_weights
    from megatron_ext.run_spec.megatron_lm_checkpoints import find_megatron_lm_checkpoint
    from megatron_ext.run_spec.params import load_model
    from megatron_ext.training.megatron_on_cpu import install_megatron_on_cpu
    from megatron_ext.training.megatron_lm_weights import load_megatron_lm_weights, read_megatron_lm_weights
    from megatron_ext.training.model import build_gpt_model, ensure_model_parallel

    ensure_model_parallel()
    install_megatron_on_cpu(1234)
    preset = load_model("gpt_smoke")
    model = build_gpt_model(preset, 2048, 128)
    theirs_checkpoint = find_megatron_lm_checkpoint(artifact_root / "runs" / "engines_lm_s0" / "checkpoints")
    assert theirs_checkpoint.iteration == ITERS
    theirs = read_megatron_lm_weights(theirs_checkpoint, model, "gpt_smoke")
    ours = read_model_weights(artifact_root / "runs" / "engines_mc_s0" / "checkpoints" / f"iter_{ITERS:07d}",
                              {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})
    per_head = preset.hidden_size // preset.num_attention_heads
    differences = {}
    for name, tensor in ours.items():
        a, b = tensor, theirs[name]
        if name.endswith("linear_qkv.bias"):  # [q, k, v] per head: leave out the key biases (module docstring)
            keep = torch.arange(a.numel()).reshape(preset.num_attention_heads, 3, per_head)[:, [0, 2]].flatten()
            a, b = a[keep], b[keep]
        differences[name] = float((a - b).norm() / a.norm())
    print(f"weights after {ITERS} iterations: max relative difference {max(differences.values()):.2e}")
    assert max(differences.values()) <= WEIGHT_BOUND, sorted(differences.items(), key=lambda kv: -kv[1])[:3]

    out = tmp_path / "hf"
    export = subprocess.run([sys.executable, "-m", "megatron_ext.export_hf", "--artifact-root", str(artifact_root),
                             "--run", "engines_lm_s0", "--out", str(out)], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    assert f"exported iter_{ITERS:07d} of run engines_lm_s0 (Megatron-LM's) (gpt2, float32, vocabulary 2048)" in export.stdout
    load_megatron_lm_weights(model, theirs_checkpoint, "gpt_smoke")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(tokens, torch.arange(64).expand(2, 64), None)
        got = hf(tokens).logits
    relative = float((got - expected).abs().max() / expected.abs().max())
    print(f"transformers' logits from Megatron-LM's checkpoint: max relative difference {relative:.2e}")
    assert relative <= LOGITS_BOUND


@pytest.mark.slow
def test_own_checkpoints_win_over_init_checkpoint_and_a_bad_one_is_one_message(stage0_runs, artifact_root, tmp_path):
    """A run with checkpoints of its own resumes from them and never reads init_checkpoint; a fresh
    run given a folder that is not a Megatron-LM checkpoint stops with one message (every rank finds
    it; rank 0 says it, exit code 2, which torchrun reports as its own 1)."""
    not_a_checkpoint = tmp_path / "not_a_checkpoint"
    not_a_checkpoint.mkdir()
    data = data_set(tmp_path / "bad.yaml", ITERS, not_a_checkpoint)
    fresh, _ = run_torchrun(artifact_root, "engines_bad_init", data=data)
    assert fresh.returncode != 0, fresh.stderr[-3000:]
    message = (f"training.init_checkpoint={not_a_checkpoint} is not a Megatron-LM checkpoint: no "
               "latest_checkpointed_iteration.txt and no iter_NNNNNNN folder")
    # one line from rank 0 and no rank's traceback (torchrun prints its own ChildFailedError)
    assert (fresh.stdout + fresh.stderr).count(message) == 1 and "UserError" not in fresh.stderr, fresh.stderr[-3000:]
    resumed, records = run_torchrun(artifact_root, "engines_mc_s0", data=data, train_iters=ITERS + 1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from iteration {ITERS}" in resumed.stdout and "initialised from" not in resumed.stdout
    assert records[-1]["iteration"] == ITERS + 1
