"""Reconciliation: what a restore (or fork) to a checkpoint means for the two ledgers.

The host event log and the in-guest transcript both carry seqs. Before the guest runs again,
``decide_reconcile`` (a pure function) compares the transcript found in the checkpoint's disk
with the host's record at the checkpoint and lists what the restore rolls back and what replays;
``record_reconcile`` appends that as one ``reconcile`` event. The outcomes are documented in
docs/ledger.md. This module must never read a disk (the vm layer brings a TranscriptInfo) and
never refuse a restore: the host log is the truth whenever the transcript cannot be trusted.
``TranscriptInfo`` (last_seq, lineage, count) lives in ksfs.model, shared with ksfs.guestfs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import lmdb

from ksfs.ledger import keys as K
from ksfs.ledger.records import BODY_MAX
from ksfs.model import CheckpointRecord, Event, TranscriptInfo  # noqa: F401 (re-exported)

OUTCOMES = ("consistent", "behind", "ahead", "missing", "unreadable", "foreign", "unrecorded")
KEYS_MAX = 200  # gateway keys listed in one reconcile body; the count is always exact
KEY_CHARS = 128  # of each key, and of a transcript's lineage, recorded
BODY_ROOM = 4096  # bytes of a reconcile body left for what record_reconcile adds


def transcript_fields(t: Any) -> tuple[int | None, str | None, int]:
    """(last_seq, lineage, count) of a TranscriptInfo or any look-alike (``lines`` for count)."""
    count = getattr(t, "count", None)
    if count is None:
        lines = getattr(t, "lines", 0)
        count = lines if isinstance(lines, int) else len(lines)
    return t.last_seq, (t.lineage or None), int(count)


def decide_reconcile(
    checkpoint: CheckpointRecord,
    transcript: Any,
    error: str | None = None,
    *,
    session_lineage: str,
    ancestry: Iterable[str],
    checkpoint_lineage: str | None,
    after: Iterable[Event],
    current_transcript_seq: int | None = None,
    shared_transcript_seq: int | None = None,
) -> dict[str, Any]:
    """The body of the ``reconcile`` event. Pure: everything it needs is an argument.

    ``ancestry``: the lineage ids of the session's fork chain; ``after``: the host events of the
    checkpoint's lineage with seq > checkpoint.seq; ``current_transcript_seq``: the transcript's
    last seq read from the disk right before the restore, if it was read;
    ``shared_transcript_seq``: the last seq of the lines the current disk's transcript and the
    checkpoint's have in common (where the two timelines split; -1: none), if it was measured.
    """
    host = checkpoint.transcript_seq
    tx: dict[str, Any] = {"host_seq": host}
    disk: int | None = None
    if error is not None:
        tx.update(outcome="unreadable", error=str(error)[:1000])
    elif transcript is None:
        tx.update(outcome="missing")
    else:
        disk, lineage, count = transcript_fields(transcript)
        # The guest wrote the lineage: it is compared whole but recorded cut, so the event
        # always fits the body limit (a reconcile must never fail the restore).
        shown = lineage[:KEY_CHARS] if isinstance(lineage, str) else lineage
        tx.update(disk_seq=disk, lineage=shown, count=count)
        if shown != lineage:
            tx.update(lineage_truncated=True)
        known = {session_lineage, *ancestry, checkpoint_lineage} - {None}
        if lineage and lineage not in known:
            tx.update(outcome="foreign")
        elif host is None:
            tx.update(outcome="unrecorded")
        else:
            d = -1 if disk is None else disk
            if d == host:
                tx.update(outcome="consistent")
            elif d < host:
                tx.update(outcome="behind", missing={"from": d + 1, "to": host})
            else:
                tx.update(outcome="ahead", unknown={"from": host + 1, "to": d})
    # Which transcript seqs the guest loses: those past where the current timeline and the
    # checkpoint's split, up to the current disk. Measured when the keeper compared the two
    # transcripts; else taken as past the checkpoint's seq, which is right only when the
    # checkpoint is on the current timeline: a restore "forward", to a later checkpoint of a
    # timeline an earlier restore left, loses the lines written since that restore although
    # their seqs are below the checkpoint's (QA: said nothing was lost).
    base = disk if tx["outcome"] not in ("missing", "unreadable", "foreign") else host
    if shared_transcript_seq is not None:
        base = shared_transcript_seq
    tx_back = None
    if current_transcript_seq is not None:
        b = -1 if base is None else base
        if current_transcript_seq > b:
            tx_back = {"from": b + 1, "to": current_transcript_seq}
    # The checkpoint's own ``checkpoint.published`` describes it, and the parent's
    # ``fork.created`` of this session records the fork itself: neither is rolled back.
    # Nor is an ``fs.unreadable`` about the checkpoint (its save could not read its
    # transcript): news of the checkpoint, not of the machine.
    after = [
        e for e in after
        if not (e.type == "checkpoint.published" and e.body.get("name") == checkpoint.name)
        and not (e.type == "fork.created" and e.body.get("lineage") == session_lineage)
        and not (e.type == "fs.unreadable" and e.body.get("checkpoint") == checkpoint.name)
    ]
    calls = [e for e in after if e.type == "gateway.call"]
    keys = [str(e.body["key"])[:KEY_CHARS] for e in calls if e.body.get("key") is not None]
    restore = checkpoint_lineage == session_lineage
    body = {
        "outcome": tx["outcome"],
        "kind": "restore" if restore else "fork",
        "checkpoint": checkpoint.name,
        "checkpoint_session": checkpoint.session,
        "checkpoint_seq": checkpoint.seq,
        "checkpoint_lineage": checkpoint_lineage,
        "transcript": tx,
        "truth": "both" if tx["outcome"] in ("consistent", "ahead", "unrecorded") else "host",
        "rolled_back": _range_summary(after),
        "replay": {"count": len(calls), "keys": keys[:KEYS_MAX],
                   "keys_truncated": len(keys) > KEYS_MAX},
        "current_transcript_seq": current_transcript_seq,
        "transcript_rolled_back": tx_back,
    }
    if shared_transcript_seq is not None:
        body["transcript_shared_seq"] = shared_transcript_seq
    # Keys of odd characters escape to up to 12 bytes each: fewer of them, rather than an
    # event over the limit (room is left for the session's name, added by record_reconcile).
    replay = body["replay"]
    while replay["keys"] and len(K.dumps(body)) > BODY_MAX - BODY_ROOM:
        replay.update(keys=replay["keys"][: len(replay["keys"]) // 2], keys_truncated=True)
    return body


def _range_summary(events: list[Event]) -> dict[str, Any] | None:
    if not events:
        return None
    return {
        "from": events[0].seq,
        "to": events[-1].seq,
        "count": len(events),
        "by_type": dict(sorted(Counter(e.type for e in events).items())),
    }


def record_reconcile(
    ledger: Any,
    txn: lmdb.Transaction,
    session: str,
    checkpoint: CheckpointRecord,
    transcript: Any,
    error: str | None = None,
    current_transcript_seq: int | None = None,
    shared_transcript_seq: int | None = None,
) -> Event:
    """Append the ``reconcile`` event of restoring/forking ``session`` to ``checkpoint``.

    The checkpoint's lineage is the session's own when it belongs to the session (a restore),
    else the ancestor's lineage on the session's fork chain that holds it (a fork).
    """
    rec = ledger._live(txn, session)
    chain = ledger._chain(txn, rec.lineage, rec.parent)
    cp_lineage: str | None = None
    if checkpoint.session == session:
        cp_lineage = rec.lineage
    else:
        for hop in chain:
            if hop.session == checkpoint.session and hop.lineage:
                cp_lineage = hop.lineage
                break
    boundary = checkpoint.seq if checkpoint.frozen_seq is None else checkpoint.frozen_seq
    after = [] if cp_lineage is None else list(
        ledger.events_in(txn, cp_lineage, boundary + 1)
    )
    body = decide_reconcile(
        checkpoint,
        transcript,
        error,
        session_lineage=rec.lineage,
        ancestry=[hop.lineage for hop in chain if hop.lineage],
        checkpoint_lineage=cp_lineage,
        after=after,
        current_transcript_seq=current_transcript_seq,
        shared_transcript_seq=shared_transcript_seq,
    )
    body["session"] = session
    return ledger._append(txn, rec.lineage, "reconcile", body)
