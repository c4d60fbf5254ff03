"""Stage 2-3 checkpoints of a SwiGLU model (Qwen3, Llama) in Megatron-LM's fsdp_dtensor layout,
read and written by Megatron-LM's own checkpointing code: the CUDA trainer on the CPU through the
device shim, 1 and 2 gloo ranks under torchrun (tests/cuda_on_cpu/swiglu_checkpoint.py says what of
Megatron-LM runs and why the rest does not).

    python3 -m pytest -q tests/test_fsdp_dtensor_layout.py

- The checkpoint holds the tensors Megatron-LM's save writes, by name and shape: every
  ``linear_fc1.weight`` and its Adam moments as the halves ``_w`` and ``_v``, no fused fc1 (it used
  to hold the fused one, which Megatron-LM's loader does not ask for).
- Megatron-LM's load (its fsdp_dtensor path) reads this project's checkpoint: every fp32 main
  weight, Adam moment and step as saved, bit for bit, and the next three losses those of the run
  never stopped.
- This project loads what Megatron-LM's save wrote: the next three losses those of the run never
  stopped, bit for bit.
- A checkpoint of the layout this project wrote before (fc1 whole) still resumes exactly, and the
  exporter reads the halves back as one fc1.
- This project's own resume of the SwiGLU model is exact at 2 ranks and at 1 (Megatron-FSDP's
  ``no_shard``, whose parameters megatron-core's split does not cut by itself), the 1-rank
  checkpoint holds the same tensors, and 2 ranks continue it with the losses of the 1-rank run
  never stopped (the first step within 1e-6, the next within 1e-3, as in
  tests/test_cuda_trainer_on_cpu.py: the gradients are reduced in another order).
- Megatron-LM core_v0.16.1's checkout with megatron-core 0.16.1 (Python 3.11), and again
  megatron-core 0.19.2 on Python 3.12 (``.venv-py312``), whose wheel ships Megatron-LM
  core_v0.19.0's ``megatron/training`` (checked equal to the core_v0.19.0 tarball's
  ``checkpointing.py``).

Skipped, saying why, without a Megatron-LM checkout (``MEGATRON_LM_DIR``, or the core_v0.16.1
tarball beside the repository); the Python 3.12 half without ``.venv-py312`` or the core_v0.19.0
tarball.
"""

from __future__ import annotations

import json
import sys
import tarfile

import pytest

from conftest import MEGATRON_LM_TARBALL, REPO, clean_env, free_port, run_session

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "cuda_on_cpu" / "swiglu_checkpoint.py"
VENV_PYTHON = REPO / ".venv-py312" / "bin" / "python"
MEGATRON_LM_019_TARBALL = MEGATRON_LM_TARBALL.with_name("core_v0.19.0.tar.gz")
LAYERS, FC1_HALF = 4, [384, 128]  # qwen3_smoke: ffn_hidden_size 384 (fc1: 2 x 384 rows), hidden 128


def run_worker(out, *extra: str, nproc: int = 2, python: str = sys.executable, env: dict | None = None):
    out.mkdir(parents=True, exist_ok=True)
    proc = run_session([python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                        "127.0.0.1", "--master-port", str(free_port()), str(WORKER), "--stage", "2,3", "--out", str(out),
                        *extra], env or clean_env(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"), 900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def megatron_core_016(tmp_path_factory, megatron_lm_checkout):
    """One rank (this project's save and load only), then two (both ways, and the 1-rank
    checkpoints continued), megatron-core 0.16.1 and Megatron-LM's core_v0.16.1 checkout."""
    root = tmp_path_factory.mktemp("fsdp_dtensor_016")
    run_worker(root / "one", "--only-ours", nproc=1)
    env = clean_env(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", MEGATRON_LM_DIR=str(megatron_lm_checkout))
    run_worker(root / "two", "--reshard-from", str(root / "one"), env=env)
    used = json.loads((root / "two" / "swiglu_z2.json").read_text())["megatron_lm_checkpointing"]
    assert used.startswith(str(megatron_lm_checkout)), used
    return root


@pytest.fixture(scope="module")
def megatron_core_019(tmp_path_factory):
    """Two ranks, both ways, on Python 3.12 with megatron-core 0.19.2 and the Megatron-LM
    ``megatron/training`` its wheel ships (core_v0.19.0's, checked against the tarball)."""
    if not VENV_PYTHON.exists():
        pytest.skip(f"no {VENV_PYTHON}; build it with `bash .ci/py312_env.sh`")
    if not MEGATRON_LM_019_TARBALL.is_file():
        pytest.skip(f"no Megatron-LM core_v0.19.0 tarball at {MEGATRON_LM_019_TARBALL}")
    with tarfile.open(MEGATRON_LM_019_TARBALL) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/megatron/training/checkpointing.py"))
        tagged = tar.extractfile(member).read()
    root = tmp_path_factory.mktemp("fsdp_dtensor_019")
    env = clean_env(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=str(REPO))
    env.pop("VIRTUAL_ENV", None)
    run_worker(root / "two", python=str(VENV_PYTHON), env=env)
    used = json.loads((root / "two" / "swiglu_z2.json").read_text())["megatron_lm_checkpointing"]
    assert used.startswith(str(REPO / ".venv-py312")), used
    with open(used, "rb") as f:
        assert f.read() == tagged, f"{used} is not core_v0.19.0's megatron/training/checkpointing.py"
    return root


@pytest.fixture(scope="module", params=["megatron_core_016", "megatron_core_019"],
                ids=["megatron-core-0.16.1", "megatron-core-0.19.2"])
def two_ranks(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=[2, 3], ids=lambda s: f"stage{s}")
def result(request, two_ranks) -> dict:
    return json.loads((two_ranks / "two" / f"swiglu_z{request.param}.json").read_text())


def losses(result: dict, name: str, steps=(4, 5, 6)) -> dict[int, float]:
    return {int(k): v for k, v in result[name].items() if int(k) in steps}


def test_the_checkpoint_holds_the_tensors_megatron_lm_writes(result):
    ours, theirs = result["ours_tensors"], result["megatron_lm_tensors"]
    assert ours == theirs, sorted(set(ours) ^ set(theirs))
    for layer in range(LAYERS):
        fc1 = f"decoder.layers.{layer}.mlp.linear_fc1.weight"
        assert f"model.module.{fc1}" not in ours
        for half in ("_w", "_v"):
            assert ours[f"model.module.{fc1}{half}"] == FC1_HALF
            for moment in ("exp_avg", "exp_avg_sq"):
                assert ours[f"optimizer.state.module.module.module.{fc1}{half}.{moment}"] == FC1_HALF


def test_megatron_lm_reads_this_project_s_checkpoint(result):
    assert max(result["empty_shards"]) > 0, result["empty_shards"]  # the case Megatron-LM's own template misses
    assert all(result["read_by_megatron_lm_equal"]), result["read_by_megatron_lm_equal"]  # weights, moments, steps
    assert losses(result, "read_by_megatron_lm") == losses(result, "uninterrupted"), result


def test_this_project_reads_megatron_lm_s_checkpoint(result):
    assert losses(result, "from_megatron_lm") == losses(result, "uninterrupted"), result


def test_this_project_s_resume_of_a_swiglu_model_is_exact(result):
    assert losses(result, "resumed") == losses(result, "uninterrupted"), result


def test_a_checkpoint_of_the_layout_before_still_resumes(result):
    """Stage 2-3 checkpoints this project wrote before it took Megatron-LM's layout hold fc1 whole:
    the load reads the checkpoint's own layout and resumes them exactly (a run of days is not
    stranded by the upgrade)."""
    assert losses(result, "from_fused") == losses(result, "uninterrupted"), result


def test_the_exporter_reads_the_halves_as_one_fc1(megatron_core_016):
    """export_hf (and export_megatron_lm, which reads through it) joins the halves: the fc1 it
    reads is the w rows, then the v rows, as the model holds them."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_ext.export_hf import read_model_weights
    from megatron_ext.run_spec.params import load_model
    from megatron_ext.training.model import build_gpt_model, ensure_model_parallel

    ensure_model_parallel()
    with torch.device("meta"):
        template = {k: v for k, v in build_gpt_model(load_model("qwen3_smoke"), 256, 32,
                                                     perform_initialization=False).state_dict().items()
                    if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    checkpoint = megatron_core_016 / "two" / "ours_z2" / "iter_0000003"
    weights = read_model_weights(checkpoint, template)
    assert set(weights) == set(template)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    halves = {f"model.module.{fc1}{h}": torch.empty(FC1_HALF) for h in ("_w", "_v")}
    dcp.load(halves, checkpoint_id=str(checkpoint), no_dist=True)
    assert weights[fc1].shape == (2 * FC1_HALF[0], FC1_HALF[1])
    assert torch.equal(weights[fc1], torch.cat([halves[f"model.module.{fc1}_w"], halves[f"model.module.{fc1}_v"]]))


@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_resumes_exactly_and_continues_at_two(stage, megatron_core_016):
    one = json.loads((megatron_core_016 / "one" / f"swiglu_z{stage}.json").read_text())
    two = json.loads((megatron_core_016 / "two" / f"swiglu_z{stage}.json").read_text())
    assert one["empty_shards"] == [0]  # no_shard: the rank holds every parameter whole
    assert losses(one, "resumed") == losses(one, "uninterrupted"), one
    assert one["ours_tensors"] == two["ours_tensors"]  # the same layout at one rank
    expected, got = losses(one, "uninterrupted"), losses(two, "resharded")  # the run that wrote it, never stopped
    assert got[4] == pytest.approx(expected[4], rel=1e-6), (got, expected)
    for step in (5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-3), (got, expected)
