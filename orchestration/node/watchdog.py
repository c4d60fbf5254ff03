"""The hang watchdog of one node: its ranks' progress against their phases' limits, every rank's
stack when the run hangs, and who the suspects are.

    py-spy dump --pid PID [--nonblocking]        # what :func:`dump_stack` runs for each rank

:class:`Watchdog` reads the node-local progress files of this node's ranks
(:mod:`megatron_ext.run_spec.resilience`); ENGINE=megatron-lm writes none, so there it watches the
iteration lines of the node's log instead (Megatron-LM prints them on the last rank only: the
other nodes rely on that one). :func:`dump_node` writes every local rank's Python stack (py-spy,
under a timeout; ``--nonblocking`` for a stopped process, which py-spy's default mode cannot
suspend) with the process state and its progress into ``runs/<run>/hangs/<attempt>/``, and a
report per node; :func:`find_suspects` names who hung from all nodes' reports. Side effects: reads
/proc and files, runs py-spy, signals ranks (SIGUSR2: the rank's own faulthandler dump when py-spy
cannot read it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.run_spec.convert import unstructure
from megatron_ext.run_spec.engines import Engine
from megatron_ext.run_spec.iteration_log import ATTEMPT_STARTED
from megatron_ext.run_spec.resilience import (DUMP_REQUEST, Phase, RankProgress, ResilienceParams, PauseSchedule, phase_limit_s,
                                              read_progress)
from orchestration.node.processes import parent_pid, process_environ, process_start_time, tagged_processes
from megatron_ext.host.json_files import write_json_atomic
from orchestration.node.run_state import tail
from orchestration.node.wire import NodeTarget

DUMP_TIMEOUT_S = 20.0
FLIGHT_RECORDER_WAIT_S = 5.0
LOG_CHECK_S = 2.0
"""How often the Megatron-LM log watch reads the log's tail."""
FAULTHANDLER_WAIT_S = 2.0
SILENT_FIRST_MARGIN_S = 1.0
"""Ranks whose silence is within this of the longest count as silent first: the nodes measure
when each saw the hang claimed, a poll (0.5 s) apart."""
COLLECTIVE_MARKERS = ("torch/distributed/", "distributed_c10d", "all_reduce", "all_gather", "reduce_scatter", "broadcast",
                      "barrier", "run_backward", "_engine_run_backward", "backward (torch/", "zero_redundancy_optimizer")
"""Frames of a stack that mean the rank waits in (or for) a collective: torch.distributed calls,
and autograd's backward, where DDP and FSDP reduce gradients."""


@dataclass(frozen=True, kw_only=True)
class Hang:
    """What a node's watchdog found: one rank past its phase's limit."""

    node_rank: int
    rank: int | None
    """The global rank (None: a local rank that never reported)."""
    phase: Phase
    iteration: int
    elapsed_s: float
    limit_s: float
    detail: str


def local_ranks(node_rank: int, nproc_per_node: int) -> range:
    """The global ranks torchrun gives this node (static rendezvous: node rank x processes + local rank)."""
    return range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node)


class Watchdog:
    def __init__(self, params: ResilienceParams, node_rank: int, nnodes: int, nproc_per_node: int, progress_dir: Path,
                 engine: Engine, log_path: Path, started_at: float, place: int | None = None, pauses: PauseSchedule | None = None):
        """``node_rank`` names the node (its rank in the start's plan); ``place`` is its torchrun node
        rank in this attempt (default the same: it differs once a lost node was left out) and ``nnodes``
        the attempt's nodes; ``pauses``: when the run saves and evaluates (the Megatron-LM log watch)."""
        self.params, self.node_rank, self.nproc = params, node_rank, nproc_per_node
        self.place = node_rank if place is None else place
        self.progress_dir, self.engine, self.log_path, self.started_at = progress_dir, engine, log_path, started_at
        self.prints_iterations = self.place == nnodes - 1
        """Megatron-LM prints its iteration lines on the last rank, which is on the last node."""
        self.pauses = pauses
        self._log_iteration, self._log_seen_at = 0, started_at
        self._pause: tuple[Phase, float] | None = None
        """What follows the last line by the schedule (a validation pass, a save) and how long it may take."""
        self._save_began_at: float | None = None
        """Background saves: when the line before the latest one was seen (the save began after it)."""
        self._log_checked = 0.0

    def check(self, now: float) -> Hang | None:
        if not self.params.hang_watchdog:
            return None
        return self._check_log(now) if self.engine.progress_from_log else self._check_progress(now)

    def _check_progress(self, now: float) -> Hang | None:
        reports = read_progress(self.progress_dir)
        for rank in local_ranks(self.place, self.nproc):
            p = reports.get(rank)
            if p is None:
                if now - self.started_at > self.params.hang_setup_s:
                    return Hang(node_rank=self.node_rank, rank=rank, phase=Phase.SETUP, iteration=0, elapsed_s=now - self.started_at,
                                limit_s=self.params.hang_setup_s, detail=f"rank {rank} never reported since torchrun started")
                continue
            limit = phase_limit_s(p, self.params)
            if limit is not None and now - p.phase_started_at > limit:
                return Hang(node_rank=self.node_rank, rank=rank, phase=p.phase, iteration=p.iteration, elapsed_s=now - p.phase_started_at,
                            limit_s=limit, detail=f"rank {rank} has been in {p.phase} of iteration {p.iteration} for "
                            f"{now - p.phase_started_at:.0f} s (limit {limit:.0f} s)")
        return None

    def _check_log(self, now: float) -> Hang | None:
        """Megatron-LM: the time since the last iteration line, against the step rule applied to the
        lines' own step times (times the iterations between two lines: the log interval); setup's
        limit before the first lines. Only the node of the last rank has the lines; the others rely
        on it.

        A pause: a save's lines (``saving checkpoint ...``) are rank 0's, on node 0, so the schedule
        (:class:`PauseSchedule`) says what follows a line before the next: the validation pass and
        the save of an iteration come after its line (core_v0.19.0 training.py ``train``), and the
        gap to the next line may last their limits (``hang_eval_s``, ``hang_checkpoint_s``). A save
        in the background stops training again for its finalize on rank 0 at whatever later step its
        write ends (megatron-core's ``save_integrity_manifest`` hashes every file there with
        ``--verify-integrity``; dist_checkpointing/serialization.py ``integrity_finalize_fn``): any
        gap may then last until the save's limit has passed, counted from its start."""
        if not self.prints_iterations or now - self._log_checked < LOG_CHECK_S:
            return None
        self._log_checked = now
        # This attempt's lines only: the node log holds every earlier start's and attempt's too, and
        # their last iteration line is not this attempt's progress (its setup limit applies until its own).
        text = tail(self.log_path, 400).rpartition(ATTEMPT_STARTED)[2]
        records, _ = self.engine.parse_log(text)
        if not records:
            if now - self.started_at > self.params.hang_setup_s:
                return Hang(node_rank=self.node_rank, rank=None, phase=Phase.SETUP, iteration=0, elapsed_s=now - self.started_at,
                            limit_s=self.params.hang_setup_s,
                            detail=f"no iteration line {now - self.started_at:.0f} s after torchrun started "
                            f"(limit {self.params.hang_setup_s:.0f} s)")
            return None
        last = records[-1].iteration
        if last != self._log_iteration:
            self._pause = self._pause_after(last)
            pauses = self.pauses
            if pauses is not None and pauses.background:
                # a save after this line, or one between lines this read has not seen (reads are 2 s apart)
                unseen = pauses.next_line(self._log_iteration) if self._log_iteration else records[0].iteration
                if pauses.saves_in(min(unseen, last), pauses.next_line(last)):
                    self._save_began_at = now
            self._log_iteration, self._log_seen_at = last, now
            return None
        between = [r.step_time_s * (r.iteration - q.iteration) for q, r in zip(records, records[1:])][-20:]
        if len(records) > self.params.hang_warmup_steps and between:
            limit = max(self.params.hang_step_floor_s, self.params.hang_step_factor * max(between))
        else:
            limit = self.params.hang_setup_s
        # the steps between two lines, and on top what the schedule puts between them
        phase, extra = self._pause or (Phase.STEP, 0.0)
        if self._save_began_at is not None:
            window = self._save_began_at + self.params.hang_checkpoint_s - self._log_seen_at
            if window > extra:
                phase, extra = Phase.CHECKPOINT, window
        limit += extra
        elapsed = now - self._log_seen_at
        if elapsed > limit:
            why = {Phase.CHECKPOINT: ": a save", Phase.EVAL: ": a validation pass"}.get(phase, "")
            return Hang(node_rank=self.node_rank, rank=None, phase=phase, iteration=last, elapsed_s=elapsed, limit_s=limit,
                        detail=f"no iteration line after iteration {last} for {elapsed:.0f} s (limit {limit:.0f} s{why})")
        return None

    def _pause_after(self, iteration: int) -> tuple[Phase, float] | None:
        """What the schedule puts between ``iteration``'s line and the next, and its limit. After the
        run's last line, Megatron-LM may validate up to three times (the loop's pass, ``pretrain``'s
        validation and test passes), save, and finalize a background save before it exits. Pure."""
        pauses = self.pauses
        if pauses is None:
            return None
        following = pauses.next_line(iteration)
        evaluates, saves = pauses.evaluates_in(iteration, following), pauses.saves_in(iteration, following)
        if not (evaluates or saves):
            return None
        passes, writes = int(evaluates), int(saves)
        if following > pauses.train_iters:  # the run's end
            passes, writes = 3 * passes, writes + pauses.background
        limit = self.params.hang_eval_s * passes + self.params.hang_checkpoint_s * writes
        return (Phase.CHECKPOINT if saves else Phase.EVAL), limit


# -- dumps ------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank at the moment of the hang (``hangs/<attempt>/node<N>.json``)."""

    rank: int
    node_rank: int
    host: str
    pid: int | None
    process_state: str
    """From /proc: R running, S sleeping, D disk, T stopped (SIGSTOP / a debugger), Z zombie, gone."""
    phase: Phase | None
    iteration: int | None
    phase_elapsed_s: float | None
    """How long the rank had been silent (in its phase, without a report) when this node saw the
    hang claimed: measured on this node's own clock alone (its reports and its time), so reports of
    several nodes compare without comparing their clocks."""
    limit_s: float | None
    stack_read: bool
    in_collective: bool | None
    dump: str
    """The dump file."""
    collective_seq: int | None = None
    """The flight recorder's last collective sequence number on the default process group."""
    last_collective: str | None = None
    """What that collective was (``gloo:all_reduce``, ``nccl:_reduce_scatter_base``, ...)."""
    flight_recorder: str | None = None
    """Its flight recorder's file beside the dump (None: the rank did not answer)."""


def process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return "gone"
    return stat[stat.rindex(")") + 2:].split()[0]


def worker_pids(run: str, node_rank: int, artifact_root: str | None = None) -> dict[int, int]:
    """Global rank -> pid of this node's training processes (tagged with the run, RANK set). A rank's
    own children inherit its RANK (wandb's service process, data loader workers): the rank is the
    one whose parent does not carry the same RANK."""
    ranks: dict[int, int] = {}
    for pid in tagged_processes(run, node_rank, artifact_root):
        rank = process_environ(pid).get("RANK")
        if rank is not None and rank.isdigit():
            ranks[pid] = int(rank)
    return {rank: pid for pid, rank in sorted(ranks.items()) if ranks.get(parent_pid(pid)) != rank}


def py_spy() -> str | None:
    """py-spy next to this interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stack(pid: int, state: str, faulthandler_file: Path | None) -> tuple[bool, str]:
    """(read, text): the Python stack of ``pid`` by py-spy, else the rank's own faulthandler dump,
    else why neither could read it."""
    binary = py_spy()
    notes = []
    if binary is None:
        notes.append("py-spy is not installed here (pip install py-spy), so no stack was read from outside")
    else:
        modes = [["--nonblocking"]] if state == "T" else [[], ["--nonblocking"]]
        for mode in modes:
            try:
                proc = subprocess.run([binary, "dump", "--pid", str(pid), *mode], capture_output=True, text=True,
                                      timeout=DUMP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                notes.append(f"py-spy dump {' '.join(mode)} gave no answer within {DUMP_TIMEOUT_S:.0f} s")
                continue
            if proc.returncode == 0 and proc.stdout.strip():
                return True, proc.stdout
            error = (proc.stderr or proc.stdout).strip().splitlines()
            notes.append(f"py-spy dump {' '.join(mode)} failed: {' / '.join(error[:3])}")
            if any("Permission" in line or "permission" in line for line in error):
                notes.append("py-spy needs ptrace rights: root, or CAP_SYS_PTRACE, which Docker drops unless the container "
                             "was started with --cap-add SYS_PTRACE (Kubernetes: securityContext.capabilities.add: "
                             "[SYS_PTRACE])")
                break
    if faulthandler_file is not None and state not in ("T", "gone", "Z"):
        try:
            before = faulthandler_file.stat().st_size if faulthandler_file.exists() else 0
            os.kill(pid, signal.SIGUSR2)  # the rank's faulthandler writes every thread's stack, even inside C code
            time.sleep(FAULTHANDLER_WAIT_S)
            text = faulthandler_file.read_text(errors="replace")[before:]
            if text.strip():
                return True, "\n".join(notes + ["the rank's own faulthandler dump (SIGUSR2):", text])
        except OSError as exc:
            notes.append(f"the rank's faulthandler dump failed: {exc}")
    elif state == "T":
        notes.append("the process is stopped (state T), so it cannot dump its own stack")
    return False, "\n".join(notes)


def main_thread(stack: str) -> str:
    """The main thread's part of a dump: py-spy's ``Thread N (...): "MainThread"``, or faulthandler's
    ``Current thread`` (the thread that took the signal: the main one); else the whole text."""
    blocks, current = [], []
    for line in stack.splitlines():
        if line.startswith(("Thread ", "Current thread ")) and current:
            blocks.append("\n".join(current))
            current = []
        current.append(line)
    blocks.append("\n".join(current))
    return next((b for b in blocks if '"MainThread"' in b.splitlines()[0] or b.startswith("Current thread")), stack)


def in_collective(stack: str) -> bool:
    """Whether the main thread's stack waits in a collective (see COLLECTIVE_MARKERS)."""
    return any(marker in main_thread(stack) for marker in COLLECTIVE_MARKERS)


def request_flight_recorders(progress_dir: Path, ranks: list[int], stopped: set[int]) -> dict[int, Path]:
    """Ask this node's ranks for their flight recorder; the files of those that answered within
    FLIGHT_RECORDER_WAIT_S (a stopped rank cannot). The progress directory is node-local and only
    this node's ranks write there: an earlier answer is removed before asking, so an answer is a file
    that exists, with no time or file identity compared (the file system's clock may not be this
    process's: a faked one, a file server's)."""
    request = progress_dir / DUMP_REQUEST
    files = {rank: progress_dir / f"rank{rank}.fr.json" for rank in ranks if rank not in stopped}
    for f in files.values():
        f.unlink(missing_ok=True)
    asked = time.time()
    request.touch()
    os.utime(request, (asked, asked))
    deadline = time.monotonic() + FLIGHT_RECORDER_WAIT_S
    while time.monotonic() < deadline and not all(f.exists() for f in files.values()):
        time.sleep(0.1)
    return {rank: f for rank, f in files.items() if f.exists()}


def last_collective(flight_recorder: dict) -> tuple[int | None, str | None, str]:
    """(sequence number, name, one line) of the last collective on the default process group."""
    if "error" in flight_recorder:
        return None, None, f"flight recorder: {flight_recorder['error']}"
    entries = [e for e in flight_recorder.get("entries", []) if not e.get("is_p2p") and str(e.get("pg_id", 0)) == "0"]
    if not entries:
        return None, None, "flight recorder: no collective on the default process group yet"
    e = max(entries, key=lambda e: e.get("collective_seq_id", 0))
    seq, name = e.get("collective_seq_id"), e.get("profiling_name")
    return seq, name, (f"flight recorder: last collective #{seq} {name} ({e.get('state')}), "
                       f"{len(flight_recorder.get('entries', []))} recorded")


def dump_node(target: NodeTarget, ranks: range, progress_dir: Path, params: ResilienceParams, attempt: int,
              why: str) -> list[RankReport]:
    """Every local rank's (``ranks``: their global ranks in the attempt) stack, state and flight
    recorder into the attempt's hang folder; this node's report written last. Only the ranks of the
    run under the target's artifact root (processes.tagged_processes)."""
    node_rank, host = target.node_rank, target.host
    out_dir = target.paths.hangs_dir(attempt)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    progress = read_progress(progress_dir)
    pids = worker_pids(target.run, node_rank, str(target.artifact_root))
    stopped = {rank for rank, pid in pids.items() if process_state(pid) == "T"}
    recorders = request_flight_recorders(progress_dir, list(ranks), stopped)
    reports = []
    for rank in ranks:
        p: RankProgress | None = progress.get(rank)
        pid = pids.get(rank) or (p.pid if p and process_start_time(p.pid) is not None else None)
        state = process_state(pid) if pid else "gone"
        read, stack = dump_stack(pid, state, progress_dir / f"rank{rank}.stack") if pid and state != "gone" else \
            (False, "the process is gone")
        limit = phase_limit_s(p, params) if p else None
        elapsed = now - p.phase_started_at if p else None
        dump = out_dir / f"node{node_rank}_rank{rank}.txt"
        seq, name, recorded = None, None, "flight recorder: no answer (the rank is stopped, or did not answer in time)"
        copy = out_dir / f"node{node_rank}_rank{rank}.flight_recorder.json" if rank in recorders else None
        if copy is not None:
            shutil.copyfile(recorders[rank], copy)
            try:
                seq, name, recorded = last_collective(json.loads(copy.read_text()))
            except ValueError:
                recorded = "flight recorder: unreadable"
            recorded += f"; {copy.name}"
        header = [f"rank {rank} (node {node_rank}, {host}), pid {pid}, attempt {attempt}, process state {state}",
                  f"progress: {p.phase} of iteration {p.iteration} for {elapsed:.1f} s" +
                  (f" (limit {limit:.0f} s)" if limit else "") if p else "progress: never reported",
                  recorded, f"hang: {why}", ""]
        dump.write_text("\n".join(header) + stack + "\n")
        reports.append(RankReport(rank=rank, node_rank=node_rank, host=host, pid=pid, process_state=state, phase=p.phase if p else None,
                                  iteration=p.iteration if p else None,
                                  phase_elapsed_s=elapsed, limit_s=limit, stack_read=read,
                                  in_collective=in_collective(stack) if read else None, dump=str(dump), collective_seq=seq,
                                  last_collective=name, flight_recorder=str(copy) if copy is not None else None))
    write_json_atomic(out_dir / f"node{node_rank}.json", unstructure(reports))
    return reports


# -- who hung (pure) --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Suspects:
    ranks: tuple[RankReport, ...]
    why: str
    others: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    named: bool = True
    """Whether the evidence singles the ranks out (False: no rank reported, or every rank waits alike,
    which names no node: orchestration/node/exclusion.py)."""


def find_suspects(reports: list[RankReport]) -> Suspects:
    """The rank(s) that hung, in order of evidence: stopped processes (state T); else ranks whose
    stack is outside any collective while others wait in one; else ranks behind the others'
    iteration; else the rank(s) that went silent first."""
    if not reports:
        return Suspects((), "no rank reported", named=False)
    stopped = [r for r in reports if r.process_state == "T"]
    if stopped:
        return Suspects(tuple(stopped), "stopped (process state T: SIGSTOP, a job-control stop or a debugger)",
                        _others(reports, stopped))
    gone = [r for r in reports if r.process_state in ("gone", "Z")]
    if gone:
        return Suspects(tuple(gone), "gone (the process ended while its peers waited)", _others(reports, gone))
    read = [r for r in reports if r.stack_read]
    outside = [r for r in read if r.in_collective is False]
    if outside and len(outside) < len(reports):
        return Suspects(tuple(outside), "not inside a collective while the others wait in one", _others(reports, outside))
    seqs = [r.collective_seq for r in reports if r.collective_seq is not None]
    if len(seqs) == len(reports) and min(seqs) < max(seqs):
        behind = [r for r in reports if r.collective_seq == min(seqs)]
        return Suspects(tuple(behind), f"behind the others in collectives (#{min(seqs)}, the others at #{max(seqs)})",
                        _others(reports, behind))
    iterations = [r.iteration for r in reports if r.iteration is not None]
    if iterations and min(iterations) < max(iterations):
        behind = [r for r in reports if r.iteration == min(iterations)]
        return Suspects(tuple(behind), f"behind the others (iteration {min(iterations)}, the others at {max(iterations)})",
                        _others(reports, behind))
    reported = [r for r in reports if r.phase_elapsed_s is not None]
    never = [r for r in reports if r.phase_elapsed_s is None]
    if never and reported:
        return Suspects(tuple(never), "never reported progress", _others(reports, never))
    if reported:  # each node's silence by its own clock when it saw the claim (no two machines' clocks compared)
        longest = max(r.phase_elapsed_s for r in reported)
        silent = [r for r in reported if longest - r.phase_elapsed_s < SILENT_FIRST_MARGIN_S]
        if len(silent) < len(reports):
            return Suspects(tuple(silent), "silent first (silent the longest when the hang was claimed)",
                            _others(reports, silent))
    return Suspects(tuple(reports), "every rank waits alike: no single suspect (a collective that never completes, e.g. a "
                                    "network fault)", named=False)


def _others(reports: list[RankReport], suspects: list[RankReport]) -> str:
    rest = [r for r in reports if r not in suspects]
    waiting = [r for r in rest if r.in_collective]
    return (f"{len(waiting)} of the other {len(rest)} rank(s) wait in a collective" if rest else "")
