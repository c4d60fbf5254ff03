"""Shared fixtures: an artifact root per session and a real torchrun launcher for training."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEST_DATA = REPO / "tests" / "data"

os.environ.setdefault("OMP_NUM_THREADS", "1")
"""One intra-op thread in every rank the suite starts (the launcher forwards it to every node): the
two workers' runs share 2 cores, and a rank that took both spun in OpenMP's barriers (two 1-rank
runs beside a busy loop: 30 iterations in 60-95 s each, 12-16 s with this; training/loop.py's
``cpu_threads``). torchrun sets the same where it starts more than one process per node."""


def pytest_sessionstart(session) -> None:
    """Byte-compile the project once for this interpreter. Where PYTHONDONTWRITEBYTECODE is set
    (this sandbox sets it) no process writes its own bytecode, so every process the suite
    starts (~800: ranks, supervisors, the launcher's commands) compiled the project's modules again,
    ~0.15 s of CPU each; compiled files are read whatever that variable says. Under pytest-xdist
    the controller compiles before it starts the workers (xdist's own session start runs last), so
    the workers do not walk the tree again."""
    import compileall

    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker
        return

    for package in ("orchestration", "megatron_ext", "tests"):
        compileall.compile_dir(REPO / package, quiet=1, workers=1)


LONGEST_FIRST = ("test_multinode.py", "test_megatron_lm_loop.py", "test_resume.py", "test_resilience.py", "test_slurm.py",
                 "test_cluster_faults.py", "test_exclusion.py", "test_kubernetes.py",
                 "test_cuda_trainer_on_cpu.py", "test_engines_agree.py", "test_other_python.py", "test_fsdp_dtensor_layout.py",
                 "test_training.py", "test_shared_fs.py",
                 "test_compare.py", "test_megatron_lm.py", "test_launcher_single_node.py", "test_hf_checkpoints.py",
                 "test_wandb.py", "test_docker.py")
"""The modules that start processes, the longest first (by their ``--durations`` here, 2026-12-02):
the README's ``-n 2 --dist loadgroup --no-loadscope-reorder`` hands the modules to its two workers
in this order (without the last flag pytest-xdist would order them by their number of tests), so
the two finish close together; the pure modules come last and fill the gaps."""
SAME_WORKER = {"test_resilience.py": "unattended", "test_slurm.py": "unattended", "test_kubernetes.py": "unattended"}
"""Modules that share a session fixture (``unattended``: one reference run) go to one worker."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """One pytest-xdist group per module (its cluster, its Slurm, its engine started once, by one
    worker), modules in ``LONGEST_FIRST`` order. Without ``-n`` the marks change nothing. pytest
    9.2 breaks the groups of pytest-xdist 3.8 (pytest-dev/pytest-xdist#1386: every test its own
    group, a module's tests on both workers at once, each with its own cluster and the same run
    names on one process table): pyproject.toml keeps pytest below 9.2, and
    tests/test_structure.py checks that the groups hold."""
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a module's own order is kept
    for item in items:
        item.add_marker(pytest.mark.xdist_group(SAME_WORKER.get(item.path.name, item.path.name)))


def free_port() -> int:
    """A free port whose next one is free too (a multi-node run's coordination store takes
    MASTER_PORT + 1: orchestration/node/board.py), below the kernel's ephemeral range (32768 and up
    by default), so that no connection another process opens takes it before the run binds it (a
    sweep holds one for minutes), and in a band of its own for each xdist worker."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 4
    while True:
        port = random.randrange(16000 + 4000 * worker, 19998 + 4000 * worker)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without launcher/torchrun variables, plus ``extra``."""
    drop = {"ZERO_STAGE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NNODES", "NODE_RANK", "NPROC_PER_NODE",
            "MASTER_ADDR", "MASTER_PORT", "HOSTS", "HOSTFILE", "CONTAINER_NAME", "DRY_RUN", "LAUNCHER_RUN", "ENGINE",
            "MEGATRON_LM_DIR", "LAUNCHER_TRANSPORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "STAGES"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(extra)
    return env


def require(missing: str | None, what: str) -> None:
    """Skip a test module whose prerequisites are missing, except with CI=true, where that is a failure."""
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} must run in CI: {missing}")
        pytest.skip(missing)


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory):
    """TMPDIR for the session and every process it starts: a folder under pytest's own, so what
    they leave in a temporary folder goes with pytest's rotation of its folders (a rank stopped by a
    test leaves W&B's ``tmp*wandb-media`` folders, made at its import and removed only at a normal
    exit)."""
    import tempfile

    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # read TMPDIR again
    yield
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def artifact_root(tmp_path_factory) -> Path:
    """One artifact root for the session, so the embedded corpus is prepared once."""
    return tmp_path_factory.mktemp("artifacts")


def run_session(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``cmd`` (a torchrun) in a session of its own, its output through files, whatever it leaves in
    that session killed when it ends. Not pipes: a rank that dies leaves megatron-core's
    async-save Manager process behind (a child of the rank), which holds inherited pipes open until
    the timeout."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def run_torchrun(artifact_root: Path, run: str, nproc: int = 2, model: str = "gpt_smoke", data: str = "smoke",
                 train_iters: int | None = None, timeout: int = 300, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Real torchrun of the training program; returns the process and its metrics records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "megatron_ext.pretrain", "--model", model, "--data", data, "--run-name", run]
    if train_iters:
        cmd += ["--train-iters", str(train_iters)]
    proc = run_session(cmd, clean_env(ARTIFACT_ROOT=str(artifact_root), **env), timeout)
    metrics_path = artifact_root / "runs" / run / "metrics.jsonl"
    records = [json.loads(l) for l in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    return proc, records


def planned_nodes(dry_run_stdout: str) -> list[dict]:
    """The node plans a dry run printed (after its plan header line), in node-rank order."""
    lines = [json.loads(line) for line in dry_run_stdout.splitlines() if line.startswith("{")]
    return [line for line in lines if "node_rank" in line]


def plan_header(dry_run_stdout: str) -> dict:
    """The plan header a dry run printed first: run id, settled, master port, steps."""
    return json.loads(dry_run_stdout.splitlines()[0])["plan"]


def run_script(name: str, *args: str, env: dict[str, str], timeout: int = 180) -> subprocess.CompletedProcess:
    """One of training_scripts/*.sh, for real."""
    return subprocess.run(["bash", str(REPO / "training_scripts" / name), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def tagged_pids(run: str) -> list[int]:
    """Every live process (any node: the test nodes share the process table) tagged with ``run``."""
    from megatron_ext.host.procfs import process_environ, process_start_time

    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and process_environ(int(entry.name)).get("LAUNCHER_RUN") == run:
            if process_start_time(int(entry.name)) is not None:
                out.append(int(entry.name))
    return out


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def last_iteration(log: Path) -> int:
    """The last iteration a node log shows, read with the project's one iteration-line parser."""
    from megatron_ext.run_spec.iteration_log import parse_log

    if not log.exists():
        return 0
    records, _ = parse_log(log.read_text(errors="replace"))
    return records[-1].iteration if records else 0


def write_data_set(path: Path, train_iters: int, global_batch: int = 16, save_interval: int = 0,
                   zero_stage: int = 0, resilience: str = "") -> str:
    """The smoke data set with another length (a YAML path works wherever a data set name does);
    ``resilience``: the inside of a ``training.resilience`` mapping, e.g. ``"restart_backoff_s: 1"``."""
    path.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        f"training:\n  seq_length: 128\n  micro_batch_size: 4\n  global_batch_size: {global_batch}\n"
        f"  train_iters: {train_iters}\n  lr: 3.0e-3\n  min_lr: 3.0e-4\n  lr_warmup_iters: 3\n  weight_decay: 0.01\n"
        "  eval_iters: 1\n" + (f"  save_interval: {save_interval}\n" if save_interval else "")
        + (f"  zero_stage: {zero_stage}\n" if zero_stage else "")
        + (f"  resilience: {{{resilience}}}\n" if resilience else "")
    )
    return str(path)


UNATTENDED_ITERS = 60
UNATTENDED_SAVE_EVERY = 10


@pytest.fixture(scope="session")
def unattended(artifact_root, tmp_path_factory) -> tuple[str, dict[int, float]]:
    """A data set of 60 iterations with a checkpoint every 10, at ZeRO stage 1 (its checkpoints:
    megatron-core's model state and ZeroRedundancyOptimizer's partitions; the multi-node resume
    test takes stage 3), and the lm loss at every iteration of one uninterrupted run of it (2
    processes, a global batch of 8: one micro-batch a rank and step, as cheap a step as shows the
    same): what a run that was killed, hung, preempted and restarted must reproduce. Computed once
    per session (the one-node restart and the Slurm tests)."""
    data = write_data_set(tmp_path_factory.mktemp("unattended") / "unattended.yaml", UNATTENDED_ITERS, global_batch=8,
                          save_interval=UNATTENDED_SAVE_EVERY, zero_stage=1,
                          resilience="restart_backoff_s: 1")  # the restarts' wait: not what is tested
    proc, records = run_torchrun(artifact_root, "unattended_reference", data=data, timeout=900)
    assert proc.returncode == 0 and len(records) == UNATTENDED_ITERS, proc.stderr[-3000:]
    return data, {r["iteration"]: r["lm_loss"] for r in records}


def assert_same_losses(metrics_path: Path, reference: dict[int, float], rel: float = 1e-6) -> None:
    """Every iteration recorded once, each with the reference's lm loss (relative ``rel``)."""
    records = [json.loads(l) for l in metrics_path.read_text().splitlines()]
    assert [r["iteration"] for r in records] == sorted(reference), [r["iteration"] for r in records][:20]
    for r in records:
        ref = reference[r["iteration"]]
        assert abs(r["lm_loss"] - ref) <= rel * abs(ref), (r["iteration"], r["lm_loss"], ref)


MEGATRON_LM_TARBALL = REPO.parent / "shared" / "megatron-lm" / "core_v0.16.1.tar.gz"
"""Megatron-LM core_v0.16.1 beside the checkout (the developers' machines and CI have it; a user's
clone does not: MEGATRON_LM_DIR points the tests at any checkout instead)."""
MEGATRON_LM_SHIM = REPO / "tests" / "megatron_lm_shim"


@pytest.fixture(scope="session")
def megatron_lm_checkout(tmp_path_factory) -> Path:
    """A Megatron-LM checkout for the tests that run its pretrain_gpt.py: MEGATRON_LM_DIR, else the
    core_v0.16.1 tarball extracted once per session (and byte-compiled: its imports are most of a
    launch's time); skipped, saying why, without either, or without the packages its ranks import
    on this machine (triton, pybind11: the test extra)."""
    import importlib.util
    import tarfile

    missing = [m for m in ("triton", "pybind11") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's ranks import {', '.join(missing)}: pip install -e .[test]")
    given = os.environ.get("MEGATRON_LM_DIR", "").strip()
    if given:
        return Path(given)
    if not MEGATRON_LM_TARBALL.is_file():
        pytest.skip(f"no Megatron-LM checkout: set MEGATRON_LM_DIR, or put core_v0.16.1.tar.gz at {MEGATRON_LM_TARBALL}")
    root = tmp_path_factory.mktemp("megatron_lm")
    with tarfile.open(MEGATRON_LM_TARBALL) as tar:
        tar.extractall(root, filter="data")
    checkout = next(root.iterdir())
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "2", str(checkout / "megatron"),
                    str(checkout / "pretrain_gpt.py"), str(checkout / "gpt_builders.py"), str(checkout / "model_provider.py")],
                   capture_output=True, timeout=600)
    return checkout


VENV_312_PYTHON = REPO / ".venv-py312" / "bin" / "python"
"""Python 3.12 with megatron-core 0.19.2 (.ci/py312_env.sh): what Megatron-LM core_v0.19.0 needs."""


def newest_megatron_lm(request) -> tuple[str, Path, dict[str, str]]:
    """(tag, checkout, the launcher variables its ranks need): core_v0.19.0 on Python 3.12 where it
    can run here, else core_v0.16.1 on this Python (a test of the launcher's paths, not of a release)."""
    try:
        return "core_v0.19.0", request.getfixturevalue("megatron_lm_019_checkout"), {"LAUNCHER_PYTHON": str(VENV_312_PYTHON)}
    except pytest.skip.Exception:
        return "core_v0.16.1", request.getfixturevalue("megatron_lm_checkout"), {}


@pytest.fixture(scope="session")
def megatron_lm_019_checkout(tmp_path_factory) -> Path:
    """Megatron-LM core_v0.19.0 (its tarball beside core_v0.16.1's) extracted once per session, for
    ranks on ``VENV_312_PYTHON``, and byte-compiled by that Python as core_v0.16.1's is (its ranks
    import the checkout's megatron, not the wheel's: 6.7 s of CPU an import compiled, 8.5 s not,
    ~18 imports a session; the compile, 1.7 s); skipped, saying why, without either or without the
    packages its ranks import there."""
    import tarfile

    tarball = MEGATRON_LM_TARBALL.with_name("core_v0.19.0.tar.gz")
    if not VENV_312_PYTHON.exists():
        pytest.skip(f"no {VENV_312_PYTHON} (core_v0.19.0 needs Python 3.12): bash .ci/py312_env.sh")
    if not tarball.is_file():
        pytest.skip(f"no Megatron-LM core_v0.19.0 checkout: put core_v0.19.0.tar.gz at {tarball}")
    probe = subprocess.run([str(VENV_312_PYTHON), "-c", "import importlib.util as u; print(' '.join(m for m in "
                            "('triton', 'pybind11') if u.find_spec(m) is None))"], capture_output=True, text=True)
    if probe.stdout.strip():
        pytest.skip(f"Megatron-LM's ranks import {probe.stdout.strip()}, missing in {VENV_312_PYTHON}")
    root = tmp_path_factory.mktemp("megatron_lm_019")
    with tarfile.open(tarball) as tar:
        tar.extractall(root, filter="data")
    checkout = next(root.iterdir())
    subprocess.run([str(VENV_312_PYTHON), "-m", "compileall", "-q", "-j", "2", str(checkout / "megatron"),
                    str(checkout / "pretrain_gpt.py"), str(checkout / "gpt_builders.py"), str(checkout / "model_provider.py")],
                   capture_output=True, timeout=600)
    return checkout


def megatron_lm_env(checkout: Path, **extra: str) -> dict[str, str]:
    """What a test's launcher command needs to run Megatron-LM's ranks on this CPU: the engine, the
    checkout, and the CUDA-on-CPU shim in every rank (tests/megatron_lm_shim; forwarded as PYTHON*
    and MEGATRON_* variables are)."""
    return clean_env(ENGINE="megatron-lm", MEGATRON_LM_DIR=str(checkout), MEGATRON_LM_CPU_SHIM="1",
                     PYTHONPATH=f"{MEGATRON_LM_SHIM}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
                     **extra)


@contextlib.contextmanager
def slowed(pid: int, stopped_s: float = 0.15, running_s: float = 0.05):
    """``pid`` SIGSTOPped and SIGCONTed in a duty cycle (by default stopped 3/4 of the time) while
    in the context: a rank that computes slower while its peers wait for it (a throttled GPU, a
    noisy neighbour; with a long period, one slow in bursts)."""
    done = threading.Event()

    def cycle():
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)
