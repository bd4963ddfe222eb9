"""Reconciliation: each documented case gives its outcome, recorded as one ``reconcile`` event.

The session below takes a checkpoint whose host record says transcript seq 10, then does more
work (gateway calls with and without keys, a pause). A restore to that checkpoint meets each kind
of transcript a disk can hold. docs/ledger.md lists the outcomes asserted here.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_ledger_helpers import open_store, take_checkpoint

from ksfs.ledger import OUTCOMES, Ledger, TranscriptInfo, decide_reconcile
from ksfs.model import CheckpointRecord, Event, ForkPoint

HOST_SEQ = 10


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A session 'r' with checkpoint 'cp' (transcript seq 10) and work after it; a fork 'f'."""
    store = open_store(tmp_path_factory.mktemp("reconcile") / "store")
    led = Ledger(store)
    with store.env.begin(write=True) as txn:
        led.create_session(txn, "r")
    led.record("r", "gateway.call", {"key": "before", "model": "m", "tokens": 5, "cost": 0.0})
    cp = take_checkpoint(led, store, "r", {"disk.raw": b"d" * 4096}, name="cp",
                         transcript_seq=HOST_SEQ)
    led.record("r", "gateway.call", {"key": "k1", "model": "m", "tokens": 10, "cost": 0.01})
    led.record("r", "gateway.call", {"model": "m", "tokens": 3, "cost": 0.0})  # no key
    led.record("r", "pause", {})
    led.record("r", "gateway.call", {"key": "k2", "model": "m", "tokens": 7, "cost": 0.02})
    with store.env.begin(write=True) as txn:
        led.create_session(txn, "f", parent=ForkPoint("r", "cp", cp.seq))
    yield store, led, cp
    assert led.verify() == []
    store.close()


def _restore(led, cp, transcript, **kw):
    with led.env.begin(write=True) as txn:
        led.append(txn, "r", "restore.begin", {"checkpoint": cp.name})
        before = led.last_seq("r", txn)
        ev = led.reconcile(txn, "r", cp, transcript, **kw)
    assert ev.type == "reconcile" and ev.seq == before + 1
    assert led.event("r", ev.seq) == ev  # recorded, not just returned
    return ev.body


def _own(led):
    return led.session("r").lineage


def test_equal_is_consistent(world):
    store, led, cp = world
    body = _restore(led, cp, TranscriptInfo(HOST_SEQ, _own(led), 11))
    assert body["outcome"] == "consistent" and body["truth"] == "both"
    assert body["kind"] == "restore"
    assert body["transcript"] == {"outcome": "consistent", "host_seq": 10, "disk_seq": 10,
                                  "lineage": _own(led), "count": 11}
    # what the restore rolls back: every host event after the checkpoint (its own published
    # event excluded), and the gateway calls to replay
    after = [e for e in led.events("r", since=cp.seq + 1)
             if not (e.type == "checkpoint.published" and e.body.get("name") == "cp")]
    after = [e for e in after if e.seq < led.last_seq("r")]  # the reconcile itself is last
    rb = body["rolled_back"]
    assert (rb["from"], rb["to"], rb["count"]) == (after[0].seq, after[-1].seq, len(after))
    assert rb["by_type"]["gateway.call"] == 3 and rb["by_type"]["pause"] == 1
    assert body["replay"]["count"] >= 3
    assert body["replay"]["keys"][:2] == ["k1", "k2"]
    assert "before" not in body["replay"]["keys"]
    assert body["transcript_rolled_back"] is None


def test_behind_names_the_lost_entries(world):
    store, led, cp = world
    body = _restore(led, cp, TranscriptInfo(7, _own(led), 8))
    assert body["outcome"] == "behind" and body["truth"] == "host"
    assert body["transcript"]["missing"] == {"from": 8, "to": 10}


def test_empty_transcript_is_behind_from_zero(world):
    store, led, cp = world
    body = _restore(led, cp, TranscriptInfo(None, None, 0))
    assert body["outcome"] == "behind"
    assert body["transcript"]["missing"] == {"from": 0, "to": 10}


def test_ahead_is_accepted_and_its_range_recorded(world):
    store, led, cp = world
    body = _restore(led, cp, TranscriptInfo(13, _own(led), 14))
    assert body["outcome"] == "ahead" and body["truth"] == "both"
    assert body["transcript"]["unknown"] == {"from": 11, "to": 13}


def test_missing_transcript(world):
    store, led, cp = world
    body = _restore(led, cp, None)
    assert body["outcome"] == "missing" and body["truth"] == "host"
    assert body["transcript"] == {"outcome": "missing", "host_seq": 10}


def test_unreadable_transcript_keeps_the_reason(world):
    store, led, cp = world
    body = _restore(led, cp, None, error="transcript line 4 is not JSON")
    assert body["outcome"] == "unreadable" and body["truth"] == "host"
    assert body["transcript"]["error"] == "transcript line 4 is not JSON"


def test_transcript_of_another_lineage_is_foreign(world):
    store, led, cp = world
    body = _restore(led, cp, TranscriptInfo(HOST_SEQ, "ab" * 16, 11))
    assert body["outcome"] == "foreign" and body["truth"] == "host"
    assert body["transcript"]["lineage"] == "ab" * 16


def test_transcript_without_lineage_is_compared_by_seq(world):
    store, led, cp = world
    assert _restore(led, cp, TranscriptInfo(HOST_SEQ, None, 11))["outcome"] == "consistent"
    assert _restore(led, cp, TranscriptInfo(HOST_SEQ, "", 11))["outcome"] == "consistent"


def test_no_host_record_is_unrecorded(world):
    store, led, cp = world
    bare = CheckpointRecord(cp.session, cp.name, cp.seq, cp.created, cp.files, transcript_seq=None)
    body = _restore(led, bare, TranscriptInfo(4, _own(led), 5))
    assert body["outcome"] == "unrecorded" and body["truth"] == "both"
    assert body["transcript"]["disk_seq"] == 4


def test_a_checkpoint_of_an_empty_transcript_restores_consistent(world):
    """QA (ninth session): a checkpoint taken after the guest made its transcript but before
    its first line recorded no seq, and its restore was "unrecorded"; it records -1 (an empty
    transcript's seq) and is consistent with the same empty transcript, behind a longer one."""
    from ksfs.keeper.machine import _seen_seq

    store, led, cp = world
    empty = TranscriptInfo(None, None, 0)
    assert _seen_seq(empty) == -1 and _seen_seq(None) is None
    early = CheckpointRecord(cp.session, cp.name, cp.seq, cp.created, cp.files,
                             transcript_seq=_seen_seq(empty))
    body = _restore(led, early, empty)
    assert body["outcome"] == "consistent" and body["truth"] == "both"
    assert _restore(led, early, TranscriptInfo(2, _own(led), 3))["outcome"] == "ahead"


def test_current_transcript_rolled_back(world):
    store, led, cp = world
    body = _restore(led, cp, TranscriptInfo(HOST_SEQ, _own(led), 11), current_transcript_seq=25)
    assert body["current_transcript_seq"] == 25
    assert body["transcript_rolled_back"] == {"from": 11, "to": 25}
    # with no trustworthy disk transcript, the host's record is the base
    body = _restore(led, cp, None, current_transcript_seq=12)
    assert body["transcript_rolled_back"] == {"from": 11, "to": 12}


def test_events_before_the_freeze_are_kept_by_a_live_checkpoint(world):
    """A live snapshot runs the guest after checkpoint.begin: a model call that finished before
    the guest froze (seq <= frozen_seq) is in the checkpoint's machine state, so a restore
    neither rolls it back nor offers it for replay; later ones are rolled back as before."""
    store, led, cp = world
    k1 = next(e for e in led.events("r", since=cp.seq + 1) if e.body.get("key") == "k1")
    live = dataclasses.replace(cp, frozen_seq=k1.seq)
    body = _restore(led, live, TranscriptInfo(HOST_SEQ, _own(led), 11))
    assert "k1" not in body["replay"]["keys"] and "k2" in body["replay"]["keys"]
    assert body["rolled_back"]["from"] > k1.seq
    whole = _restore(led, cp, TranscriptInfo(HOST_SEQ, _own(led), 11))
    assert "k1" in whole["replay"]["keys"]


def test_fork_accepts_the_parent_lineage_and_rolls_nothing_of_its_own(world):
    store, led, cp = world
    parent_lineage = _own(led)
    with led.env.begin(write=True) as txn:
        ev = led.reconcile(txn, "f", cp, TranscriptInfo(HOST_SEQ, parent_lineage, 11))
    body = ev.body
    assert body["outcome"] == "consistent" and body["kind"] == "fork"
    assert body["checkpoint_lineage"] == parent_lineage
    assert ev.seq == led.last_seq("f")
    # the parent's work after the checkpoint is not in the fork's past: listed, by type
    assert body["rolled_back"]["by_type"]["gateway.call"] >= 3
    with led.env.begin(write=True) as txn:
        ev = led.reconcile(txn, "f", cp, TranscriptInfo(HOST_SEQ, led.session("f").lineage, 1))
    assert ev.body["outcome"] == "consistent"


def test_guestfs_style_transcript_is_accepted(world):
    """Any object with last_seq, lineage and lines (a list) counts too."""

    class Lines:
        last_seq = 9
        lineage = None
        lines = [{"seq": i} for i in range(10)]

    store, led, cp = world
    body = _restore(led, cp, Lines())
    assert body["outcome"] == "behind" and body["transcript"]["count"] == 10


def test_decide_is_pure_and_covers_every_outcome():
    cp = CheckpointRecord("s", "c", 5, 0.0, (), transcript_seq=3)
    after = [Event(6, 0.0, "gateway.call", {"key": f"k{i}"}) for i in range(300)]
    seen = set()
    cases = [
        ({"transcript": TranscriptInfo(3, "aa", 4)}, "consistent"),
        ({"transcript": TranscriptInfo(1, "aa", 2)}, "behind"),
        ({"transcript": TranscriptInfo(9, "aa", 10)}, "ahead"),
        ({"transcript": None}, "missing"),
        ({"transcript": None, "error": "boom"}, "unreadable"),
        ({"transcript": TranscriptInfo(3, "zz", 4)}, "foreign"),
    ]
    for kw, outcome in cases:
        body = decide_reconcile(cp, session_lineage="aa", ancestry=[], checkpoint_lineage="aa",
                                after=after, **kw)
        assert body["outcome"] == outcome
        assert body["replay"]["count"] == 300 and len(body["replay"]["keys"]) == 200
        assert body["replay"]["keys_truncated"] is True
        seen.add(outcome)
    bare = CheckpointRecord("s", "c", 5, 0.0, ())
    body = decide_reconcile(bare, TranscriptInfo(3, "aa", 4), session_lineage="aa", ancestry=[],
                            checkpoint_lineage="aa", after=[])
    assert body["outcome"] == "unrecorded" and body["rolled_back"] is None
    seen.add(body["outcome"])
    assert seen == set(OUTCOMES)


def test_fork_does_not_roll_back_the_fork_created_that_made_it(tmp_path):
    """QA: a fork's first reconcile listed the parent's ``fork.created`` of this very fork as
    rolled back; that event is the parent's record of the fork, not work the fork undoes. Other
    forks' ``fork.created`` are parent work the fork does not inherit: still listed."""
    store = open_store(tmp_path / "store")
    try:
        led = Ledger(store)
        with store.env.begin(write=True) as txn:
            led.create_session(txn, "p")
        cp = take_checkpoint(led, store, "p", {"disk.raw": b"p" * 4096}, name="cp",
                             transcript_seq=2)
        with store.env.begin(write=True) as txn:
            led.create_session(txn, "f1", parent=ForkPoint("p", "cp", cp.seq))
            body = led.reconcile(txn, "f1", cp, TranscriptInfo(2, None, 3)).body
        assert body["kind"] == "fork" and body["rolled_back"] is None
        with store.env.begin(write=True) as txn:
            led.create_session(txn, "f2", parent=ForkPoint("p", "cp", cp.seq))
            body = led.reconcile(txn, "f2", cp, TranscriptInfo(2, None, 3)).body
        assert body["rolled_back"]["by_type"] == {"fork.created": 1}  # f1's, not its own
        f1_created = [e for e in led.events("p") if e.type == "fork.created"][0]
        assert body["rolled_back"]["from"] == body["rolled_back"]["to"] == f1_created.seq
        assert led.verify() == []
    finally:
        store.close()


def test_reconcile_never_refuses_a_guest_written_transcript(tmp_path):
    """The transcript is the guest's writing: a lineage of any length or characters (or 200
    gateway keys of odd characters) must still give one ``reconcile`` event that fits the body
    limit, never BadInput that would fail the restore (it did for a 70 000-char lineage)."""
    store = open_store(tmp_path / "store")
    try:
        led = Ledger(store)
        with store.env.begin(write=True) as txn:
            led.create_session(txn, "g")
        cp = take_checkpoint(led, store, "g", {"disk.raw": b"g" * 4096}, name="cp",
                             transcript_seq=3)
        with store.env.begin(write=True) as txn:
            for i in range(250):
                led.append(txn, "g", "gateway.call", {"key": f"{i}" + "🙂\x00" * 200})
        for lineage in ("x" * 70000, "é\x00🙂" * 20000, "a\ud800" * 30000):
            with store.env.begin(write=True) as txn:
                ev = led.reconcile(txn, "g", cp, TranscriptInfo(3, lineage, 4))
            tx = ev.body["transcript"]
            assert ev.body["outcome"] == "foreign" and ev.body["truth"] == "host"
            assert tx["lineage"] == lineage[:128] and tx["lineage_truncated"] is True
            assert ev.body["replay"]["count"] == 250 and ev.body["replay"]["keys_truncated"]
            assert 0 < len(ev.body["replay"]["keys"]) <= 200
            assert ev.body["replay"]["keys"][0] == ("0" + "🙂\x00" * 200)[:128]
        own = led.session("g").lineage
        with store.env.begin(write=True) as txn:
            tx = led.reconcile(txn, "g", cp, TranscriptInfo(3, own, 4)).body["transcript"]
        assert tx["lineage"] == own and "lineage_truncated" not in tx
        assert led.verify() == []
    finally:
        store.close()
