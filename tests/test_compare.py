"""The ZeRO sweep and the comparison for real: compare_zero_stages.sh runs gpt_smoke under each
stage with torchrun on 2 CPU processes, one stage after another; a stage killed as the
out-of-memory killer kills is reported and the sweep goes on; stop PREFIX and Ctrl-C stop the
current stage; compare_runs.sh writes a PNG, JSON and CSV that agree."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import signal
import statistics
import subprocess
from pathlib import Path

import pytest

from megatron_ext.run_spec.iteration_log import read_metrics
from megatron_ext.run_spec.params import RunOverrides, load_model, load_run_params, with_batch_geometry
from megatron_ext.run_spec.resolved import ResolvedRun, RunRuntime, write_resolved
from megatron_ext.run_spec.run_paths import RunPaths
from orchestration.analysis.compare import DEFAULT_WARMUP_ITERATIONS
from orchestration.analysis.memory_plan import DEVICES, plan_memory
from megatron_ext.host.procfs import process_environ
from megatron_ext.run_spec.zero import parse_stages
from orchestration.node.failure import failure_reason

from run_checks import check_memory
from conftest import REPO, clean_env, free_port, run_script, tagged_pids, wait_for, write_data_set

ITERS = 6
PREFIX = "sweep_cmp"


def sweep_env(root: Path, **extra: str) -> dict[str, str]:
    return clean_env(ARTIFACT_ROOT=str(root), MASTER_PORT=str(free_port()), NPROC_PER_NODE="2", **extra)


@contextlib.contextmanager
def running_sweep(root: Path, tmp_path: Path, prefix: str, stages: str):
    """compare_zero_stages.sh gpt_smoke <200 iterations> PREFIX as a user starts it in a terminal: SIGINT
    at its default, as the foreground job has it, even where pytest itself was started in the background
    with ``&`` (a shell without job control starts those with SIGINT ignored, and Python keeps that);
    killed if the test leaves it running."""
    data = write_data_set(tmp_path / "long.yaml", train_iters=200)
    sweep = subprocess.Popen(["bash", str(REPO / "training_scripts" / "compare_zero_stages.sh"), "gpt_smoke", data, prefix],
                             env=sweep_env(root, STAGES=stages), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield sweep
    finally:
        if sweep.poll() is None:
            sweep.kill()


@pytest.fixture(scope="module")
def sweep(artifact_root, tmp_path_factory):
    """compare_zero_stages.sh gpt_smoke <6 iterations> sweep_cmp: stages 0-3, 2 processes each."""
    data = write_data_set(tmp_path_factory.mktemp("sweep") / "six.yaml", train_iters=ITERS)
    proc = run_script("compare_zero_stages.sh", "gpt_smoke", data, PREFIX, env=sweep_env(artifact_root), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    records = {s: read_metrics(RunPaths(artifact_root, f"{PREFIX}_z{s}").metrics_path) for s in range(4)}
    return proc, records, artifact_root


@pytest.mark.slow
def test_sweep_runs_every_stage_to_the_end_with_the_same_loss(sweep):
    proc, records, _ = sweep
    lines = proc.stdout.splitlines()
    for s in range(4):  # one line per stage, in order
        assert any(l.startswith(f"stage {s} ({PREFIX}_z{s}): done in ") and f"{ITERS}/{ITERS} iterations" in l for l in lines)
        assert [r.iteration for r in records[s]] == list(range(1, ITERS + 1)) and records[s][-1].zero_stage == s
    for s in (1, 2, 3):
        for a, b in zip(records[0], records[s], strict=True):
            assert abs(b.lm_loss - a.lm_loss) / abs(a.lm_loss) <= 1e-5, (s, a.iteration, a.lm_loss, b.lm_loss)
    assert not any(tagged_pids(f"{PREFIX}_z{s}") for s in range(4))


@pytest.mark.slow
def test_sweep_model_state_bytes_fall_with_the_stage_and_match_the_plan(sweep):
    _, records, _ = sweep
    now = {s: records[s][-1].model_state_bytes_per_rank for s in range(4)}
    peak = {s: records[s][-1].model_state_peak_bytes_per_rank for s in range(4)}
    assert max(peak[0]) > max(peak[1]) > max(peak[2]) > max(peak[3])  # 16, 12, 10, 8 bytes per parameter
    assert max(now[0]) > max(now[1]) > max(now[2]) >= max(now[3])     # 16, 12, 8, 8
    plan = plan_memory(load_model("gpt_smoke"), vocab_size=2048, nnodes=1, nproc_per_node=2, seq_length=128,
                       micro_batch_size=4, precision="fp32", device=DEVICES["cpu"])
    for s in range(4):
        for measured, planned in ((now[s], plan.stage(s).states_bytes), (peak[s], plan.stage(s).states_peak_bytes)):
            for rank_bytes in measured:
                assert abs(rank_bytes - planned) <= 0.05 * planned, (s, rank_bytes, planned)
    # And against facts.md's formula, every rank, between steps and at the peak (test_training.py
    # checks it at 4 ranks).
    check_memory({s: [dataclasses.asdict(r) for r in records[s]] for s in range(4)}, 2)


@pytest.mark.slow
def test_sweep_table_png_json_and_csv_agree(sweep):
    proc, records, root = sweep
    doc = json.loads((root / "compare" / f"{PREFIX}.json").read_text())
    with open(root / "compare" / f"{PREFIX}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert doc["name"] == PREFIX and doc["base_run"] == f"{PREFIX}_z0" and doc["warmup_iterations"] == DEFAULT_WARMUP_ITERATIONS
    assert [r["run"] for r in doc["runs"]] == [r["run"] for r in rows] == [f"{PREFIX}_z{s}" for s in range(4)]
    table = proc.stdout[proc.stdout.index("run(s); step time"):]
    for s, (j, c) in enumerate(zip(doc["runs"], rows)):
        steady = [r for r in records[s] if r.iteration > DEFAULT_WARMUP_ITERATIONS]
        expected = {
            "tokens_per_s": statistics.median(r.tokens_per_s for r in steady),
            "step_time_s": statistics.median(r.step_time_s for r in steady),
            "last_loss": records[s][-1].lm_loss,
            "model_state_bytes": max(records[s][-1].model_state_bytes_per_rank),
            "peak_memory_bytes": max(records[s][-1].model_state_peak_bytes_per_rank),
        }
        for key, value in expected.items():
            assert j[key] == pytest.approx(value) and float(c[key]) == pytest.approx(value), (s, key)
        assert j["zero_stage"] == int(c["zero_stage"]) == s and j["status"] == c["status"] == "finished"
        assert j["engine"] == c["engine"] == "megatron-core" and (j["nnodes"], j["nproc_per_node"]) == (1, 2)
        assert j["losses"] == [[r.iteration, r.lm_loss] for r in records[s]]
        assert float(c["planned_model_state_bytes"]) == j["planned_model_state_bytes"] > 0
        assert float(c["tokens_per_s_ratio"]) == pytest.approx(j["tokens_per_s"] / doc["runs"][0]["tokens_per_s"])
        if s:
            assert j["max_loss_diff_rel"] <= 1e-5 and float(c["max_loss_diff_abs"]) == pytest.approx(j["max_loss_diff_abs"])
        row = next(l for l in table.splitlines() if l.startswith(f"{PREFIX}_z{s} "))
        assert f"{expected['last_loss']:.4f}" in row and f"{expected['tokens_per_s']:,.0f}" in row and row.endswith("finished")
        assert f"{expected['model_state_bytes'] / 1e6:,.1f}" in row
    assert "medians over iterations after the first 2 (warm-up)" in proc.stdout


@pytest.mark.slow
def test_sweep_png_is_a_real_chart(sweep):
    from PIL import Image

    _, _, root = sweep
    image = Image.open(root / "compare" / f"{PREFIX}.png").convert("RGB")
    assert image.size == (1500, 1000)
    colours = {c for _, c in image.getcolors(maxcolors=1_000_000)}
    assert len(colours) > 50  # lines, bars, text antialiasing
    tab10 = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]  # one per run: bars and loss curves
    assert all(c in colours for c in tab10)


@pytest.mark.slow
def test_compare_puts_both_engines_side_by_side(sweep, tmp_path):
    """A Megatron-LM run (no metrics.jsonl: its node log's iteration lines) next to the sweep's stage 0."""
    _, records, root = sweep
    params = with_batch_geometry(load_run_params("gpt_smoke", "smoke", RunOverrides(1, "megatron-lm")), 2)[0]
    runtime = RunRuntime(run="side_lm", run_id="side_lm-1", engine="megatron-lm", nnodes=1, nproc_per_node=2,
                         hosts=("localhost",), gradient_accumulation_steps=2, program_argv=("pretrain_gpt.py",))
    write_resolved(RunPaths(root, "side_lm").params_path, ResolvedRun(params, runtime))
    lines = [f" [2026-11-29 10:00:00.000000] iteration {r.iteration:8d}/{ITERS:8d} | consumed samples: {16 * r.iteration:12d} | "
             f"elapsed time per iteration (ms): 100.0 | throughput per GPU (TFLOP/s/GPU): 0.1 | learning rate: 3.000000E-04 | "
             f"global batch size:    16 | lm loss: {r.lm_loss + 0.5:.6E} | loss scale: 1.0 | grad norm: 1.000 | "
             f"number of skipped iterations:   0 | number of nan iterations:   0 |" for r in records[0]]
    RunPaths(root, "side_lm").node_log(0).write_text("\n".join(lines) + "\n")
    proc = run_script("compare_runs.sh", f"{PREFIX}_z0", "side_lm", "--name", "engines", env=clean_env(ARTIFACT_ROOT=str(root)))
    assert proc.returncode == 0, proc.stderr
    row = next(l for l in proc.stdout.splitlines() if l.startswith("side_lm "))
    assert "megatron-lm" in row and " 1 x 2 " in row and "20,480" in row and "5.0e-01" in row  # 16 x 128 tokens / 0.1 s
    doc = json.loads((root / "compare" / "engines.json").read_text())
    assert [r["engine"] for r in doc["runs"]] == ["megatron-core", "megatron-lm"] and doc["runs"][1]["device"] == "cuda"
    assert doc["runs"][1]["max_loss_diff_abs"] == pytest.approx(0.5, abs=1e-5)
    assert (root / "compare" / "engines.png").stat().st_size > 10_000


def _worker_of(run: str) -> int | None:
    """A training process (not torchrun) of ``run``: it has a RANK."""
    return next((pid for pid in tagged_pids(run) if process_environ(pid).get("RANK") == "1"), None)


@pytest.mark.slow
def test_a_failed_stage_is_reported_the_sweep_goes_on_and_stop_prefix_stops_it(artifact_root, tmp_path):
    """Stage 0's rank 1 is SIGKILLed (what the out-of-memory killer does): stage 0 fails with that
    reason and stage 1 starts; stop_training.sh PREFIX then stops stage 1 and the sweep; stage 3
    never starts."""
    prefix = "sweep_fail"
    with running_sweep(artifact_root, tmp_path, prefix, "0,1,3") as sweep:
        victim = wait_for(lambda: _worker_of(f"{prefix}_z0"), 120, what="a worker of stage 0")
        os.kill(victim, signal.SIGKILL)  # a process this test's sweep started
        wait_for(lambda: _worker_of(f"{prefix}_z1"), 120, what="stage 1 to start after stage 0 failed")
        stop = run_script("stop_training.sh", prefix, env=clean_env(ARTIFACT_ROOT=str(artifact_root)))
        assert stop.returncode == 0 and "stopped (SIGTERM to process group" in stop.stdout, stop.stdout + stop.stderr
        out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, out + err
    assert f"stage 0 ({prefix}_z0): FAILED after" in out and "Signal 9 (SIGKILL) received by PID" in out, out
    assert f"stage 1 ({prefix}_z1): stopped (stop {prefix} stopped stage 1" in out, out
    assert "stage 3" not in out and not RunPaths(artifact_root, f"{prefix}_z3").params_path.exists()
    assert not tagged_pids(f"{prefix}_z0") and not tagged_pids(f"{prefix}_z1")
    assert not RunPaths(artifact_root, prefix).node_pid_file(0).exists()
    table = out[out.index("run(s); step time"):]
    assert f"{prefix}_z0 " in table and "failed [1]" in table and "stopped [2]" in table
    assert f"[1] {prefix}_z0: rank 1: Signal 9 (SIGKILL)" in table
    doc = json.loads((artifact_root / "compare" / f"{prefix}.json").read_text())
    assert [r["status"] for r in doc["runs"]] == ["failed", "stopped"]


@pytest.mark.slow
def test_stop_prefix_reaches_a_sweep_at_any_moment(artifact_root, tmp_path):
    """stop PREFIX as soon as the sweep exists (before, or while, its first stage starts): the
    sweep's record carries the request, so the sweep stops there, every time, with nothing left."""
    prefix = "sweep_early"
    with running_sweep(artifact_root, tmp_path, prefix, "0,1") as sweep:
        wait_for(lambda: (artifact_root / "run_state" / f"{prefix}.sweep.json").exists(), 120, interval_s=0.05,
                 what="the sweep's record")
        stop = run_script("stop_training.sh", prefix, env=clean_env(ARTIFACT_ROOT=str(artifact_root)))
        assert stop.returncode == 0 and f"sweep {prefix}: asked to stop" in stop.stdout, stop.stdout + stop.stderr
        out, err = sweep.communicate(timeout=180)
    assert sweep.returncode == 130, out + err
    assert f"stage 0 ({prefix}_z0): stopped (stop {prefix} stopped stage 0 ({prefix}_z0) " in out, out
    assert f"stage 1 ({prefix}_z1)" not in out and not RunPaths(artifact_root, f"{prefix}_z1").params_path.exists()
    assert not tagged_pids(f"{prefix}_z0") and not tagged_pids(f"{prefix}_z1")
    assert json.loads((artifact_root / "run_state" / f"{prefix}.sweep.json").read_text())["ended"]


@pytest.mark.slow
def test_ctrl_c_stops_the_current_stage_everywhere(artifact_root, tmp_path):
    prefix = "sweep_int"
    with running_sweep(artifact_root, tmp_path, prefix, "2") as sweep:
        wait_for(lambda: _worker_of(f"{prefix}_z2"), 120, what="a worker of stage 2")
        sweep.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground sweep
        out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, out + err
    assert f"stage 2 ({prefix}_z2): stopped (Ctrl-C; stage 2 ({prefix}_z2) stopped on every node)" in out, out
    assert not tagged_pids(f"{prefix}_z2") and not RunPaths(artifact_root, f"{prefix}_z2").node_pid_file(0).exists()


def test_bad_stages_and_a_run_without_metrics_are_one_line(artifact_root, tmp_path):
    bad = run_script("compare_zero_stages.sh", "gpt_smoke", "smoke", "sweep_bad", env=sweep_env(artifact_root, STAGES="0,7"))
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: STAGES='0,7': '7' is not a ZeRO stage; list stages 0-3 separated by commas, e.g. STAGES=0,1,2,3"), bad.stderr
    assert bad.stdout == "" and not RunPaths(artifact_root, "sweep_bad_z0").params_path.exists()
    none = run_script("compare_runs.sh", "never_started", env=clean_env(ARTIFACT_ROOT=str(artifact_root)))
    assert none.returncode == 2 and none.stdout == ""
    assert none.stderr.strip() == ("error: run 'never_started' has no metrics yet (no metrics.jsonl and no iteration lines "
                                   "in its node logs); start it and wait for its first iteration, or check ARTIFACT_ROOT")


def test_parse_stages():
    assert parse_stages(None) == parse_stages("") == (0, 1, 2, 3)
    assert parse_stages("3, 0") == (3, 0)
    with pytest.raises(Exception, match="twice"):
        parse_stages("1,1")


OOM_LOG = """\
 [2026-11-29 10:00:00.000000] iteration        1/      50 | consumed samples:           32 | ...
[rank3]: Traceback (most recent call last):
[rank3]:   File "/work/main/megatron_ext/training/loop.py", line 200, in step
[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 3 has a total capacity of 139.72 GiB
E1129 10:00:05.000000 1945 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
megatron_ext.pretrain FAILED
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_10:00:05
  host      : node0
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 1954)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
======================================================
"""


DEAD_WORLD_LOG = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/opt/Megatron-LM/megatron/core/datasets/helpers.py", line 3, in <module>
[rank0]:     from megatron.core.datasets import helpers_cpp
[rank0]: ModuleNotFoundError: No module named 'megatron.core.datasets.helpers_cpp'
[rank1]: Traceback (most recent call last):
[rank1]:   File "/opt/Megatron-LM/pretrain_gpt.py", line 300, in <module>
[rank1]:     torch.distributed.barrier()
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40421
E1204 10:00:07 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 1 (pid: 2001) of binary: python
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_10:00:07
  host      : node0
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 2001)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""
"""Megatron-LM core_v0.19.0's ranks on Python 3.12 with helpers built for 3.11 (issue 40): rank 0's
import error is the cause; rank 1 died of it, and torchrun names rank 1, the first to exit."""


def test_the_failure_line_names_the_first_cause_whichever_rank_it_was_on():
    score, reason = failure_reason(DEAD_WORLD_LOG)
    assert score == 2 and reason.startswith(
        "rank 0: ModuleNotFoundError: No module named 'megatron.core.datasets.helpers_cpp' (torchrun: rank 1: "), reason
    from orchestration.node.failure import failure_summary

    failure = failure_summary(0, "node0", 1, DEAD_WORLD_LOG)
    assert (failure.kind, failure.node, failure.rank) == ("failed", 0, 1)  # torchrun's root cause: rank 1 exited first
    first = failure.summary
    assert first == ("node 0 (node0) failed: torchrun exit code 1; rank 1 exited first; the cause, on rank 0: "
                     "ModuleNotFoundError: No module named 'megatron.core.datasets.helpers_cpp'"), first
    # The other way round (the peer's error printed first): still the import error.
    lines = DEAD_WORLD_LOG.splitlines()
    swapped = "\n".join(lines[4:8] + lines[:4] + lines[8:])
    assert failure_reason(swapped)[1].startswith("rank 0: ModuleNotFoundError"), failure_reason(swapped)
    # Only peers' errors: the last one, as before.
    only_peers = DEAD_WORLD_LOG.replace("ModuleNotFoundError: No module named", "RuntimeError: Connection reset by peer:")
    assert "Connection closed by peer" in failure_reason(only_peers)[1]


def test_failure_reason_picks_the_telling_line():
    score, reason = failure_reason(OOM_LOG)
    assert score == 2 and reason.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB")
    assert reason.endswith("(torchrun: rank 3: exit code 1)")
    assert failure_reason("loading\nerror: data path /x does not exist; fix data.paths\nmore\n") == (
        3, "error: data path /x does not exist; fix data.paths")
    killed = OOM_LOG.replace("[rank3]: torch.OutOfMemoryError", "[rank3]: note").replace(
        "  exitcode  : 1 (pid: 1954)", "  exitcode  : -9 (pid: 1954)  (SIGKILL)").replace(
        "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "traceback : Signal 9 (SIGKILL) received by PID 1954")
    assert failure_reason(killed) == (
        2, "rank 3: Signal 9 (SIGKILL) received by PID 1954 (SIGKILL: e.g. the kernel's out-of-memory killer)")
    assert failure_reason("")[0] == 0
