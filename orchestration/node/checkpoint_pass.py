"""The checkpoint an attempt starts from, a part of the node's supervisor
(:class:`orchestration.node.supervisor.Supervisor`; the state is the supervisor's, set in its
``__init__``). Before a Megatron-LM attempt node 0 chooses the checkpoint every node loads
(resume_point.py), after a checksum pass the attempt's nodes share: node 0 asks about one
checkpoint at a time on the board, each node reads its share of the writers' files and answers,
node 0 reads its own share and judges from every answer, reading the share of a node lost
meanwhile (its beats, not a fixed time) or of one that does not see the checkpoint's records
itself. What each node does meanwhile is in its heartbeat record, which a start waiting on the
node follows. Every attempt's watchdog allows for the size of the checkpoint it may load
(resilience.py ``for_checkpoint``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from megatron_ext.run_spec.checksums import (CheckpointHealth, checkpoint_bytes_on_disk, health, list_checkpoints,
                                             recorded_files)
from megatron_ext.run_spec.errors import UserError
from megatron_ext.run_spec.megatron_lm_checkpoints import read_tracker, tracked_dir_name
from megatron_ext.run_spec.resilience import ResilienceParams, for_checkpoint
from megatron_ext.run_spec.shared_fs import SHARED_FS_LAG_S, still_showing
from orchestration.node import resume_point
from orchestration.node.resume_point import ResumePoint
from orchestration.node.run_state import RunState

CHECK_SAY_S = 30.0
"""How often a node's log says how far its checksum pass before an attempt has read."""


class CheckpointPass:
    """Node 0's choice of the checkpoint a Megatron-LM attempt loads, the pass the nodes share, and
    the watchdog's limits for the checkpoint's size."""

    def resume_point(self) -> ResumePoint | None:
        """Megatron-LM's attempts: node 0 picks the checkpoint (resume_point.py) and puts it on the
        board; the others read their shares of each checkpoint it asks about, and wait for its
        choice. None where the ranks pick their own (this program). What each node does meanwhile
        is in its heartbeat record (``doing``), which a start waiting on the node follows: a pass
        over a large checkpoint takes minutes."""
        choice = self.plan.checkpoint_choice
        if choice is None:
            return None
        try:
            if not self.leader:  # as long as node 0 takes (the shared pass over a large checkpoint), while it beats
                self.heartbeat.doing = waiting = "waiting for node 0's choice of the checkpoint to resume from"
                read: set[int] = set()

                def chosen() -> ResumePoint | None:
                    point = self.board.read_resume_point(self.attempt)
                    ask = self.board.share_asked(self.attempt) if point is None else None
                    if ask is not None and ask.iteration not in read and self.rank in ask.nodes:
                        read.add(ask.iteration)
                        try:
                            self.board.write_share(self.attempt, ask.iteration, self._check_share(ask, self.rank))
                        except resume_point.PassStopped:  # the wait ends on the stop
                            return None
                        self.heartbeat.doing = waiting
                    return point
                point = self._wait(float("inf"), chosen, RunState.RESTARTING)
                return point or ResumePoint(None, False, refused="stopped on request")
            self.heartbeat.doing = "choosing the checkpoint to resume from"
            self.beat(self.heartbeat.state or RunState.RUNNING)  # the record (and its thread) before the pass
            progress = resume_point.PassProgress(tell=self._tell_doing, say=self.say, say_every_s=CHECK_SAY_S,
                                                 stopped=lambda: self.stopping)
            if len(self.members) > 1:
                progress.what += f" (this node's share, 1 of {len(self.members)})"
            try:
                point, damaged = resume_point.choose(self.paths.checkpoints_dir, choice.init_checkpoint, progress,
                                                     self._check_together(progress) if len(self.members) > 1 else None)
                if summary := progress.summary():
                    self.say(summary)
                resume_point.take(point, damaged, self.paths.checkpoints_dir)
            except (OSError, UserError) as exc:
                point = ResumePoint(None, False, refused=f"could not choose the checkpoint to resume from: {exc}")
            self.board.write_resume_point(self.attempt, point)
            return point
        finally:
            self.heartbeat.doing = ""

    def see_moved_aside(self, point: ResumePoint) -> None:
        """Wait until this node's view of the share no longer shows the folders node 0 moved aside
        (their old names), up to SHARED_FS_LAG_S: Megatron-LM saves the retrained iterations under
        those names again, and a client that read the old folder in the shared pass may still hold
        its entries (sshfs opened the file of the new save through the old entry, without O_CREAT:
        FileNotFoundError in the save's writer, on node 1 of tests/test_multinode.py)."""
        folders = [self.paths.checkpoints_dir / name for name in point.moved_aside]
        if not folders:
            return
        self._tell_doing(f"waiting for this node's view of the share to show {', '.join(point.moved_aside)} moved aside")
        began = time.monotonic()
        self._wait(SHARED_FS_LAG_S, lambda: not still_showing(folders), RunState.RESTARTING, beat=False)
        waited, showing = time.monotonic() - began, still_showing(folders)
        if showing and not self.stopping:
            self.say(f"this node's view of the share still shows {', '.join(p.name for p in showing)} {waited:.0f} s after "
                     "node 0 moved it aside (its client caches names): a save under that name may fail here")
        elif waited >= 1:
            self.say(f"this node's view of the share showed {', '.join(point.moved_aside)} for {waited:.0f} s after node 0 "
                     "moved it aside (its client caches names)")
        self._tell_doing("")

    def _check_share(self, ask: resume_point.ShareAsk, node: int) -> resume_point.ShareCheck:
        """``node``'s share of the checkpoint ``ask`` names, read here, the step in the heartbeat record."""
        k, n = ask.share(node)
        whose = "this node's" if node == self.rank else f"node {node}'s"
        progress = resume_point.PassProgress(
            tell=self._tell_doing, say=self.say, say_every_s=CHECK_SAY_S, stopped=lambda: self.stopping,
            what=f"verifying {whose} share ({k + 1} of {n}) of the checkpoint of iteration {{iteration}} for node 0's choice")
        began = time.monotonic()
        check = resume_point.check_share(self.paths.checkpoints_dir, ask, node, progress)
        found = "its records not seen here" if check.damage is None else \
            "; ".join(d.describe() for d in check.damage[:3]) or "as written"
        self.say(f"read {whose} share ({k + 1} of {n}) of the checkpoint of iteration {ask.iteration} for node 0's "
                 f"choice: {check.read_bytes / 1e9:.1f} GB in {time.monotonic() - began:.0f} s, {found}")
        return check

    def _check_together(self, progress: resume_point.PassProgress) -> Callable[[int, Path], CheckpointHealth]:
        """Node 0's check of one checkpoint, shared by the attempt's nodes (resume_point.py): asked
        on the board, its own share read here, the others' answers collected as they come. A node
        lost meanwhile (its beats, not a fixed time), or one that does not see the checkpoint's
        records, has its share read here."""
        nodes = tuple(self.members)

        def check(iteration: int, path: Path) -> CheckpointHealth:
            if not recorded_files(path):
                return health(path, iteration)
            ask = resume_point.ShareAsk(iteration, path.name, nodes)
            self.board.ask_share(self.attempt, ask)
            checks = {self.rank: resume_point.check_share(self.paths.checkpoints_dir, ask, self.rank, progress)}

            def answered() -> dict | None:
                for node in nodes:
                    if node not in checks and (found := self.board.read_share(self.attempt, iteration, node)) is not None:
                        checks[node] = found
                for node in self.liveness.lost():
                    if node in nodes and node not in checks:
                        self.say(f"node {node} is silent: its share of the checkpoint of iteration {iteration} is read here")
                        checks[node] = self._check_share(ask, node)
                return checks if len(checks) == len(nodes) else None
            self._tell_doing(f"waiting for the other nodes' shares of the checkpoint of iteration {iteration}")
            if self._wait(float("inf"), answered, RunState.RESTARTING) is None:
                raise UserError("stopped on request")
            for node, found in sorted(checks.items()):
                if found.damage is None:  # its machine did not see the records yet
                    checks[node] = self._check_share(ask, node)
            return resume_point.merged(iteration, path, list(checks.values()))
        return check

    def _tell_doing(self, doing: str) -> None:
        """The step under way before torchrun, in the heartbeat record's next write."""
        self.heartbeat.doing = doing

    def _limits(self, checkpoint: int | None) -> ResilienceParams:
        """The watchdog's limits for an attempt that loads ``checkpoint`` (None: none): setup and
        save allow for reading the largest checkpoint it may load through (one at or before it: a
        damaged one is passed over for an older one; resilience.py ``for_checkpoint``; sizes from
        the files' sizes, no byte read), or, with none, for the initial weights it loads instead; a
        save also for the plan's estimate of one checkpoint (a fresh start has none to measure); the
        node's log says so when they grow."""
        def sizes() -> list[tuple[int, str]]:
            return [(checkpoint_bytes_on_disk(p), p.name) for it, p in list_checkpoints(self.paths.checkpoints_dir)
                    if checkpoint is None or it <= checkpoint]
        size, name = max(self.records.keep("reading the checkpoints' sizes", sizes, []), default=(0, ""))
        if not size and self.plan.initial_weights:  # a fresh start loads the initial weights instead
            size, name = self.records.keep("reading the initial weights' size", lambda: initial_weights_bytes(
                self.plan.initial_weights), (0, ""))
        estimate = self.plan.checkpoint_bytes
        limits = for_checkpoint(self.policy, size, estimate)
        if limits.hang_setup_s - self.policy.hang_setup_s >= 1:
            self.say(f"the watchdog allows for the {size / 1e9:.1f} GB checkpoint of {name}: setup "
                     f"{limits.hang_setup_s:.0f} s, a save {limits.hang_checkpoint_s:.0f} s")
        elif limits.hang_checkpoint_s - self.policy.hang_checkpoint_s >= 1:
            self.say(f"the watchdog allows a save {limits.hang_checkpoint_s:.0f} s for the model's checkpoint of about "
                     f"{estimate / 1e9:.1f} GB")
        return limits


def initial_weights_bytes(path: str) -> tuple[int, str]:
    """(bytes, name) of the initial weights at ``path``: the iteration folder a Megatron-LM ``--save``
    folder's tracker names (megatron_lm_checkpoints.py), else the folder itself (a Hugging Face
    directory); (0, "") where it is missing. Reads sizes, no byte."""
    folder = Path(path).expanduser()
    try:
        tracked = read_tracker(folder)
    except UserError:  # a tracker rewritten since the start checked it: the folder, as it is
        tracked = None
    if tracked is not None:
        folder = folder / tracked_dir_name(tracked)
    return (checkpoint_bytes_on_disk(folder), folder.name) if folder.is_dir() else (0, "")
