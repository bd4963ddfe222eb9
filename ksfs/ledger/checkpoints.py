"""Checkpoint records of the ledger: written in the caller's transaction, listed from an index.

A record is stored under (lineage, name) with its files; an index entry under (lineage, seq,
name) holds only a summary, so listing thousands of checkpoints never loads a file list. This
module must never write a record whose manifests the store does not hold in the same txn.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import lmdb

from ksfs.errors import AlreadyExists, BadInput, ManifestCorrupt, NoSuchCheckpoint, RecordCorrupt
from ksfs.ledger import keys as K
from ksfs.ledger.records import (
    CHECKPOINT_EVENTS,
    CheckpointSummary,
    checkpoint_dict,
    decode_checkpoint,
    decode_summary,
    lmdb_errors,
    summary_of,
)
from ksfs.model import CheckpointRecord, Event, event_file_names, validate_name


def auto_checkpoint_name(seq: int, taken: Container[str] = ()) -> str:
    """The name of an unnamed checkpoint whose ``checkpoint.begin`` has seq ``seq``: ``c_`` and
    that seq, 4 digits at least; when that name is taken (a user may name a checkpoint
    ``c_0007``), the next free ``c_NNNN`` above it. Never an odd form such as ``c_0007-2``, and
    never a taken name (an automatic name must not make a save or a restore fail)."""
    if not isinstance(seq, int) or seq < 0:
        raise BadInput(f"a checkpoint's seq must be an integer >= 0, not {seq!r}")
    n = seq
    while f"c_{n:04d}" in taken:
        n += 1
    return f"c_{n:04d}"


def _where(key: bytes) -> str:
    """A checkpoints-db key as a damaged record's message names it."""
    try:
        lin, _, _, name = K.split_ckpt_key(key)
    except (ValueError, UnicodeDecodeError):
        return f"under key {key.hex()}"
    return f"{name!r} of lineage {lin.hex()}"


class CheckpointMethods:
    """The checkpoint half of ``Ledger`` (a mixin: it uses the ledger's dbs and helpers)."""

    _ckpts: Any

    # --- checkpoints --------------------------------------------------------------------------

    def put_checkpoint(self, txn: lmdb.Transaction, record: CheckpointRecord) -> None:
        """Write a checkpoint record (and its seq index entry) in the caller's transaction.

        Refuses a duplicate name, a seq that is not a ``checkpoint.begin``/``published`` event of
        the session, and files whose manifests the store does not hold inside ``txn``.
        """
        validate_name(record.name, "checkpoint name", new=True)
        with lmdb_errors(self.path):
            rec = self._live(txn, record.session)
            lin = K.lineage_bytes(rec.lineage)
            if txn.get(K.ckpt_name_key(lin, record.name), db=self._ckpts) is not None:
                raise AlreadyExists(what="checkpoint", name=f"{record.session}/{record.name}")
            ev = self._event_raw(txn, lin, record.seq)
            if ev is None or ev.type not in CHECKPOINT_EVENTS:
                raise BadInput(
                    f"checkpoint {record.name!r} seq {record.seq} is not a checkpoint.begin "
                    f"or checkpoint.published event of session {record.session!r}"
                )
            names = [f.name for f in record.files]
            if len(set(names)) != len(names):
                raise BadInput(f"checkpoint {record.name!r} lists a file twice")
            for f in record.files:
                validate_name(f.name, "checkpoint file name", new=True)
                if not self.has_manifest(txn, f.manifest):
                    raise ManifestCorrupt(manifest=f.manifest, why="not in the store")
            txn.put(K.ckpt_name_key(lin, record.name), K.dumps(checkpoint_dict(record)),
                    db=self._ckpts)
            txn.put(K.ckpt_seq_key(lin, record.seq, record.name), K.dumps(summary_of(record)),
                    db=self._ckpts)

    def delete_checkpoint(self, txn: lmdb.Transaction, session: str, name: str) -> Event:
        """Delete a checkpoint record and append ``checkpoint.deleted``.

        Forks of it keep their branch point in their own records and event 0.
        """
        with lmdb_errors(self.path):
            rec = self._live(txn, session)
            lin = K.lineage_bytes(rec.lineage)
            cp = self._ckpt_raw(txn, lin, name)
            if cp is None:
                raise NoSuchCheckpoint(session=session, checkpoint=name)
            txn.delete(K.ckpt_name_key(lin, name), db=self._ckpts)
            txn.delete(K.ckpt_seq_key(lin, cp.seq, name), db=self._ckpts)
            return self._append(txn, rec.lineage, "checkpoint.deleted", {
                "name": name, "seq": cp.seq, **event_file_names([f.name for f in cp.files]),
                "size": cp.logical_bytes, "stored": cp.stored_bytes,
            })

    def _ckpt_raw(self, txn: lmdb.Transaction, lin: bytes, name: str) -> CheckpointRecord | None:
        raw = txn.get(K.ckpt_name_key(lin, name), db=self._ckpts)
        return None if raw is None else decode_checkpoint(f"{name!r} of lineage {lin.hex()}", raw)

    def _summaries(self, txn: lmdb.Transaction, lin: bytes) -> list[CheckpointSummary]:
        prefix = lin + K.CKPT_BY_SEQ
        out = []
        cur = txn.cursor(db=self._ckpts)
        if cur.set_range(prefix):
            for k, v in cur:
                if not bytes(k).startswith(prefix):
                    break
                out.append(decode_summary(_where(bytes(k)), v))
        return out

    def checkpoint(
        self, session: str, name: str, txn: lmdb.Transaction | None = None
    ) -> CheckpointRecord:
        with self._read(txn) as t:
            cp = self._ckpt_raw(t, K.lineage_bytes(self._need(t, session).lineage), name)
        if cp is None:
            raise NoSuchCheckpoint(session=session, checkpoint=name)
        return cp

    def checkpoint_summaries(
        self, session: str, txn: lmdb.Transaction | None = None
    ) -> list[CheckpointSummary]:
        """The session's checkpoints in seq order, from the index (no file lists loaded)."""
        with self._read(txn) as t:
            return self._summaries(t, K.lineage_bytes(self._need(t, session).lineage))

    def checkpoint_names(self, session: str, txn: lmdb.Transaction | None = None) -> list[str]:
        return [s.name for s in self.checkpoint_summaries(session, txn)]

    def checkpoints(
        self, session: str, txn: lmdb.Transaction | None = None
    ) -> list[CheckpointRecord]:
        with self._read(txn) as t:
            lin = K.lineage_bytes(self._need(t, session).lineage)
            out = [self._ckpt_raw(t, lin, s.name) for s in self._summaries(t, lin)]
        return [cp for cp in out if cp is not None]

    def latest_checkpoint(
        self, session: str, txn: lmdb.Transaction | None = None
    ) -> CheckpointRecord | None:
        """The session's checkpoint with the highest seq, or None."""
        with self._read(txn) as t:
            lin = K.lineage_bytes(self._need(t, session).lineage)
            summaries = self._summaries(t, lin)
            return self._ckpt_raw(t, lin, summaries[-1].name) if summaries else None

    # --- store-wide ---------------------------------------------------------------------------

    def live_manifests(self, txn: lmdb.Transaction | None = None) -> set[str]:
        """Every manifest a checkpoint record (of any session, removed-but-kept too) names."""
        return set().union(*self.manifests_by_checkpoint(txn).values())

    def manifests_by_checkpoint(self, txn: lmdb.Transaction | None = None,
                                skip_damaged: bool = False) -> dict[bytes, tuple[str, ...]]:
        """Each checkpoint record (of any session, removed-but-kept too) by its key, with the
        manifests its files name in record order: what holds chunks in the store.

        A record that no longer decodes raises RecordCorrupt, unless ``skip_damaged`` (for
        figures such as st_blocks, which must not fail every file for one damaged record)."""
        out: dict[bytes, tuple[str, ...]] = {}
        with self._read(txn) as t:
            for k, v in t.cursor(db=self._ckpts):
                if bytes(k)[K.LINEAGE_BYTES : K.LINEAGE_BYTES + 1] != K.CKPT_BY_NAME:
                    continue
                try:
                    out[bytes(k)] = tuple(f["manifest"] for f in K.loads(v)["files"])
                except (RecordCorrupt, KeyError, TypeError) as exc:
                    if not skip_damaged:
                        raise RecordCorrupt(why=f"checkpoint record {_where(bytes(k))}: "
                                                f"its files name no manifests ({exc!r})") from None
        return out

