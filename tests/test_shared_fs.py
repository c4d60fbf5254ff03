"""The training program on a shared file system that does not agree with itself: the ranks agree
over the network (megatron_ext/training/agreement.py), never through files.

- A share that refuses locks (tests/noflock_fs.py, a FUSE passthrough: every ``flock`` and
  ``fcntl`` lock answers ENOSYS, as Lustre mounted ``noflock`` does; a folder renamed onto an
  existing one answers EPERM, as sshfs does): a 2-rank run with its artifact root there prepares
  its data once (one cache folder, rank 0 alone) and trains; two starts preparing the same cache at
  once each prepare into a folder of their own, and the one that finds the other's finished cache
  in place discards its own.
- A stale view of ``latest`` on one node: two torchruns on this machine as node 0 and node 1, node
  1's in a mount namespace of its own where an older ``latest`` is bind-mounted over the real one
  (a real stale view, as a cache holds it). Both resume the checkpoint rank 0 chose, and the
  losses after the resume are an uninterrupted run's. Before the ranks took rank 0's choice, node 1
  read its own ``latest`` and the run hung or diverged. The same runs show each rank's checksum
  record listing exactly the files it wrote, together every file of the checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_same_losses, clean_env, free_port, require, run_torchrun, wait_for

pytestmark = pytest.mark.slow


def _missing_fuse() -> str | None:
    """Why the lock-refusing share cannot be mounted here, or None."""
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401  (loads libfuse 3)
    except (ImportError, OSError) as exc:
        return f"mfusepy with libfuse 3 does not load ({exc}): pip install -e .[test]; apt-get install fuse3"
    return None


@pytest.fixture(scope="module")
def noflock_share(tmp_path_factory):
    """A folder mounted through tests/noflock_fs.py: a share whose locks all fail."""
    require(_missing_fuse(), "the share that refuses locks")
    source, mount = tmp_path_factory.mktemp("noflock_source"), tmp_path_factory.mktemp("noflock_share")
    log = tmp_path_factory.mktemp("noflock_log") / "fs.log"
    with open(log, "w") as out:
        fs = subprocess.Popen([sys.executable, str(REPO / "tests" / "noflock_fs.py"), str(source), str(mount)],
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: os.path.ismount(mount) or fs.poll() is not None, 30, interval_s=0.1, what="the FUSE mount")
        assert os.path.ismount(mount), log.read_text()
        yield mount
    finally:
        subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True)
        try:
            fs.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(fs.pid, signal.SIGKILL)
            fs.wait()


def test_a_run_on_a_share_that_refuses_locks_prepares_its_data_once_and_trains(noflock_share):
    with open(noflock_share / "probe", "w") as fh:  # the share refuses every lock, as Lustre's noflock
        with pytest.raises(OSError) as refused:
            fcntl.flock(fh, fcntl.LOCK_EX)
        assert refused.value.errno == errno.ENOSYS
        with pytest.raises(OSError):
            fcntl.lockf(fh, fcntl.LOCK_EX)
    root = noflock_share / "artifacts"
    proc, records = run_torchrun(root, "noflock", train_iters=3, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    cache = sorted(p.name for p in (root / "data_cache").iterdir() if p.name != "index")
    assert len(cache) == 1 and cache[0].startswith("embedded-"), cache  # one folder, nothing half-made beside it


PREPARE = """
import json, logging, sys
from pathlib import Path
from megatron_ext.data.prepare import ensure_prepared
from megatron_ext.run_spec.params import DataParams, TokenizerParams
logging.basicConfig(level=logging.INFO, format="%(message)s")
data = DataParams(source="files", paths=(sys.argv[1],), tokenizer=TokenizerParams(vocab_size=320))
print(json.dumps(ensure_prepared(data, Path(sys.argv[2]), workers=1).__dict__))
"""


def test_two_starts_preparing_at_once_keep_one_cache_without_a_lock(noflock_share, tmp_path):
    """Start A is held (SIGSTOP) in the middle of its preparation, start B prepares the same cache
    meanwhile and puts it in place; A goes on, its rename onto B's folder fails (EPERM, as sshfs),
    and A uses B's cache and removes its own copy."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7} jumps over the lazy dog {i % 13}\n" for i in range(30000)))
    cache = noflock_share / "race_cache"
    env = clean_env(PYTHONPATH=str(REPO))
    with open(tmp_path / "a.out", "w") as out:
        a = subprocess.Popen([sys.executable, "-c", PREPARE, str(corpus), str(cache)], cwd=REPO, env=env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: list(cache.glob(".files-*.preparing-*")) or a.poll() is not None, 60, interval_s=0.02,
                 what="start A's own folder")
        os.kill(a.pid, signal.SIGSTOP)
        assert a.poll() is None and not list(cache.glob("files-*")), "start A finished before it could be held"
        b = subprocess.run([sys.executable, "-c", PREPARE, str(corpus), str(cache)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert b.returncode == 0, b.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.pid, signal.SIGCONT)
    assert a.wait(timeout=120) == 0
    a_out = (tmp_path / "a.out").read_text()
    assert "was prepared by another start meanwhile: using it, discarding this one's copy" in a_out, a_out
    assert json.loads(a_out.splitlines()[-1]) == json.loads(b.stdout.splitlines()[-1])
    assert [p.name for p in cache.iterdir()] == [json.loads(b.stdout.splitlines()[-1])["prefixes"][0].split("/")[-2]]


ITERS = 6


def _data_set(path: Path) -> str:
    """gpt_smoke with a checkpoint every 2 iterations, 3 kept: iterations 2, 4 and 6."""
    path.write_text(
        "data:\n  source: embedded\n  split: \"95,5,0\"\n  tokenizer: {type: sentencepiece, vocab_size: 2048}\n"
        f"training:\n  seq_length: 128\n  micro_batch_size: 4\n  global_batch_size: 8\n  train_iters: {ITERS}\n"
        "  lr: 3.0e-3\n  min_lr: 3.0e-4\n  lr_warmup_iters: 3\n  weight_decay: 0.01\n  eval_iters: 0\n"
        "  save_interval: 2\n  keep_checkpoints: 3\n"
    )
    return str(path)


def _two_nodes(root: Path, run: str, data: str, logs: Path, stale_latest: Path | None = None,
               timeout: int = 240) -> tuple[list[int | None], list[str]]:
    """Node 0 and node 1 (one rank each) as two torchruns on this machine; with ``stale_latest``,
    node 1 runs in a mount namespace of its own where that file is bind-mounted over the run's
    ``latest``. Each node's exit code (None: still running at the timeout, then killed) and output."""
    port, procs = free_port(), []
    env = clean_env(ARTIFACT_ROOT=str(root))
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
               "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "megatron_ext.pretrain", "--model",
               "gpt_smoke", "--data", data, "--run-name", run]
        if node == 1 and stale_latest is not None:
            latest = root / "runs" / run / "checkpoints" / "latest"
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount --bind "$1" "$2" && echo "node 1 sees latest: $(cat "$2")" && shift 2 && exec "$@"', "sh",
                   str(stale_latest), str(latest), *cmd]
        with open(logs / f"{run}_node{node}.out", "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    codes: list[int | None] = []
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return codes, [(logs / f"{run}_node{node}.out").read_text() for node in (0, 1)]


def test_a_node_with_a_stale_latest_resumes_rank_0_s_choice_exactly(tmp_path, artifact_root):
    require(None if shutil.which("unshare") else "no unshare (util-linux)", "the stale view of latest")
    data, run = _data_set(tmp_path / "stale.yaml"), "stale_latest"
    codes, outs = _two_nodes(artifact_root, run, data, tmp_path)
    assert codes == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    metrics = artifact_root / "runs" / run / "metrics.jsonl"
    never_stopped = {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines())}
    assert sorted(never_stopped) == list(range(1, ITERS + 1))
    checkpoints = artifact_root / "runs" / run / "checkpoints"

    # Each rank recorded the files it wrote, found by name: together every file of the checkpoint.
    from megatron_ext.run_spec.checksums import writer_rank

    folder = checkpoints / "iter_0000004"
    records = {r: set(json.loads((folder / "checksums" / f"rank{r}.json").read_text())["files"]) for r in (0, 1)}
    assert all(writer_rank(name) == r for r, names in records.items() for name in names), records
    assert records[0] | records[1] == {p.name for p in folder.iterdir() if p.is_file()}, records
    assert {"rank1.pt", "__1_0.distcp"} <= records[1] and {".metadata", "meta.json", "rank0.pt"} <= records[0], records

    # The run as a stop after its checkpoint at 4 leaves it; node 1's cache still shows the 2 before.
    shutil.rmtree(checkpoints / "iter_0000006")
    (checkpoints / "latest").write_text("iter_0000004")
    stale = tmp_path / "stale_latest"
    stale.write_text("iter_0000002")
    codes, outs = _two_nodes(artifact_root, run, data, tmp_path, stale_latest=stale, timeout=120)
    assert "node 1 sees latest: iter_0000002" in outs[1], outs[1][-2000:]
    assert codes == [0, 0], f"exit codes {codes} (None: hung)\n" + outs[0][-2500:] + outs[1][-2500:]
    for out in outs:  # every node's log says what its own rank loaded
        assert "resuming from iteration 4 (" in out, out[-2000:]
    assert_same_losses(metrics, never_stopped)
