"""The CUDA trainer's megatron-core objects, on the CPU: real megatron-core DDP, distributed optimizer
and Megatron-FSDP, 2 gloo ranks under torchrun, with ``device='cuda'`` made the CPU
(tests/cuda_on_cpu/shim.py says what that can and cannot prove; the GPU itself: tests/gpu/).

- Resume is exact at every stage: a run stopped after step 3 and loaded into a new model and
  optimizer gives the same loss at steps 4-6 as one never stopped. What this project did before
  fails here: stage 1 saved only the distributed optimizer's state_dict (param groups and step:
  the moments come back as uninitialised memory, the run goes NaN), stages 2-3 fed it back to
  load_state_dict (KeyError 'param_groups' under Megatron-FSDP).
- A NaN gradient stops the run before the update, naming the rank: megatron-core DDP's own bucket
  check (stages 0-1), the global norm before the step (Megatron-FSDP, stages 2-3).
- Stage 2 gathers the parameters once per step whatever the micro-batches (the adapter's default
  units); with TransformerLayer as the unit, as passed before, it gathered each layer again in
  forward and backward: ZeRO-3's traffic while running ZeRO-2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, free_port

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "cuda_on_cpu" / "worker.py"


def run_worker(mode: str, stage: int, out) -> subprocess.CompletedProcess:
    if stage >= 2:
        from megatron_ext.training.compat import megatron_fsdp_incompatibility

        if reason := megatron_fsdp_incompatibility():  # megatron-core 0.14 on this torch (the program refuses it)
            pytest.skip(reason)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(WORKER), mode, "--stage", str(stage),
                           "--out", str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("stage", range(4))
def test_resume_is_exact_at_every_stage(stage, tmp_path):
    proc = run_worker("resume", stage, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / f"resume_z{stage}.json").read_text())
    uninterrupted = {int(k): v for k, v in result["uninterrupted"].items()}
    resumed = {int(k): v for k, v in result["resumed"].items()}
    assert resumed == {step: uninterrupted[step] for step in (4, 5, 6)}, (resumed, uninterrupted)
    files = set(result["files"])
    assert {"meta.json", "rank0.pt", "rank1.pt"} <= files
    assert ("replicated.pt" in files) == (stage == 0)  # stage 0's optimizer state written once, not by every rank
    if stage == 1:
        assert "NaN" in result["state_dict_only"] or result["state_dict_only"] != result["resumed"], result
    if stage >= 2:
        assert result["state_dict_roundtrip"] == "KeyError: 'param_groups'"
    # export_hf reads this layout too: DDP's bf16 weights (stages 0-1), Megatron-FSDP's fp32 main
    # weights under its module. prefix (stages 2-3), in one process, as GPT-2 tensors.
    exported = exportable_weights(tmp_path / f"checkpoints_z{stage}" / "iter_0000003")
    assert len(exported) == 52 and exported["transformer.wte.weight"].shape == (256, 128)


def exportable_weights(checkpoint):
    import torch

    from megatron_ext.export_hf import read_model_weights
    from megatron_ext.run_spec.params import load_model
    from megatron_ext.training.hf_weights import megatron_to_hf
    from megatron_ext.training.model import build_gpt_model, ensure_model_parallel

    ensure_model_parallel()
    preset = load_model("gpt_smoke")
    with torch.device("meta"):
        template = {k: v for k, v in build_gpt_model(preset, 256, 32, perform_initialization=False).state_dict().items()
                    if isinstance(v, torch.Tensor)}
    return megatron_to_hf(read_model_weights(checkpoint, template), preset, "gpt2", 256)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_nan_gradient_stops_before_the_update_naming_the_rank(stage, tmp_path):
    proc = run_worker("nan", stage, tmp_path)
    assert proc.returncode != 0
    told = json.loads((tmp_path / "nan_rank1.json").read_text())
    assert told["unchanged"], told  # the update was not applied
    if stage < 2:  # megatron-core DDP's bucket check, on the rank that has the NaN
        assert "Rank 1, node" in told["error"] and "found NaN in local grad norm for bucket" in told["error"], told
    else:  # Megatron-FSDP: the global norm, every rank knows, and names rank 1
        both = [json.loads((tmp_path / f"nan_rank{r}.json").read_text()) for r in (0, 1)]
        assert all("non-finite gradients (global gradient norm nan): the loss of rank(s) 1 was not finite" in b["error"]
                   and b["unchanged"] for b in both), both


def test_stage_2_gathers_the_parameters_once_per_step(tmp_path):
    proc = run_worker("gathers", 2, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads((tmp_path / "gathers_z2.json").read_text())
    assert counts["default"] == [1, 1], counts  # 1 or 4 micro-batches: one gather per step, after the update
    assert min(counts["layers"]) > 1, counts  # layer units: gathered again in forward and backward (ZeRO-3's traffic)
