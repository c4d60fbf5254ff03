"""Restart time against checkpoint size, on both engines, and what the integrity record costs per GB
(one node, 2 CPU processes, gpt_smoke; touches processes, this machine's files and the clock).

    python benchmarks/checkpoint_restart.py                          # 1, 10, 100 GB, both engines
    python benchmarks/checkpoint_restart.py --sizes 0.2 --engines own --hash-gb 0.2   # a quick check

Each engine trains one run (``start_training.sh``, a checkpoint every 3 iterations), stopped
(``stop_training.sh``) once a checkpoint exists. Then, for the real checkpoint as it is (a few MB)
and for each size: its latest checkpoint is padded to that size and the run started again, timed
from the start command to the log's first iteration after the resume, and stopped again. The
padding is two SPARSE files (``os.truncate``: no disk space used), ``__<R>_99.distcp`` for each rank R, recorded with
its true digest where that engine's verification reads it, so every check reads every byte: this
program's checksum records (``checksums/rank<R>.json``, size and CRC-32, megatron_ext/run_spec/
checksums.py; each rank verifies its own writers' files at the resume, half each), and Megatron-LM's
``integrity.json`` (SHA-256), read through by node 0's pass before torchrun starts
(orchestration/node/resume_point.py: node 0's log says ``verifying the checkpoint of iteration N``)
and again by its own ``--verify-integrity`` on rank 0 inside ``load-checkpoint``. Megatron-LM is
core_v0.19.0 on Python 3.12 (/work/shared/megatron-lm/core_v0.19.0.tar.gz, .venv-py312), with the
tests' CUDA-on-CPU shim.

Then the hashing alone, as checksums.py computes it (8 MiB reads, ``hashlib.sha256``,
``zlib.crc32``, one thread): from a file of real random bytes just written and synced (in the page
cache: what a save reads back to record it) and from a fresh sparse file each time (what a restart
here reads: no disk, the page cache filled with zero pages): GB/s and seconds per GB, the median of
``--repeats``. The table's columns: the start command's own time (it returns once torchrun is up),
the time to node 0's ``starting torchrun`` (after node 0's pass, Megatron-LM), to the first
iteration after the resume (``restart s``) and, per GB padded, against the unpadded restart; node 0's
pass (its log's ``read X GB ... through in S s``, whole seconds) and the ranks' check (this program:
rank 0's ``verified against its checksums in S s``; Megatron-LM: its ``load-checkpoint`` timer, the
most of any rank: rank 0's --verify-integrity and the load).

How this maps to a user's checkpoint: Qwen3-1.7B with its optimizer state is about 24 GB, Qwen3-32B
about 450 GB, read from a shared file system at about 1 GB/s per node. A sparse file here costs no
disk I/O (the kernel hands out zero pages), so a padded restart measures the hashing (and the page
cache's filling), not a transfer: on the cluster each pass also reads its bytes at ~1 GB/s, and as
checksums.py reads and hashes in turn in one thread, a pass costs about 1 s/GB + 1 / (the hash's
GB/s) per reading process; Megatron-LM's restart has two such passes over every byte (node 0's,
then rank 0's), this program's one, split over the ranks (and their nodes). The last lines carry the
largest padding's seconds per GB to 24, 115 and 450 GB read by one node that way: an estimate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from conftest import (MEGATRON_LM_TARBALL, VENV_312_PYTHON, clean_env, free_port, megatron_lm_env,  # noqa: E402
                      run_script, tagged_pids, write_data_set)
from standins import megatron_lm_data_set  # noqa: E402
from megatron_ext.host.json_files import write_text_atomic  # noqa: E402
from megatron_ext.run_spec.checkpoints import iteration_dir_name, latest_iteration  # noqa: E402
from megatron_ext.run_spec.checksums import (CHUNK_BYTES, INTEGRITY_FILE, checkpoint_bytes_on_disk, crc32_of,  # noqa: E402
                                             record_path, sha256_of)
from megatron_ext.run_spec.engines import MEGATRON_CORE, MEGATRON_LM, Engine  # noqa: E402
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED  # noqa: E402

RANKS = 2
SAVE_EVERY = 3
PAD_NAME = "__{rank}_99.distcp"
"""A writer's name (checksums.py writer_rank), so that whoever verifies that rank's files reads it; each
engine's loader reads only the files its metadata names (tests/standins.py pad_checkpoint names it so too)."""
RESUMING = re.compile(r"resuming from iteration (\d+)")
NODE0_PASS = re.compile(r"read ([\d.]+) GB of \d+ checkpoint\(s\) through in (\d+) s")
RANKS_VERIFIED = re.compile(r"verified against its checksums in ([\d.]+) s")
LOAD_CHECKPOINT = re.compile(r"load-checkpoint \.*: \(([\d.]+), ([\d.]+)\)")
WAITED = "verifying the checkpoint of iteration"


# -- digests of the padding, without reading it ------------------------------------------------

def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc(A), crc(B) and len(B) (zlib's crc32_combine, which Python lacks). Pure."""
    if len2 <= 0:
        return crc1
    op = _gf2_square(_gf2_square([0xEDB88320] + [1 << n for n in range(31)]))  # one zero bit, squared twice: four
    while len2:
        op = _gf2_square(op)  # one zero byte first, then 2, 4, 8, ... bytes
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2


def crc32_of_zeros(num_bytes: int) -> str:
    """CRC-32 of ``num_bytes`` zero bytes as checksums.py writes it (8 hex digits), by doubling. Pure."""
    one, crc, length = zlib.crc32(b"\0"), 0, 0
    for bit in bin(num_bytes)[2:] if num_bytes else "":
        crc, length = crc32_combine(crc, crc, length), 2 * length
        if bit == "1":
            crc, length = crc32_combine(crc, one, 1), length + 1
    return f"{crc:08x}"


def sha256_of_zeros(sizes: list[int]) -> dict[int, str]:
    """SHA-256 of that many zero bytes, for each of ``sizes``, in one pass up to the largest."""
    digest, done, out = hashlib.sha256(), 0, {}
    block = memoryview(bytes(64 * 2**20))
    for size in sorted(set(sizes)):
        while done < size:
            n = min(len(block), size - done)
            digest.update(block[:n])
            done += n
        out[size] = digest.copy().hexdigest()
    return out


# -- padding a checkpoint -----------------------------------------------------------------------

def pad_checkpoint(engine: Engine, folder: Path, pad_bytes: int, sha256s: dict[int, str]) -> None:
    """Pad ``folder`` with ``pad_bytes`` in one sparse file per rank (any earlier padding replaced),
    each recorded with its true digest in that engine's integrity record."""
    each = pad_bytes // RANKS
    for rank in range(RANKS):
        path = folder / PAD_NAME.format(rank=rank)
        path.unlink(missing_ok=True)
        if each:
            with open(path, "wb") as fh:
                fh.truncate(each)
    names = {PAD_NAME.format(rank=rank) for rank in range(RANKS)}
    if engine is MEGATRON_LM:
        manifest_path = folder / INTEGRITY_FILE
        manifest = json.loads(manifest_path.read_text())
        manifest["files"] = {k: v for k, v in manifest["files"].items() if k not in names}
        if each:
            manifest["files"].update({name: sha256s[each] for name in sorted(names)})
        write_text_atomic(manifest_path, json.dumps(manifest, indent=2))
        return
    crc = crc32_of_zeros(each)
    for rank in range(RANKS):
        record = record_path(folder, rank)
        entries = json.loads(record.read_text())
        entries["files"].pop(PAD_NAME.format(rank=rank), None)
        if each:
            entries["files"][PAD_NAME.format(rank=rank)] = {"bytes": each, "crc32": crc}
        write_text_atomic(record, json.dumps(entries, indent=0, sort_keys=True))


# -- the runs -----------------------------------------------------------------------------------

@dataclass
class EngineRun:
    """One engine's run: its name, environment, data set and where its files are."""

    engine: Engine
    run: str
    env: dict[str, str]
    data: str
    root: Path
    started: list[str] = field(default_factory=list)

    @property
    def log(self) -> Path:
        return self.root / "logs" / f"{self.run}_node0.log"

    @property
    def checkpoints(self) -> Path:
        return self.root / "runs" / self.run / "checkpoints"

    def start(self) -> subprocess.CompletedProcess:
        self.started.append(self.run)
        return run_script("start_training.sh", "gpt_smoke", self.data, self.run,
                          env={**self.env, "MASTER_PORT": str(free_port())}, timeout=900)

    def start_in_background(self, out: Path) -> subprocess.Popen:
        """The start command, not waited for (its output to ``out``), so that the log is watched meanwhile."""
        self.started.append(self.run)
        with open(out, "w") as fh:
            return subprocess.Popen(["bash", str(REPO / "training_scripts" / "start_training.sh"), "gpt_smoke", self.data,
                                     self.run], env={**self.env, "MASTER_PORT": str(free_port())}, cwd=REPO,
                                    stdout=fh, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> str:
        stop = run_script("stop_training.sh", self.run, env=self.env, timeout=400)
        deadline = time.monotonic() + 60
        while tagged_pids(self.run) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = tagged_pids(self.run)
        return f"stop rc {stop.returncode}" + (f"; left: {left}" if left else "")


def set_up(engine: Engine, tmp: Path) -> EngineRun:
    root = tmp / engine.name
    (root / "tmp").mkdir(parents=True)
    base = {"ARTIFACT_ROOT": str(root), "NPROC_PER_NODE": str(RANKS), "TMPDIR": str(root / "tmp")}
    if engine is MEGATRON_LM:
        tarball = MEGATRON_LM_TARBALL.with_name("core_v0.19.0.tar.gz")
        for need in (tarball, VENV_312_PYTHON):
            if not need.exists():
                raise SystemExit(f"Megatron-LM core_v0.19.0 needs {need} (bash .ci/py312_env.sh; the shared tarball)")
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp / "megatron_lm", filter="data")
        checkout = next((tmp / "megatron_lm").iterdir())
        subprocess.run([str(VENV_312_PYTHON), "-m", "compileall", "-q", "-j", "2", str(checkout / "megatron"),
                        *(str(checkout / f) for f in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"))],
                       capture_output=True, timeout=600)  # as the tests' checkout is (its ranks import it)
        env = megatron_lm_env(checkout, LAUNCHER_PYTHON=str(VENV_312_PYTHON), **base)
        data = megatron_lm_data_set(tmp / "lm.yaml", train_iters=10000, save_interval=SAVE_EVERY)
        return EngineRun(engine, "restart_lm", env, data, root)
    return EngineRun(engine, "restart_own", clean_env(**base),
                     write_data_set(tmp / "own.yaml", train_iters=10000, save_interval=SAVE_EVERY), root)


def wait(predicate: Callable[[], object], timeout_s: float, what: str, er: EngineRun) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.25)
    tail = er.log.read_text(errors="replace")[-3000:] if er.log.exists() else "(no log)"
    raise RuntimeError(f"{er.run}: no {what} within {timeout_s:.0f} s; node 0's log ends:\n{tail}")


def first_checkpoint(er: EngineRun) -> str:
    start = er.start()
    if start.returncode != 0:
        raise RuntimeError(f"{er.run}: the first start failed:\n{start.stdout[-2000:]}{start.stderr[-2000:]}")
    wait(lambda: (latest_iteration(er.checkpoints) or 0) >= SAVE_EVERY, 900, "first checkpoint", er)
    return er.stop()


@dataclass
class Restart:
    """One padded restart, as timed here and as node 0's log tells it."""

    engine: str
    padded_gb: float
    checkpoint_gb: float
    start_rc: int | None
    start_s: float | None
    """The start command's own time (it returns once the node's processes are up)."""
    torchrun_s: float | None
    """The start command to node 0's log saying ``starting torchrun`` (after node 0's pass, Megatron-LM)."""
    restart_s: float | None
    """The start command to the first iteration after the resume in node 0's log."""
    waited: bool
    """Node 0's log says ``verifying the checkpoint of iteration ...`` (its pass before torchrun)."""
    node0_pass_s: float | None
    ranks_verify_s: float | None
    """This program: rank 0's 'verified against its checksums in S s' (each rank its writers' files);
    Megatron-LM: its ``load-checkpoint`` timer, max across ranks (--verify-integrity on rank 0, then the load)."""
    outcome: str


def restart(er: EngineRun, padded_gb: float, sha256s: dict[int, str], timeout_s: float) -> Restart:
    """Pad the run's latest checkpoint, start it, time to the first iteration after the resume, stop it."""
    latest = latest_iteration(er.checkpoints)
    folder = er.checkpoints / iteration_dir_name(latest)
    pad_checkpoint(er.engine, folder, int(padded_gb * 1e9) // RANKS * RANKS, sha256s)
    size_gb = checkpoint_bytes_on_disk(folder) / 1e9
    offset = er.log.stat().st_size if er.log.exists() else 0
    out = er.root / f"start_{padded_gb:g}.out"

    def new_text() -> str:
        if not er.log.exists():
            return ""
        with open(er.log, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")

    began = time.monotonic()
    start = er.start_in_background(out)
    start_s = torchrun_s = restart_s = None
    outcome, gone, deadline = "", 0, began + timeout_s
    while not outcome and restart_s is None:
        now, text = time.monotonic(), new_text()
        if start_s is None and start.poll() is not None:
            start_s = now - began
            if start.returncode != 0:
                outcome = "start failed: " + (out.read_text().strip().splitlines() or ["(no output)"])[-1][:200]
        if torchrun_s is None and ATTEMPT_STARTED in text:
            torchrun_s = now - began
        records, _ = er.engine.parse_log(text)
        if any(r.iteration > latest for r in records):
            restart_s = now - began
        elif start_s is not None:
            gone = 0 if tagged_pids(er.run) else gone + 1
            if gone >= 8:
                outcome = "the run ended before an iteration: " + (text.strip().splitlines() or ["(empty log)"])[-1][:200]
        if not outcome and restart_s is None and now > deadline:
            outcome = f"no iteration within {timeout_s:.0f} s"
        time.sleep(0.2 if restart_s is None else 0)
    if start.poll() is None:
        start.wait(timeout=120)
        start_s = time.monotonic() - began
    text = new_text()
    node0 = NODE0_PASS.search(text)
    verified, loaded = RANKS_VERIFIED.search(text), LOAD_CHECKPOINT.search(text)
    ranks_s = float(verified.group(1)) if verified else float(loaded.group(2)) / 1000 if loaded else None
    resumed = RESUMING.search(out.read_text())
    if resumed is None or int(resumed.group(1)) != latest:
        outcome += f" (the start line does not say 'resuming from iteration {latest}')"
    stopped = er.stop()
    outcome = outcome or "ok"
    if said := [line for line in out.read_text().splitlines() if line.startswith("waiting: ")]:
        outcome += f"; the start said 'waiting: ...' {len(said)} time(s)"
    if stopped != "stop rc 0":
        outcome += f" ({stopped})"
    return Restart(er.engine.tag or "this program", padded_gb, size_gb, start.returncode, start_s, torchrun_s, restart_s,
                   WAITED in text, float(node0.group(2)) if node0 else None, ranks_s, outcome)


# -- hashing alone ------------------------------------------------------------------------------

def read_through(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(CHUNK_BYTES):
            pass


HASHES: tuple[tuple[str, Callable[[Path], object]], ...] = (
    ("SHA-256 (Megatron-LM integrity.json)", sha256_of),
    ("CRC-32 (this program's checksums)", crc32_of),
    ("read only, no hash", read_through),
)


def hashing_rates(tmp: Path, gb: float, repeats: int) -> list[tuple[str, str, float]]:
    """(hash, file, median GB/s) over ``repeats``: a file of random bytes just written (in the page
    cache, as a save reads its files back) and a fresh sparse file each time (as a restart here)."""
    size = int(gb * 1e9)
    real = tmp / "random.bin"
    with open(real, "wb") as fh:
        for _ in range(size // CHUNK_BYTES):
            fh.write(os.urandom(CHUNK_BYTES))
        fh.write(os.urandom(size % CHUNK_BYTES))
        fh.flush()
        os.fsync(fh.fileno())  # written back now, not while the sparse reads are timed; its pages stay cached
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, fn in HASHES:
            began = time.perf_counter()
            fn(real)
            times.setdefault((name, "random, in the page cache (a save)"), []).append(time.perf_counter() - began)
            sparse = tmp / "sparse.bin"
            with open(sparse, "wb") as fh:
                fh.truncate(size)
            began = time.perf_counter()
            fn(sparse)
            times.setdefault((name, "fresh sparse file (a restart here)"), []).append(time.perf_counter() - began)
            sparse.unlink()
    real.unlink()
    return [(name, where, gb / statistics.median(ts)) for (name, where), ts in times.items()]


# -- the tables ---------------------------------------------------------------------------------

HEADER = (f"{'engine':<12} | {'padded GB':>9} | {'ckpt GB':>8} | {'start cmd s':>11} | {'torchrun at s':>13} | "
          f"{'restart s':>9} | {'+ s/GB':>6} | {'node 0 waited':>13} | {'node 0 pass s':>13} | {'ranks verify s':>14} | "
          f"outcome")


def format_restart(r: Restart, base_s: float | None) -> str:
    """One row of the table; ``base_s``: the engine's unpadded restart (for the seconds per GB padded). Pure."""
    fmt = lambda v, w: f"{v:{w}.1f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    slope = (f"{(r.restart_s - base_s) / r.padded_gb:6.2f}"
             if r.padded_gb and r.restart_s is not None and base_s is not None else f"{'-':>6}")
    return (f"{r.engine:<12} | {r.padded_gb:>9g} | {r.checkpoint_gb:>8.3f} | {fmt(r.start_s, 11)} | "
            f"{fmt(r.torchrun_s, 13)} | {fmt(r.restart_s, 9)} | {slope} | {'yes' if r.waited else 'no':>13} | "
            f"{fmt(r.node0_pass_s, 13)} | {fmt(r.ranks_verify_s, 14)} | {r.outcome}")


def base_of(rows: list[Restart], engine: str) -> float | None:
    return next((r.restart_s for r in rows if r.engine == engine and r.padded_gb == 0), None)


def print_rates(rates: list[tuple[str, str, float]], gb: float, repeats: int) -> None:
    print(f"\nhashing as checksums.py does it, {gb:g} GB files, median of {repeats}; "
          f"at a 1 GB/s share a pass costs ~1 s/GB more (read, then hash, in one thread)")
    print(f"{'hash':<37} | {'file':<35} | {'GB/s':>6} | {'s per GB':>8}")
    for name, where, rate in rates:
        print(f"{name:<37} | {where:<35} | {rate:>6.2f} | {1 / rate:>8.2f}")


PASSES = {"this program": 1, "Megatron-LM": 2}
"""How many times a restart reads every byte: this program's ranks once (split), Megatron-LM node 0's
pass and then its own --verify-integrity."""
USER_GB = (24, 115, 450)
"""Qwen3-1.7B, 8B and 32B with their optimizer state."""


def print_projection(rows: list[Restart]) -> None:
    """The largest padding's seconds per GB carried to a user's checkpoint, read by one node from a
    share at 1 GB/s (each pass reads and hashes in turn): an estimate, not a measurement."""
    print("\nat a user's size, one node reading at 1 GB/s: the unpadded restart + (s/GB here + 1 s/GB x passes) x GB")
    for engine, passes in PASSES.items():
        base = base_of(rows, engine)
        done = [r for r in rows if r.engine == engine and r.padded_gb and r.restart_s is not None]
        top = max(done, key=lambda r: r.padded_gb, default=None)
        if base is None or top is None or top.padded_gb < 1:
            print(f"{engine}: no restart padded with 1 GB or more to carry")
            continue
        slope = (top.restart_s - base) / top.padded_gb
        told = ", ".join(f"{gb} GB {(base + (slope + passes) * gb) / 60:.0f} min" for gb in USER_GB)
        print(f"{engine}: {slope:.2f} s/GB here (at {top.padded_gb:g} GB), {passes} pass(es): {told}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,100", help="padding in GB, comma-separated (the real checkpoint is also "
                                                          "restarted unpadded first)")
    p.add_argument("--engines", default="own,megatron-lm", help="own, megatron-lm or both, comma-separated")
    p.add_argument("--hash-gb", type=float, default=1.0, help="size of the files the hashing is timed on")
    p.add_argument("--repeats", type=int, default=3, help="hashing repeats")
    p.add_argument("--restart-timeout-s", type=float, default=1500)
    args = p.parse_args()
    sizes = [0.0, *(float(s) for s in args.sizes.split(",") if s.strip())]
    engines = {"own": MEGATRON_CORE, MEGATRON_LM.name: MEGATRON_LM}
    chosen = [engines[e.strip()] for e in args.engines.split(",") if e.strip()]
    rows: list[Restart] = []
    with tempfile.TemporaryDirectory(prefix="ckpt_restart_") as tmp_name:
        tmp = Path(tmp_name)
        sha256s: dict[int, str] = {}
        if MEGATRON_LM in chosen:
            began = time.monotonic()
            sha256s = sha256_of_zeros([int(s * 1e9) // RANKS for s in sizes if s])
            print(f"SHA-256 of the padding computed in {time.monotonic() - began:.0f} s", flush=True)
        print(HEADER, flush=True)
        for engine in chosen:
            er = set_up(engine, tmp)
            try:
                print(f"{er.run}: first checkpoint, {first_checkpoint(er)}", flush=True)
                for gb in sizes:
                    rows.append(restart(er, gb, sha256s, args.restart_timeout_s))
                    print(format_restart(rows[-1], base_of(rows, rows[-1].engine)), flush=True)
            finally:
                for run in set(er.started):
                    if tagged_pids(run):
                        er.stop()
        rates = hashing_rates(tmp, args.hash_gb, args.repeats)
    print(f"\nrestart against checkpoint size: 1 node, {RANKS} CPU processes, gpt_smoke, padded with sparse files "
          f"recorded with their digests; restart s: the start command to the first iteration after the resume; "
          f"+ s/GB: against the unpadded restart")
    print(HEADER)
    for r in rows:
        print(format_restart(r, base_of(rows, r.engine)))
    print_rates(rates, args.hash_gb, args.repeats)
    print_projection(rows)


if __name__ == "__main__":
    main()
