"""The training tests and the CUDA path's construction tests again on Python 3.12 with megatron-core 0.19.2 (the newest release; it needs
Python >= 3.12), in the virtual environment ``.venv-py312`` that ``.ci/run`` builds:

    bash .ci/py312_env.sh && python3 -m pytest -q tests/test_other_python.py

Skipped where that environment does not exist, except with ``CI=true``, where that is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow

VENV_PYTHON = REPO / ".venv-py312" / "bin" / "python"


def test_training_tests_on_python_312_with_megatron_core_019():
    if not VENV_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{VENV_PYTHON} is missing: .ci/run builds it with .ci/py312_env.sh")
        pytest.skip(f"no {VENV_PYTHON}; build it with `bash .ci/py312_env.sh`")
    versions = subprocess.run([str(VENV_PYTHON), "-c", "import sys, megatron.core.package_info as p; "
                               "print('%d.%d' % sys.version_info[:2], p.__version__)"],
                              capture_output=True, text=True, env=clean_env())
    python, release = versions.stdout.split()
    assert python == "3.12" and release.startswith("0.19.2"), versions.stdout + versions.stderr  # 0.18+ appends a git sha
    env = clean_env(PYTHONPATH=str(REPO))
    env.pop("VIRTUAL_ENV", None)
    # A short folder of its own, not this test's tmp_path: the inner session's TMPDIR lies under it
    # (conftest.py session_tmpdir), and megatron-core's checkpoint writer starts a multiprocessing
    # Manager, whose AF_UNIX socket (TMPDIR/pymp-*/listener-*) must fit in 107 bytes; under a fresh
    # clone's pytest folders it did not, and the Manager's process died (EOFError in rank 0).
    basetemp = Path(tempfile.mkdtemp(prefix="py312-", dir="/tmp"))
    try:
        proc = _run_inner(env, basetemp)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "failed" not in proc.stdout.splitlines()[-1]


def _run_inner(env: dict[str, str], basetemp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_training.py", "tests/test_cuda_path.py", "tests/test_cuda_trainer_on_cpu.py",
                           # megatron-core's side only (stages 0 and 3 of the Qwen3 shape, the jit fuser, the CUDA
                           # path's construction): the bad-input tests check the launcher and the params (no
                           # megatron-core), the 4-process run repeats stage 2's code path at another size, and the
                           # gpt_smoke run (with the TensorBoard test that reads it) repeats stage 0 with a smaller
                           # model of the same layers (CI time).
                           # From the CUDA trainer's shim tests, the gradient precision (Megatron-FSDP's own from 0.19)
                           # and one rank's own Megatron-FSDP strategy (the GPU check's switch: refused on 0.16).
                           # Not the profiler's run (torch's profiler around stage 0 again), the wheel copy for
                           # the device check nor device_check.sh's own preflight (no megatron-core in either;
                           # the script runs the PATH's python3, the outer session's, not this environment's): ~35 s of CI.
                           "-k", "not 4_processes and not bad_input and not unknown_yaml_key and not two_processes "
                                 "and not tensorboard and (not cuda_trainer_on_cpu or fp32_unless or one_rank_keeps) "
                                 "and not profile_of_one_step and not prepare_device_check and not device_check_fails",
                           "--basetemp", str(basetemp / "py312")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1500)
