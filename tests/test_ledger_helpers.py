"""Shared helpers of the ledger tests: a store to put the ledger on, and a real checkpoint flow.

The ledger runs on the chunk store's LMDB environment. When ``ksfs.cas`` can ingest, the helpers
use the real ChunkStore and real manifests; until then, a real LMDB environment in a tmp dir with
a ``manifests`` db whose keys are the BLAKE3 of the bytes stands in (records only). No test here.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import lmdb

from ksfs.ledger import Ledger, auto_checkpoint_name
from ksfs.model import CheckpointRecord, FileRecord


def cas_available() -> bool:
    try:
        import ksfs.cas.ingest  # noqa: F401
        from ksfs.cas import ChunkStore  # noqa: F401
    except ImportError:
        return False
    return True


class LmdbOnlyStore:
    """A real LMDB env with the cas's ``manifests`` db, for when the cas cannot ingest yet."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.join(path, "index"), exist_ok=True)
        self.env = lmdb.open(os.path.join(path, "index"), max_dbs=32, map_size=1 << 32)
        self.db = {"manifests": self.env.open_db(b"manifests")}

    def has_manifest(self, manifest_hex: str) -> bool:
        with self.env.begin(db=self.db["manifests"]) as t:
            return t.get(bytes.fromhex(manifest_hex)) is not None

    def close(self) -> None:
        self.env.close()


def open_store(path: str | os.PathLike[str]) -> Any:
    path = str(path)
    if cas_available():
        from ksfs.cas import ChunkStore

        return ChunkStore.open(path, create=True)
    return LmdbOnlyStore(path)


def take_checkpoint(
    ledger: Ledger,
    store: Any,
    session: str,
    files: dict[str, bytes],
    name: str | None = None,
    transcript_seq: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> CheckpointRecord:
    """The keeper's checkpoint flow: ``checkpoint.begin``, ingest, then record + manifests +
    ``checkpoint.published`` in one transaction."""
    taken = set(ledger.checkpoint_names(session))
    begin = ledger.record(session, "checkpoint.begin", {"name": name})
    name = name or auto_checkpoint_name(begin.seq, taken)
    if isinstance(store, LmdbOnlyStore):
        records = []
        with store.env.begin(write=True) as txn:
            for fname, data in files.items():
                mid = hashlib.blake2b(data, digest_size=32).digest()
                txn.put(mid, data, db=store.db["manifests"])
                records.append(FileRecord(fname, mid.hex(), len(data), len(data)))
            record = _record(session, name, begin.seq, records, transcript_seq)
            ledger.put_checkpoint(txn, record)
            ledger.append(txn, session, "checkpoint.published", _published(record))
        return record
    workdir = Path(workdir or store.path)
    with store.ingest() as ingest:
        records = []
        for fname, data in files.items():
            src = workdir / f".src-{os.getpid()}-{fname}"
            src.write_bytes(data)
            try:
                f = ingest.add_file(str(src), chunking="cdc")
            finally:
                src.unlink()
            records.append(FileRecord(fname, f.manifest, f.size, f.stored, f.chunking, f.digest))
        ingest.seal()
        record = _record(session, name, begin.seq, records, transcript_seq)
        with store.env.begin(write=True) as txn:
            ingest.commit(txn)
            ledger.put_checkpoint(txn, record)
            ledger.append(txn, session, "checkpoint.published", _published(record))
    return record


def _record(session: str, name: str, seq: int, files: list[FileRecord],
            transcript_seq: int | None) -> CheckpointRecord:
    return CheckpointRecord(session=session, name=name, seq=seq, created=time.time(),
                            files=tuple(files), transcript_seq=transcript_seq)


def _published(record: CheckpointRecord) -> dict[str, Any]:
    return {"name": record.name, "seq": record.seq, "logical_bytes": record.logical_bytes,
            "stored_bytes": record.stored_bytes, "files": [f.name for f in record.files]}
