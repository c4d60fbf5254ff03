"""Checkpoint checksums (megatron_ext/run_spec/checksums.py) and the program's choice of the newest
checkpoint that verifies (megatron_ext/training/checkpoint.py ``newest_verified``), in this process
on a one-rank gloo group: a byte overwritten, a file truncated or gone is named; a damaged
checkpoint is moved aside and ``latest`` points at the newest that verifies; none is one error
that says a restart would not help. The same through real runs: tests/test_resume.py (a damaged
latest checkpoint on the namespace cluster) and tests/test_resilience.py (a full disk)."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_ext.run_spec.checkpoints import LATEST, latest_iteration
from megatron_ext.run_spec.checksums import health, list_checkpoints, record_files, verify, writer_rank, written_by
from megatron_ext.run_spec.errors import FINAL, UserError
from orchestration.analysis.checkpoint_health import check_run_checkpoints, format_checkpoint_report
from orchestration.node.resume_point import ResumePoint
from megatron_ext.run_spec.run_paths import RunPaths


def _checkpoint(root, iteration: int, recorded: bool = True):
    folder = root / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (folder / ".metadata").write_bytes(b"m" * 100)
    (folder / "meta.json").write_text(json.dumps({"iteration": iteration, "world_size": 2}))
    if recorded:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        record_files(folder, files[0::2], "rank0")  # two writers, each a share
        record_files(folder, files[1::2], "rank1")
    (root / LATEST).write_text(folder.name)
    return folder


def _flip(path, at: int = 100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_changed_byte_a_truncated_file_and_a_missing_one_are_named(tmp_path):
    ckpt = _checkpoint(tmp_path, 10)
    assert verify(ckpt) == [] and health(ckpt, 10).state == "verified"
    assert verify(ckpt, share=(0, 2)) == [] and verify(ckpt, share=(1, 2)) == []
    _flip(ckpt / "__0_0.distcp")
    [damage] = verify(ckpt)
    assert damage.file == "__0_0.distcp" and damage.why.startswith("other bytes (CRC-32 ")
    assert verify(ckpt, sizes_only=True) == []  # the quick look sees only sizes
    (ckpt / ".metadata").write_bytes(b"m" * 10)
    assert "10 bytes where 100 were written (truncated)" in [d.why for d in verify(ckpt)]
    (ckpt / "meta.json").unlink()
    assert health(ckpt, 10).state == "damaged" and "meta.json: missing" in health(ckpt, 10).describe()
    old = _checkpoint(tmp_path, 5, recorded=False)
    assert health(old, 5).state == "unrecorded"


def test_each_rank_reads_back_the_files_it_wrote():
    """At a save and at a resume a rank reads the files its own node wrote (while in its page
    cache), not a share of every node's over the shared file system: the writer is in the name of
    torch.distributed.checkpoint's and megatron-core's data files and of this project's rank files;
    rank 0 wrote the rest. At another world size each rank takes its share of the writers."""
    names = ["__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "__3_0.distcp", ".metadata", "common.pt", "metadata.json",
             "meta.json", "rank0.pt", "rank1.pt", "rank3.pt", "rank12.pt", "model/__2_0.distcp"]
    assert [writer_rank(n) for n in names] == [0, 1, 1, 3, 0, 0, 0, 0, 0, 1, 3, 12, 2]
    assert written_by(names, 1, 4) == ["__1_0.distcp", "__1_1.distcp", "rank1.pt"]
    assert written_by(names, 0, 4) == ["__0_0.distcp", ".metadata", "common.pt", "metadata.json", "meta.json", "rank0.pt",
                                       "rank12.pt"]
    everyone = [n for rank in range(2) for n in written_by(names, rank, 2)]
    assert sorted(everyone) == sorted(names)  # at 2 ranks every file has one reader


def test_the_report_names_the_checkpoint_a_start_resumes_from(tmp_path):
    paths = RunPaths(tmp_path, "r")
    root = paths.checkpoints_dir
    _checkpoint(root, 5)
    _flip(_checkpoint(root, 10) / "__0_0.distcp")
    text = format_checkpoint_report(check_run_checkpoints(paths))
    assert "damaged" in text and "__0_0.distcp: other bytes" in text and "a start resumes from iteration 5 (verified)" in text


def test_status_line_on_the_checkpoints_reads_sizes_only(tmp_path):
    from orchestration.analysis.checkpoint_health import format_checkpoint_line, moved_aside

    paths = RunPaths(tmp_path, "r")
    root = paths.checkpoints_dir
    assert format_checkpoint_line(check_run_checkpoints(paths, sizes_only=True), moved_aside(paths)) is None
    _checkpoint(root, 5)
    _flip(_checkpoint(root, 10) / "__0_0.distcp")  # other bytes, same size: only a full check sees it
    (_checkpoint(root, 15) / ".metadata").write_bytes(b"m")
    (root / "iter_0000020.damaged").mkdir()
    line = format_checkpoint_line(check_run_checkpoints(paths, sizes_only=True), moved_aside(paths))
    assert line == ("checkpoints: 5 sizes ok, 10 sizes ok, 15 damaged (.metadata: 1 bytes where 100 were written "
                    "(truncated)); moved aside as damaged: 20 (check_checkpoints.sh r reads every byte)"), line


@pytest.fixture()
def group():
    from megatron_ext.training.model import ensure_model_parallel

    ensure_model_parallel()  # a one-rank gloo group in this process


def test_the_newest_checkpoint_that_verifies_is_loaded_and_the_damaged_moved_aside(tmp_path, group):
    """Rank 0's choice (``latest`` and the complete ones before it, newest first), then the ranks'
    check of it: each reads its writers' records by name (``checksums/rank<w>.json`` of the
    checkpoint's 2 writers, here both for the one rank)."""
    from megatron_ext.training.checkpoint import ResumeCandidate, choose_resume, newest_verified

    _checkpoint(tmp_path, 5)
    _checkpoint(tmp_path, 10)
    _flip(_checkpoint(tmp_path, 15) / "__0_0.distcp")
    (tmp_path / "iter_0000020").mkdir()  # a save that did not finish: no meta.json
    choice = choose_resume(tmp_path)
    assert choice.candidates == tuple(ResumeCandidate(it, 2, True) for it in (15, 10, 5)) and choice.notes == ()
    assert newest_verified(tmp_path, choice)[0] == 10
    assert latest_iteration(tmp_path) == 10
    assert [it for it, _ in list_checkpoints(tmp_path)] == [5, 10, 20]
    assert (tmp_path / "iter_0000015.damaged" / "__0_0.distcp").is_file()  # kept for a look
    assert newest_verified(tmp_path, choose_resume(tmp_path)) == (10, [])
    (tmp_path / "iter_0000010" / "checksums" / "rank1.json").unlink()  # a writer's record gone: damage, not "unrecorded"
    assert newest_verified(tmp_path, choose_resume(tmp_path))[0] == 5


def test_a_name_moved_aside_is_waited_for_until_this_view_drops_it(tmp_path):
    """A folder another machine moved aside shows here until this client's cache lets it go (sshfs
    showed node 1 the old folder for 6 s in tests/test_multinode.py): the wait ends when it is gone,
    or after its bound, naming those still shown."""
    import threading

    from megatron_ext.run_spec.shared_fs import wait_until_gone

    going, staying = tmp_path / "iter_0000004", tmp_path / "iter_0000006"
    going.mkdir()
    staying.mkdir()
    threading.Timer(0.3, going.rename, [tmp_path / "iter_0000004.damaged"]).start()
    waited, showing = wait_until_gone([going], 30, poll_s=0.05)
    assert 0.2 <= waited < 30 and showing == []
    waited, showing = wait_until_gone([going, staying], 0.2, poll_s=0.05)
    assert waited >= 0.2 and showing == [staying]


def test_latest_naming_a_folder_this_node_does_not_see_falls_back_or_refuses(tmp_path, group):
    """``latest`` written, its folder not shown (a shared file system's stale view, or gone): rank 0
    waits a bounded time, then takes the older complete checkpoints, saying so; with none, one
    error naming the folder and the shared file system."""
    from megatron_ext.training.checkpoint import choose_resume

    _checkpoint(tmp_path, 5)
    (tmp_path / LATEST).write_text("iter_0000010")
    choice = choose_resume(tmp_path, visible_s=0.2)
    assert [c.iteration for c in choice.candidates] == [5]
    assert "iter_0000010/meta.json (the checkpoint" in choice.notes[0] and "shared file system" in choice.notes[0]
    shutil.rmtree(tmp_path / "iter_0000005")
    with pytest.raises(UserError, match="no older complete checkpoint is there to resume from"):
        choose_resume(tmp_path, visible_s=0.2)


def test_no_checkpoint_that_verifies_is_one_error_that_ends_the_run(tmp_path, group):
    from megatron_ext.training.checkpoint import choose_resume, newest_verified

    _flip(_checkpoint(tmp_path, 5) / "__0_0.distcp")
    (_checkpoint(tmp_path, 10) / ".metadata").unlink()
    with pytest.raises(UserError) as err:
        newest_verified(tmp_path, choose_resume(tmp_path))
    text = str(err.value)
    assert text.startswith(f"no checkpoint of this run verifies ({FINAL}): iteration 10: .metadata: missing; "
                           "iteration 5: __0_0.distcp: other bytes") and "check_checkpoints.sh" in text
    assert latest_iteration(tmp_path) == 10  # nothing moved when nothing can be loaded


def _megatron_lm_checkpoint(save_dir, iteration: int, manifest: bool = True):
    """A Megatron-LM torch_dist folder as its --verify-integrity save leaves it (integrity.json,
    then the tracker), written by the Megatron-LM export's own writer of the manifest."""
    from megatron_ext.run_spec.checkpoints import MEGATRON_LM_LATEST
    from megatron_ext.run_spec.checksums import write_integrity_manifest

    folder = save_dir / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (folder / ".metadata").write_bytes(b"m" * 100)
    (folder / "common.pt").write_bytes(b"c" * 50)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    if manifest:
        write_integrity_manifest(folder)
    (save_dir / MEGATRON_LM_LATEST).write_text(str(iteration))
    return folder


def test_megatron_lm_s_integrity_manifest_is_read_as_a_record(tmp_path):
    """integrity.json as megatron-core 0.19's save_integrity_manifest writes it ({"algorithm":
    "sha256", "files": {name: digest}}; tests/test_megatron_lm_loop.py reads one Megatron-LM wrote)."""
    ckpt = _megatron_lm_checkpoint(tmp_path, 3)
    manifest = json.loads((ckpt / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert health(ckpt, 3).state == "verified"
    _flip(ckpt / "__0_0.distcp")
    [damage] = verify(ckpt)
    assert damage.file == "__0_0.distcp" and damage.why.startswith("other bytes (SHA-256 ")
    assert verify(ckpt, sizes_only=True) == []  # no sizes recorded: the quick look sees a missing file only
    (ckpt / "common.pt").unlink()
    assert "common.pt: missing" in [d.describe() for d in verify(ckpt, sizes_only=True)]
    (ckpt / "integrity.json").write_text("{not json")
    assert health(ckpt, 3).describe() == "iteration 3: damaged (integrity.json: its checksum record does not read)"
    assert health(_megatron_lm_checkpoint(tmp_path, 6, manifest=False), 6).state == "unrecorded"


def test_node_0_picks_megatron_lm_s_newest_checkpoint_that_verifies(tmp_path):
    """orchestration/node/resume_point.py: the tracker's checkpoint damaged, the one before is
    taken (the damaged one moved aside, the tracker pointed back); a folder newer than the tracker
    (a save that did not finish) is not looked at; none that verifies refuses; no checkpoint of the
    run's own verifies what the init checkpoint carries."""
    from megatron_ext.run_spec.checkpoints import MEGATRON_LM_LATEST
    from megatron_ext.run_spec.checksums import write_integrity_manifest
    from orchestration.node.resume_point import choose, take

    save = tmp_path / "checkpoints"
    assert choose(save) == ((ResumePoint(None, True)), ())  # a fresh start: each save writes a manifest
    init = tmp_path / "init"
    _megatron_lm_checkpoint(init, 1, manifest=False)
    assert choose(save, str(init))[0] == ResumePoint(None, False)  # Megatron-LM would refuse it with the flag
    _megatron_lm_checkpoint(save, 3)
    _megatron_lm_checkpoint(save, 6, manifest=False)  # a run begun on a release without the flag
    _flip(_megatron_lm_checkpoint(save, 9) / "__0_0.distcp")
    _megatron_lm_checkpoint(save, 12)
    (save / MEGATRON_LM_LATEST).write_text("9")  # 12's save did not finish
    told: list[tuple[int, int, int]] = []
    point, damaged = choose(save, progress=lambda *seen: told.append(seen))
    assert (point.iteration, point.verify, [h.iteration for h in damaged]) == (6, False, [9])
    assert point.moved_aside == ("iter_0000009",)  # what every node waits to see gone before the attempt
    # how far the pass has read, per checkpoint (what a start waiting on node 0 names): 9 read through, 6 unrecorded
    sizes = sum(p.stat().st_size for p in (save / "iter_0000009").iterdir())
    assert {it for it, _, _ in told} == {9} and told[-1][1] == sum(
        p.stat().st_size for p in (save / "iter_0000009").iterdir() if p.name != "integrity.json") and told[-1][2] == sizes
    assert [done for _, done, _ in told] == sorted(done for _, done, _ in told)
    # the supervisor's view of the same pass: the step under way each chunk, the log once, the summary
    from orchestration.node.resume_point import PassProgress

    doing, said = [], []
    tracked = PassProgress(tell=doing.append, say=said.append, say_every_s=3600.0)
    assert tracked.summary() is None
    for seen in told:
        tracked(*seen)
    assert doing[-1] == f"verifying the checkpoint of iteration 9 before choosing it: 0.0 of {sizes / 1e9:.1f} GB read"
    assert said == doing[:1] and len(doing) == len(told)
    assert tracked.summary().startswith("read 0.0 GB of 1 checkpoint(s) through in ")
    # a stop during the pass ends it at the next chunk (a share is minutes at a user's size; the stop's grace 40 s)
    from orchestration.node.resume_point import PassStopped

    stop = []
    with pytest.raises(PassStopped, match="stopped on request"):
        choose(save, progress=PassProgress(tell=lambda _: stop.append(1), say=said.append, say_every_s=3600.0,
                                           stopped=lambda: bool(stop)))
    assert len(stop) == 1 and (save / "iter_0000009").is_dir()  # one chunk read, nothing moved
    assert point.describe().startswith("the checkpoint of iteration 9 is damaged (__0_0.distcp: other bytes (SHA-256 ")
    assert point.describe().endswith("moved aside as iter_0000009.damaged; Megatron-LM loads the checkpoint of "
                                     "iteration 6 (without --verify-integrity)")
    take(point, damaged, save)
    assert latest_iteration(save) == 6 and (save / "iter_0000009.damaged").is_dir() and not (save / "iter_0000009").exists()
    write_integrity_manifest(save / "iter_0000006")  # (without, it is taken as it is: "unrecorded")
    (save / "iter_0000006" / ".metadata").unlink()
    (save / "iter_0000003" / "common.pt").write_bytes(b"x")
    refused = choose(save)[0]
    assert refused.refused.startswith("no checkpoint of this run verifies (iteration 6: damaged (.metadata: missing)")
    assert "check_checkpoints.sh" in refused.refused and refused.iteration is None


def test_the_nodes_share_node_0_s_pass_each_reading_its_writers_files(tmp_path):
    """resume_point.py's shared pass (issue 54): node 0 asks for a checkpoint on the board, each node
    reads the files of its share of the writers (2 nodes: writers 0, 2 and rank 0's files on node 0,
    writers 1, 3 on node 1; about half the bytes each), the answers go through the board as the
    supervisors send them, and node 0 judges the checkpoint from all of them: damage in node 1's
    share is found by node 1 alone; a node that does not see the records answers nothing found
    (node 0 then reads that share itself)."""
    from megatron_ext.run_spec.checksums import write_integrity_manifest
    from orchestration.node.board import Board, MemoryStore
    from orchestration.node.resume_point import ShareAsk, check_share, choose, merged

    save = tmp_path / "checkpoints"
    folder = _megatron_lm_checkpoint(save, 8)
    for writer in (1, 2, 3):
        (folder / f"__{writer}_0.distcp").write_bytes(bytes([writer]) * 4096)
    write_integrity_manifest(folder)
    ask = ShareAsk(8, folder.name, (0, 1))
    board = Board(MemoryStore(), 0)
    board.ask_share(3, ask)
    assert board.share_asked(3) == ask and board.share_asked(4) is None
    told: dict[int, list] = {0: [], 1: []}
    checks = [check_share(save, board.share_asked(3), node, lambda *seen, node=node: told[node].append(seen))
              for node in ask.nodes]
    for check in checks:
        board.write_share(3, 8, check)
    assert [board.read_share(3, 8, node) for node in (0, 1)] == checks and board.read_share(3, 9, 0) is None
    size = lambda *names: sum((folder / n).stat().st_size for n in names)  # noqa: E731
    assert [c.read_bytes for c in checks] == [size("__0_0.distcp", "__2_0.distcp", ".metadata", "common.pt", "metadata.json"),
                                              size("__1_0.distcp", "__3_0.distcp")]
    assert told[1][-1] == (8, checks[1].read_bytes, checks[1].read_bytes)
    assert merged(8, folder, checks).state == "verified"
    _flip(folder / "__3_0.distcp")
    checks = [check_share(save, ask, node) for node in ask.nodes]
    assert checks[0].damage == () and [d.file for d in checks[1].damage] == ["__3_0.distcp"]
    assert merged(8, folder, checks).describe().startswith("iteration 8: damaged (__3_0.distcp: other bytes (SHA-256 ")
    assert check_share(save, ShareAsk(8, "iter_0000099", (0, 1)), 1).damage is None  # not seen there: node 0 reads it
    # choose() with the shared check: the damaged one passed over, as with node 0's own pass
    _megatron_lm_checkpoint(save, 4)
    (save / "latest_checkpointed_iteration.txt").write_text("8")
    asked = []

    def together(iteration, path):
        asked.append(iteration)
        return merged(iteration, path, [check_share(save, ShareAsk(iteration, path.name, (0, 1)), n) for n in (0, 1)])
    point, damaged = choose(save, check=together)
    assert (point.iteration, [h.iteration for h in damaged], asked) == (4, [8], [8, 4])


def test_an_attempt_names_node_0_s_choice():
    from orchestration.node.wire import CheckpointChoice, NodePlan, torchrun_argv

    rendezvous = dict(nnodes=2, nproc_per_node=1, master_addr="n0", master_port=6000)
    plan = NodePlan(run="r", run_id="r-1", node_rank=1, host="n1", **rendezvous,
                    argv=torchrun_argv("python", ("pretrain_gpt.py",), node_rank=1, **rendezvous), env={}, unset=(),
                    cwd=".", log_path="log", pid_path="pid", resume_args=("--load", "/c"),
                    checkpoint_choice=CheckpointChoice(integrity_args=("--verify-integrity",)))
    assert plan.attempt_argv(True, None, ResumePoint(6, False))[-4:] == ("--load", "/c", "--ckpt-step", "6")
    assert plan.attempt_argv(False, None, ResumePoint(None, True))[-2:] == ("pretrain_gpt.py", "--verify-integrity")
    assert NodePlan.from_json(plan.to_json()) == plan
