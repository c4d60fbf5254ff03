"""A hang named down to the collective (orchestration/node/flight_recorder.py): a real gloo record
through torch's own analyser, with and without the other rank's record, and without records."""

from __future__ import annotations

import json

from conftest import TEST_DATA
from orchestration.node.flight_recorder import StuckCollective, stand_in_record, stuck_collective

RECORD = json.loads((TEST_DATA / "flight_recorder" / "gloo_rank0_of_2_rank1_stopped.json").read_text())


def test_a_stopped_rank_without_a_record_is_named_from_its_peers_record():
    found = stuck_collective({0: RECORD}, (1,))
    assert found == StuckCollective(name="gloo:all_reduce", seq=45, group="0 (default_pg)", entered=(0,), missing=(1,),
                                    without_record=(1,)), found
    assert found.describe() == (
        "collective gloo:all_reduce #45 of process group 0 (default_pg): entered by rank(s) 0, not by rank(s) 1 (no "
        "record from rank(s) 1: it completed every earlier one, its peers' records say)")


def test_a_rank_that_wrote_its_record_but_never_entered_is_named_by_the_analyser():
    """Rank 1's record: what it completed (rank 0's, up to #44 of the default group), nothing after
    (as a rank stuck in Python before the collective would write)."""
    behind = dict(RECORD, entries=[dict(e, retired=True) for e in RECORD["entries"]
                                   if not (e["process_group"][0] == "0" and e["collective_seq_id"] >= 45)])
    found = stuck_collective({0: RECORD, 1: behind})
    assert (found.name, found.seq, found.entered, found.missing, found.without_record) == (
        "gloo:all_reduce", 45, (0,), (1,), ()), found
    assert "no record" not in found.describe()


def test_the_stand_in_record_holds_what_every_peer_completed_in_its_groups():
    stand_in = stand_in_record({0: RECORD}, 1)
    assert stand_in["entries"] and all(e["retired"] for e in stand_in["entries"])
    assert {e["process_group"][0] for e in stand_in["entries"]} <= {"0", "1", "2", "15", "16", "27", "28"}
    assert max(e["collective_seq_id"] for e in stand_in["entries"] if e["process_group"][0] == "0") == 44
    assert set(stand_in["pg_config"]) == {n for n, g in RECORD["pg_config"].items() if "1" in g["ranks"]}


def test_without_records_the_hang_keeps_its_naming_and_says_why():
    empty = dict(RECORD, entries=[])  # TORCH_FR_BUFFER_SIZE=0
    for records in ({0: empty}, {0: {"error": "RuntimeError: no recorder"}}, {}):
        said = stuck_collective(records, (1,))
        assert isinstance(said, str) and said.startswith("no flight-recorder records"), said


def test_a_running_rank_without_a_record_is_not_stood_in_for():
    """Running, but no record read (late on a shared file system, or blocked holding the GIL): no
    stand-in that would say it never entered; torch's analyser, missing its record, decides nothing."""
    said = stuck_collective({0: RECORD})
    assert isinstance(said, str), said
