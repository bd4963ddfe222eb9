"""The ledger's consistency check: every lineage rebuilt from its own records, every rule tested.

``verify_ledger`` reads everything in one read transaction and returns one sentence per problem
(an empty list when clean). It must never write, never stop at the first problem, and never
trust one record to check another when it can check against the raw keys instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lmdb

from ksfs.errors import IntegrityError
from ksfs.ledger import keys as K
from ksfs.ledger.ledger import Ledger
from ksfs.ledger.records import (
    CHECKPOINT_EVENTS,
    LineageInfo,
    decode_checkpoint,
    decode_event,
    decode_lineage,
    decode_session,
)
from ksfs.model import EVENT_TYPES

FIRST_EVENTS = ("session.created", "session.adopted", "lineage.forked")


def verify_ledger(ledger: Ledger, store: Any) -> list[str]:
    problems: list[str] = []
    with ledger._read(None) as txn:
        has_manifest = _manifest_check(ledger, store, txn)
        raw_format = txn.get(K.FORMAT_KEY, db=ledger._meta)
        if raw_format is None:
            problems.append("ledger format marker is missing")
        else:
            try:
                known = K.loads(raw_format) == K.FORMAT
            except IntegrityError:
                known = False
            if not known:
                problems.append(f"ledger format marker is unknown: {bytes(raw_format)[:80]!r}")
        lineages = _lineages(ledger, txn, problems)
        _check_sessions(ledger, txn, lineages, problems)
        last = _check_events(ledger, txn, lineages, problems)
        _check_chains(ledger, txn, lineages, last, problems)
        _check_checkpoints(ledger, txn, lineages, has_manifest, problems)
    return problems


def _reason(exc: IntegrityError) -> str:
    """What is wrong with a record, without the record's name the message leads with."""
    return str(exc.fields.get("reason", exc))


def _manifest_check(ledger: Ledger, store: Any, txn: lmdb.Transaction) -> Callable[[str], bool]:
    seen: dict[str, bool] = {}
    store_has = getattr(store, "has_manifest", None)

    def check(manifest: str) -> bool:
        if manifest not in seen:
            if callable(store_has):
                try:
                    seen[manifest] = bool(store_has(manifest))
                except ValueError:  # not hex: no store can hold it
                    seen[manifest] = False
            else:
                seen[manifest] = ledger.has_manifest(txn, manifest)
        return seen[manifest]

    return check


def _lineages(ledger: Ledger, txn: lmdb.Transaction, problems: list[str]) -> dict[str, LineageInfo]:
    out: dict[str, LineageInfo] = {}
    for lin, v in ledger._lineage_values(txn):
        if len(lin) != K.LINEAGE_BYTES:
            problems.append(f"lineage record key {K.LINEAGE_PREFIX + lin!r} is malformed")
            continue
        try:
            out[lin.hex()] = decode_lineage(lin.hex(), v)
        except IntegrityError as exc:
            problems.append(f"lineage record {lin.hex()} does not decode: {_reason(exc)}")
    return out


def _check_sessions(
    ledger: Ledger, txn: lmdb.Transaction, lineages: dict[str, LineageInfo], problems: list[str]
) -> None:
    owners: dict[str, str] = {}
    for k, v in txn.cursor(db=ledger._sessions):
        name = bytes(k).decode("utf-8", "replace")
        try:
            rec = decode_session(name, v)
        except IntegrityError as exc:
            problems.append(f"session {name!r}: record does not decode: {_reason(exc)}")
            continue
        owners[rec.lineage] = name
        info = lineages.get(rec.lineage)
        if rec.name != name:
            problems.append(f"session {name!r}: record is named {rec.name!r}")
        if info is None:
            problems.append(f"session {name!r}: lineage {rec.lineage} has no lineage record")
            continue
        if info.session != name:
            problems.append(f"session {name!r}: lineage {rec.lineage} belongs to {info.session!r}")
        if (rec.removed is None) != (info.removed is None) or (rec.removed and not info.kept):
            problems.append(f"session {name!r}: removed state differs from its lineage record")
        if rec.parent != info.parent:
            problems.append(f"session {name!r}: fork point differs from its lineage record")
    for lin, info in lineages.items():
        if (info.removed is None or info.kept) and owners.get(lin) != info.session:
            problems.append(f"lineage {lin} of session {info.session!r} has no session record")


def _check_events(
    ledger: Ledger, txn: lmdb.Transaction, lineages: dict[str, LineageInfo], problems: list[str]
) -> dict[str, int]:
    """Gapless seqs from 0, every event decodes, event 0 is a first event; -> last seq each."""
    last: dict[str, int] = {}
    for k, v in txn.cursor(db=ledger._events):
        try:
            lin_b, seq = K.split_event_key(bytes(k))
        except ValueError:
            problems.append(f"event key {bytes(k).hex()} is malformed")
            continue
        lin = lin_b.hex()
        expected = last.get(lin, -1) + 1
        if lin not in last:
            info = lineages.get(lin)
            if info is None:
                problems.append(f"events of lineage {lin} belong to no lineage record")
            elif info.removed is not None and not info.kept:
                problems.append(f"events of removed lineage {lin} ({info.session!r}) remain")
        if seq != expected:
            problems.append(f"lineage {lin}: seq {expected} is missing (next is {seq})")
        last[lin] = seq
        try:
            ev = decode_event(seq, v)
        except IntegrityError as exc:
            problems.append(f"lineage {lin}: {exc}")
            continue
        if ev.type not in EVENT_TYPES:
            problems.append(f"lineage {lin}: event {seq} has unknown type {ev.type!r}")
        if seq == 0:
            _check_first(lin, ev.type, ev.body, lineages.get(lin), problems)
    for lin, info in lineages.items():
        if (info.removed is None or info.kept) and lin not in last:
            problems.append(f"lineage {lin} of session {info.session!r} has no events")
    return last


def _check_first(lin: str, type_: str, body: dict[str, Any], info: LineageInfo | None,
                 problems: list[str]) -> None:
    if type_ not in FIRST_EVENTS:
        problems.append(f"lineage {lin}: event 0 is {type_!r}, not a session's first event")
        return
    if info is None:
        return
    fp = info.parent
    if (type_ == "lineage.forked") != (fp is not None):
        problems.append(f"lineage {lin}: event 0 {type_!r} disagrees with its fork point")
        return
    if fp is not None and (
        body.get("parent_session"), body.get("checkpoint"), body.get("parent_seq"),
        body.get("parent_lineage"),
    ) != (fp.session, fp.checkpoint, fp.seq, fp.lineage):
        problems.append(f"lineage {lin}: event 0 names another branch point than its record")


def _check_chains(ledger: Ledger, txn: lmdb.Transaction, lineages: dict[str, LineageInfo],
                  last: dict[str, int], problems: list[str]) -> None:
    for lin, info in lineages.items():
        fp = info.parent
        if fp is None:
            continue
        parent = lineages.get(fp.lineage)
        if parent is None:
            problems.append(
                f"lineage {lin} ({info.session!r}): parent lineage {fp.lineage or '?'} of "
                f"{fp.session!r} has no record"
            )
            continue
        if parent.removed is None and fp.seq > last.get(fp.lineage, -1):
            problems.append(f"lineage {lin}: branch seq {fp.seq} is past its parent's log")
        try:
            ledger._chain(txn, lin, fp)
        except IntegrityError as exc:
            problems.append(f"lineage {lin} ({info.session!r}): {exc}")


def _check_checkpoints(ledger: Ledger, txn: lmdb.Transaction, lineages: dict[str, LineageInfo],
                       has_manifest: Callable[[str], bool], problems: list[str]) -> None:
    by_name: dict[tuple[bytes, str], int] = {}
    index: dict[tuple[bytes, str], int] = {}
    for k, v in txn.cursor(db=ledger._ckpts):
        try:
            lin_b, kind, seq, name = K.split_ckpt_key(bytes(k))
        except (ValueError, UnicodeDecodeError):
            problems.append(f"checkpoint key {bytes(k).hex()} is malformed")
            continue
        if kind == "s":
            index[(lin_b, name)] = seq  # type: ignore[assignment]
            continue
        lin = lin_b.hex()
        try:
            cp = decode_checkpoint(f"{name!r} of lineage {lin}", v)
        except IntegrityError as exc:
            problems.append(f"checkpoint {name!r} of lineage {lin} does not decode: "
                            f"{_reason(exc)}")
            continue
        by_name[(lin_b, name)] = cp.seq
        where = f"checkpoint {cp.session}/{name}"
        info = lineages.get(lin)
        if info is None:
            problems.append(f"{where}: lineage {lin} has no record")
        elif info.removed is not None and not info.kept:
            problems.append(f"{where}: its session was removed without keeping checkpoints")
        elif info.session != cp.session:
            problems.append(f"{where}: lineage {lin} belongs to session {info.session!r}")
        if cp.name != name:
            problems.append(f"{where}: record is named {cp.name!r}")
        raw = txn.get(K.event_key_raw(lin_b, cp.seq), db=ledger._events)
        try:
            ev = None if raw is None else decode_event(cp.seq, raw)
        except IntegrityError:
            ev = None
        if ev is None or ev.type not in CHECKPOINT_EVENTS:
            problems.append(f"{where}: seq {cp.seq} is not a checkpoint.begin/published event")
        for f in cp.files:
            if not has_manifest(f.manifest):
                problems.append(f"{where}: manifest {f.manifest} of {f.name} is not in the store")
    for key, seq in by_name.items():
        if index.get(key) != seq:
            problems.append(f"checkpoint {key[1]!r} of lineage {key[0].hex()} is not indexed")
    for key, seq in index.items():
        if by_name.get(key) != seq:
            problems.append(f"index entry {key[1]!r}@{seq} of {key[0].hex()} has no record")
