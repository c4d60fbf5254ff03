"""ENGINE=megatron-lm for real: NVIDIA Megatron-LM's own pretrain_gpt.py (core_v0.16.1, unmodified)
trained through the launcher's own scripts, 2 CPU ranks, with a CUDA-on-CPU shim in every rank
(tests/megatron_lm_shim: Megatron-LM asserts CUDA; the shim makes the CPU answer for it and gloo
stand in for NCCL: what this cannot show is said there and in docs/megatron-lm.md).

- Every ZeRO stage trains Qwen3-shaped qwen3_smoke with the same loss (compare_zero_stages.sh),
  status shows its iterations, loss and tokens/s, compare_runs.sh puts the stages side by side,
  and the loss status and compare read for Megatron-LM's second line after a start is that
  iteration's own (TensorBoard's), not Megatron-LM's printed mean of the first two.
- A SIGKILLed rank is restarted (MAX_RESTARTS) from latest_checkpointed_iteration.txt; a SIGSTOPped
  rank is a hang the watchdog finds and dumps; status's goodput puts each one's cost in its part
  from Megatron-LM's own iteration lines; a start after that resumes; ``stop --save`` saves at the
  next step through --exit-signal-handler; nothing is left.
- Megatron-LM core_v0.19.0 on Python 3.12 (megatron-core 0.19.2's environment): stages 0, 2 and 3 train
  through the launcher with the same loss over 6 iterations, status and compare read it; its dataset
  helpers are built for the ranks' Python before the start (its own Makefile took a cpython-311
  suffix from python3-config, and every rank died at import); the restart, hang, resume and
  ``stop --save`` scenario runs on it (on core_v0.16.1 where it cannot), with a damaged latest
  checkpoint (--verify-integrity's manifest) passed over by node 0 for the one before.
- MEGATRON_LM_EXTRA_ARGS reach pretrain_gpt.py after the rendered flags (its own parser checks
  them); a rank's error (transformer-engine layers asked for where none is installed) is the
  run's failure reason, not only "torchrun exit code 1".

Skipped, saying why, without a Megatron-LM checkout (MEGATRON_LM_DIR, or the core_v0.16.1 tarball
beside the project) or without triton and pybind11 (the test extra). Each launch costs ~40 s here
(Megatron-LM's imports): the runs are few and short.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_ext.run_spec.engines import MEGATRON_LM
from megatron_ext.run_spec.checkpoints import latest_iteration
from megatron_ext.run_spec.iteration_log import parse_log

from run_checks import assert_goodput_of_two_faults
from standins import megatron_lm_data_set
from conftest import VENV_312_PYTHON, clean_env, free_port, megatron_lm_env, newest_megatron_lm, run_script, tagged_pids, wait_for

pytestmark = pytest.mark.slow

SWEEP_ITERS = 4


@pytest.fixture(scope="module")
def lm_env(megatron_lm_checkout, artifact_root):
    return megatron_lm_env(megatron_lm_checkout, ARTIFACT_ROOT=str(artifact_root), NPROC_PER_NODE="2",
                           MASTER_PORT=str(free_port()))


@pytest.fixture()
def stop_after(lm_env):
    """Runs to stop when the test ends, passed or not (a stopped rank continued first)."""
    runs: list[str] = []
    yield runs
    for run in runs:
        for pid in tagged_pids(run):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        run_script("stop_training.sh", run, env=lm_env)


@pytest.fixture(scope="module")
def sweep(lm_env, artifact_root, tmp_path_factory):
    """compare_zero_stages.sh qwen3_smoke, ENGINE=megatron-lm, stages 0-3, no checkpoints (Megatron-LM
    core_v0.16.1's Megatron-FSDP would hang at a save: the launcher refuses that, see below)."""
    data = megatron_lm_data_set(tmp_path_factory.mktemp("lm_sweep") / "four.yaml", SWEEP_ITERS)
    proc = run_script("compare_zero_stages.sh", "qwen3_smoke", data, "lmsweep", env=lm_env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, artifact_root


def _losses(root: Path, run: str) -> dict[int, float]:
    records, skipped = MEGATRON_LM.parse_log((root / "logs" / f"{run}_node0.log").read_text(errors="replace"))
    assert skipped == 0
    return {r.iteration: r.lm_loss for r in records}


def test_every_stage_trains_the_same_loss_and_the_comparison_reads_it(sweep):
    proc, root = sweep
    for stage in range(4):
        assert any(l.startswith(f"stage {stage} (lmsweep_z{stage}): done in ") for l in proc.stdout.splitlines()), proc.stdout
    losses = {stage: _losses(root, f"lmsweep_z{stage}") for stage in range(4)}
    assert sorted(losses[0]) == list(range(1, SWEEP_ITERS + 1))
    for stage in (1, 2, 3):  # Megatron-LM's own DDP, distributed optimizer and Megatron-FSDP: fp32 noise at most
        for it, ref in losses[0].items():
            assert abs(losses[stage][it] - ref) <= 1e-5 * abs(ref), (stage, it, losses[stage][it], ref)
    table = [l for l in proc.stdout.splitlines() if l.startswith("lmsweep_z")]
    assert len(table) == 4 and all("megatron-lm" in row for row in table), proc.stdout
    compare = run_script("compare_runs.sh", "lmsweep_z0", "lmsweep_z3", "--name", "lm_stages", env=sweep_env_of(root))
    assert compare.returncode == 0 and (root / "compare" / "lm_stages.json").is_file(), compare.stderr


def test_core_v0_19_0_trains_every_stage_on_python_3_12_through_the_launcher(megatron_lm_019_checkout, tmp_path):
    """The issue-40 start: accepted, and every rank died with ModuleNotFoundError helpers_cpp (named as
    the peer's 'Connection closed'); the shim also answers torch.accelerator (the CUDA build of torch).
    Stages 0, 2 and 3 over 6 iterations with stage 0's loss (DDP, and Megatron-FSDP with its sharding
    strategy rendered: 0.19 flipped its default). Stage 1 is --use-distributed-optimizer on both
    releases, trained in the core_v0.16.1 sweep above: a launch (~40 s of CI) fewer."""
    root, iters, stages = tmp_path / "art", 6, (0, 2, 3)
    env = megatron_lm_env(megatron_lm_019_checkout, ARTIFACT_ROOT=str(root), NPROC_PER_NODE="2",
                          MASTER_PORT=str(free_port()), LAUNCHER_PYTHON=str(VENV_312_PYTHON), STAGES="0,2,3")
    data = megatron_lm_data_set(tmp_path / "six.yaml", iters)
    proc = run_script("compare_zero_stages.sh", "qwen3_smoke", data, "lm19", env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    datasets = megatron_lm_019_checkout / "megatron" / "core" / "datasets"
    assert list(datasets.glob("helpers_cpp.cpython-312-*.so")), sorted(p.name for p in datasets.iterdir())
    losses = {stage: _losses(root, f"lm19_z{stage}") for stage in stages}
    assert sorted(losses[0]) == list(range(1, iters + 1))
    for stage in stages[1:]:
        for it, ref in losses[0].items():
            assert abs(losses[stage][it] - ref) <= 1e-4 * abs(ref), (stage, it, losses[stage][it], ref)
    status = run_script("status_training.sh", "lm19_z2", "--json", env=sweep_env_of(root))
    node = json.loads(status.stdout.splitlines()[0])
    assert node["state"] == "finished" and node["last_iteration"] == iters, node
    compare = run_script("compare_runs.sh", "lm19_z0", "lm19_z3", "--name", "lm19_stages", env=sweep_env_of(root))
    assert compare.returncode == 0 and (root / "compare" / "lm19_stages.json").is_file(), compare.stderr


def sweep_env_of(root: Path) -> dict[str, str]:
    return clean_env(ARTIFACT_ROOT=str(root))


def test_status_shows_iterations_loss_and_throughput(sweep):
    _, root = sweep
    status = run_script("status_training.sh", "lmsweep_z0", "--json", env=sweep_env_of(root))
    node = json.loads(status.stdout.splitlines()[0])
    assert node["state"] == "finished" and node["last_iteration"] == SWEEP_ITERS == node["train_iters"], node
    assert node["tokens_per_s"] > 0


def test_the_second_line_after_a_start_is_that_iteration_s_own_loss(sweep):
    """Megatron-LM prints, as iteration 2, the mean of iterations 1 and 2 (training.py logs the first
    iteration and keeps its totals); TensorBoard gets each iteration's own loss: what the launcher reads."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, root = sweep
    events = EventAccumulator(str(root / "runs" / "lmsweep_z0" / "tensorboard"))
    events.Reload()
    board = {e.step: e.value for e in events.Scalars("lm loss")}
    parsed = _losses(root, "lmsweep_z0")
    printed, _ = parse_log((root / "logs" / "lmsweep_z0_node0.log").read_text(errors="replace"))  # as printed
    assert abs(printed[1].lm_loss - (board[1] + board[2]) / 2) <= 2e-6 * board[2]  # the quirk, as printed
    for it in range(1, SWEEP_ITERS + 1):  # the printed lines round to 7 digits
        assert abs(parsed[it] - board[it]) <= 3e-6 * abs(board[it]), (it, parsed[it], board[it])


def _rank_pid(run: str, rank: int) -> int | None:
    """The Megatron-LM rank process (its parent, torchrun, carries no RANK)."""
    from orchestration.node.watchdog import worker_pids

    return worker_pids(run, 0).get(rank)


def _last_iteration(log: Path, after: str = "") -> int:
    """The last iteration the log shows after the last line holding ``after`` (the whole log: "")."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if after:
        text = text.rpartition(after)[2] if after in text else ""
    records, _ = MEGATRON_LM.parse_log(text)
    return records[-1].iteration if records else 0


@pytest.fixture()
def release_env(request, artifact_root) -> tuple[str, dict[str, str]]:
    """(release, the launcher's environment for it): core_v0.19.0 on Python 3.12, or, where that
    cannot run here (no tarball, no .venv-py312), core_v0.16.1 on this Python. Not both: the
    scenario drives the launcher's paths, the same on either (CI ran both until 2026-12-04, 90 s
    each); core_v0.16.1 trains for real in the sweep, the engines' comparison and the extra
    arguments' test, and its own limits are tested in tests/test_megatron_lm.py."""
    tag, checkout, python = newest_megatron_lm(request)
    return tag, megatron_lm_env(checkout, ARTIFACT_ROOT=str(artifact_root), NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
                                **python)


def _flip_byte(path: Path, at: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_restart_hang_stop_save_and_resume(release_env, artifact_root, tmp_path, stop_after):
    """One run through everything a week meets: a SIGKILLed rank restarted from the latest checkpoint
    (--load added for the attempt: the first started without one), a SIGSTOPped rank found by the
    watchdog with its stack dumped, a start that resumes, and ``stop --save`` (SIGUSR1 to every
    rank: Megatron-LM's --exit-signal-handler saves and exits 0) past that checkpoint. Each start
    takes a free port (a stopped run's port may linger a while). The start that resumes extends the
    run (train_iters 60 -> 66: Megatron-LM takes the params' schedule, --override-opt_param-scheduler).
    On core_v0.19.0 (its damaged latest checkpoint passed over too), else core_v0.16.1."""
    release, lm_env = release_env
    run = f"lm_week_{release[-6:].replace('.', '')}"
    data = megatron_lm_data_set(tmp_path / "week.yaml", train_iters=60, save_interval=3, resilience="restart_backoff_s: 1")
    stop_after.append(run)
    # A step may take 10 s, a save 60 s more (the schedule says when: an attempt's first, which starts
    # torch_dist's writer processes, ~20 s here, falls in its warm-up steps, timed against setup's limit).
    env = {**lm_env, "MAX_RESTARTS": "1", "HANG_STEP_FLOOR_S": "10", "HANG_CHECKPOINT_S": "60"}
    port = lambda: {"MASTER_PORT": str(free_port())}  # noqa: E731
    log, checkpoints = artifact_root / "logs" / f"{run}_node0.log", artifact_root / "runs" / run / "checkpoints"
    start = run_script("start_training.sh", "gpt_smoke", data, run, env={**env, **port()})
    assert start.returncode == 0 and "fresh start" in start.stdout, start.stdout + start.stderr
    argv = json.loads((artifact_root / "run_state" / f"{run}_node0.pid").read_text())["argv"]
    assert "--load" not in argv  # nothing to load yet (an empty --load changes Megatron-FSDP's training)
    # past it: the crash then has iterations to recompute (on CPU the save is written before training goes on)
    wait_for(lambda: 3 <= (latest_iteration(checkpoints) or 0) < _last_iteration(log, "attempt 1 of 2") and _rank_pid(run, 1),
             300, what="a first checkpoint and an iteration past it")
    os.kill(_rank_pid(run, 1), signal.SIGKILL)
    killed_at = time.time()  # this machine is node 0: the ledger's and the log's clock
    wait_for(lambda: "attempt 2 of 2: starting torchrun (the ranks resume from the checkpoint" in log.read_text(), 120,
             what="the restart")
    record = wait_for(lambda: (r := json.loads((artifact_root / "run_state" / f"{run}_node0.pid").read_text()))["argv"] != argv
                      and r, 60, what="attempt 2's torchrun")
    resumed_at = latest_iteration(checkpoints)
    integrity = ["--verify-integrity"] if release == "core_v0.19.0" else []  # torch_dist's file hashes, 0.17.1 and later
    # the attempt's resume flag by the plan's rule, then node 0's choice of the checkpoint
    assert record["argv"][-4 - len(integrity):] == ["--load", str(checkpoints), "--ckpt-step", str(resumed_at), *integrity]
    attempt_2 = "attempt 2 of 2: starting torchrun"
    saved_in_2 = lambda: "successfully saved" in log.read_text().rpartition(attempt_2)[2]  # noqa: E731
    wait_for(lambda: saved_in_2() and _last_iteration(log, attempt_2) >= resumed_at + 4, 300,
             what="attempt 2's iterations past its first save")
    assert f"successfully loaded checkpoint from {checkpoints} " in log.read_text()
    assert f"] at iteration {resumed_at}" in log.read_text()
    stopped = _rank_pid(run, 1)
    # after the line of an iteration that neither saves nor precedes a save's line (saves every 3): the
    # gap after it is a step's (10 s), not a save's (70 s)
    wait_for(lambda: _last_iteration(log, attempt_2) % 3 == 1, 60, interval_s=0.02, what="a line past a save")
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.time()
    wait_for(lambda: not tagged_pids(run), 300, what="the hang to be found and the run ended")
    # [issue 56: goodput] from Megatron-LM's own lines: the crash and the hang each in its part, as timed here
    shown = run_script("status_training.sh", run, env=env).stdout
    assert_goodput_of_two_faults(shown, artifact_root, run, "2", killed_at, stopped_at, log.read_text())
    failure = (artifact_root / "run_state" / f"{run}_failure.txt").read_text()
    assert failure.startswith("node 0 hung: rank 1 (node 0) stopped (process state T"), failure
    dump = next((artifact_root / "runs" / run / "hangs").glob("*/node0_rank1.txt")).read_text()
    assert f"pid {stopped}" in dump and "pretrain_gpt.py" in dump, dump[-2000:]  # the stopped rank's own stack
    saved = latest_iteration(checkpoints)
    if integrity:  # a damaged latest checkpoint (its manifest says so) is passed over, as this program's ranks do
        _flip_byte(next((checkpoints / f"iter_{saved:07d}").glob("__0_*.distcp")))
        listed = run_script("check_checkpoints.sh", run, env=env).stdout
        assert re.search(rf"^ +{saved - 3} +verified +-$", listed, re.M) and \
            re.search(rf"^ +{saved} +damaged +__0_\d+\.distcp: other bytes \(SHA-256 ", listed, re.M), listed
    # the run extended (train_iters 60 -> 66): the schedule from the params, not the checkpoint's (it died at the load)
    longer = megatron_lm_data_set(tmp_path / "longer.yaml", train_iters=66, save_interval=3, resilience="restart_backoff_s: 1")
    again = run_script("start_training.sh", "gpt_smoke", longer, run, env={**env, **port(), "MAX_RESTARTS": "0"})
    assert again.returncode == 0 and f"resuming from iteration {saved}" in again.stdout, again.stdout + again.stderr
    if integrity:
        wait_for(lambda: f"moved aside as iter_{saved:07d}.damaged; Megatron-LM loads the checkpoint of iteration "
                         f"{saved - 3} (with --verify-integrity)" in log.read_text(), 120, what="node 0's choice")
        saved -= 3
    wait_for(lambda: _last_iteration(log, "attempt 1 of 1: starting torchrun") >= saved + 1, 300,
             what="the resumed start's first iteration")
    assert f"] at iteration {saved}" in log.read_text().rpartition("attempt 1 of 1")[2]
    stop = run_script("stop_training.sh", run, "--save", env=env, timeout=400)
    assert stop.returncode == 0 and "node0 preempted" in stop.stdout, stop.stdout + stop.stderr
    assert "exiting program after receiving" in log.read_text() and tagged_pids(run) == []
    assert latest_iteration(checkpoints) > saved  # the next start resumes there, as the one above did
    status = json.loads(run_script("status_training.sh", run, "--json", env=env).stdout.splitlines()[0])
    assert status["state"] == "preempted", status


def test_extra_arguments_reach_the_ranks_and_a_rank_s_error_is_the_reason(lm_env, artifact_root, tmp_path, stop_after):
    """MEGATRON_LM_EXTRA_ARGS come last (the started torchrun's argv shows them; Megatron-LM's own
    parser accepted them at the start): here transformer-engine layers on a node without
    transformer-engine, which every rank refuses with a NameError the failure names. One rank: what
    is shown does not need two; no dry run before it: the start runs the same argument check
    (Megatron-LM's parser: the dry run took 8 s of CPU) and records the argv it started."""
    run, data = "lm_extra", megatron_lm_data_set(tmp_path / "two.yaml", train_iters=2)
    stop_after.append(run)
    env = {**lm_env, "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port()),
           "MEGATRON_LM_EXTRA_ARGS": "--transformer-impl transformer_engine"}
    start = run_script("start_training.sh", "gpt_smoke", data, run, env=env, timeout=300)
    assert "accept the arguments" in start.stdout + start.stderr, start.stdout + start.stderr
    argv = json.loads((artifact_root / "run_state" / f"{run}_node0.pid").read_text())["argv"]
    assert argv[-2:] == ["--transformer-impl", "transformer_engine"], argv
    if start.returncode == 0:
        wait_for(lambda: not tagged_pids(run), 300, what="the run to fail")
    failure = (artifact_root / "run_state" / f"{run}_failure.txt").read_text().splitlines()[0]
    assert "failed: torchrun exit code 1; rank " in failure and "NameError: name 'TESpecProvider' is not defined" in failure, failure
    status = run_script("status_training.sh", run, env=env)
    assert "NameError: name 'TESpecProvider' is not defined" in status.stdout, status.stdout
