"""Which checkpoints hold each chunk, for the bytes only one checkpoint holds (the mount's
st_blocks).

ZFS tells what a snapshot references apart from what it alone uses (what destroying it would
free); a checkpoint file's st_blocks tells the latter: the record bytes of its chunks that no
other checkpoint record holds (of any session, removed-but-kept ones too, since GC marks from
all of them). A chunk two files of one checkpoint share is charged to the first in record order,
so ``du`` of a checkpoint directory is what deleting that checkpoint alone would free. A delta's
base counts as held by whoever holds the delta: GC keeps it for them.

The counts are built on first need from every live manifest, then kept current: whenever the
store's LMDB environment has committed since the last look, the records that came, went or
changed are found and only their manifests are read again. ``version`` moves whenever the
counts do, so the mount knows when the kernel's cached attributes went stale.
"""

from __future__ import annotations

import threading
from typing import Any

from ksfs.errors import ManifestCorrupt
from ksfs.model import CheckpointRecord


class ChunkHolders:
    """How many checkpoint records hold each chunk; thread-safe."""

    def __init__(self, store: Any, ledger: Any) -> None:
        self.store = store
        self.ledger = ledger
        self._lock = threading.Lock()
        self._counts: dict[bytes, int] | None = None  # None until first needed
        self._records: dict[bytes, tuple[str, ...]] = {}  # record key -> its manifests
        self._txnid = -1
        self.version = 0

    def exclusive_bytes(self, record: CheckpointRecord, name: str) -> int:
        """The record bytes of the chunks of ``record``'s file ``name`` that no other checkpoint
        holds and no earlier file of ``record`` has; 0 for a file it does not have."""
        with self._lock:
            self._refresh()
            counts = self._counts or {}
            seen: set[bytes] = set()
            for f in record.files:
                held = self._held(f.manifest)
                if f.name == name:
                    return sum(n for cid, n in held.items()
                               if cid not in seen and counts.get(cid, 0) <= 1)
                seen.update(held)
        return 0

    def _held(self, manifest: str) -> dict[bytes, int]:
        # st_blocks is a figure, not a read: a damaged manifest holds nothing here, so its file
        # and the others beside it still stat and list; reading it is what says EIO
        try:
            return self.store.held_chunks([manifest])
        except ManifestCorrupt:
            return {}

    def poll(self) -> int | None:
        """Bring the counts up to date if they were ever built; their ``version``, or None."""
        with self._lock:
            if self._counts is None:
                return None
            self._refresh()
            return self.version

    def _refresh(self) -> None:
        # The transaction id first: a commit after it is seen at the next look.
        txnid = self.store.env.info()["last_txnid"]
        if self._counts is not None and txnid == self._txnid:
            return
        now = self.ledger.manifests_by_checkpoint()
        if self._counts is None:
            self._rebuild(now)
        else:
            gone = [k for k, m in self._records.items() if now.get(k) != m]
            came = [k for k, m in now.items() if self._records.get(k) != m]
            if gone or came:
                try:
                    for k in gone:
                        self._add(self._records[k], -1)
                    for k in came:
                        self._add(now[k], +1)
                except ManifestCorrupt:  # a manifest GC already swept: count afresh
                    self._rebuild(now)
                self.version += 1
        self._records = now
        self._txnid = txnid

    def _rebuild(self, records: dict[bytes, tuple[str, ...]]) -> None:
        self._counts = {}
        for manifests in records.values():
            self._add(manifests, +1, skip_missing=True)
        self.version += 1

    def _add(self, manifests: tuple[str, ...], step: int, skip_missing: bool = False) -> None:
        assert self._counts is not None
        try:
            held = self.store.held_chunks(manifests)
        except ManifestCorrupt:
            if not skip_missing:
                raise
            return  # a record whose manifest is damaged holds nothing we can name
        counts = self._counts
        for cid in held:
            n = counts.get(cid, 0) + step
            if n > 0:
                counts[cid] = n
            else:
                counts.pop(cid, None)
