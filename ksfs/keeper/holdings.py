"""Which checkpoints hold each chunk, for the bytes only one checkpoint holds (the mount's
st_blocks).

ZFS tells what a snapshot references apart from what it alone uses (what destroying it would
free); a checkpoint file's st_blocks tells the latter: the record bytes of its chunks that no
other checkpoint record holds (of any session, removed-but-kept ones too, since GC marks from
all of them). A chunk two files of one checkpoint share is charged to the first in record order,
so ``du`` of a checkpoint directory is what deleting that checkpoint alone frees. A delta's base
counts as held by whoever holds the delta: GC keeps it for them (unless GC finds storing those
deltas whole smaller, which frees more than ``du`` said: docs/mount.md).

The counts are built from every live manifest on a thread of their own, started by the first
question; until they exist the answer is None and the mount shows the bytes the file first
brought into the store. They are then kept current: whenever the store's LMDB environment has
committed since the last look, the records that came, went or changed are found and only their
manifests are read. A GC may change what records hold without touching a record (a delta
stored whole), so after one (``gc_generation``) the counts are built again in the background,
the old ones answering meanwhile. ``version`` moves whenever the counts do, so the mount knows
when the kernel's cached attributes went stale. Figures, not reads: a damaged record or manifest
holds nothing here, and a failure leaves the last good counts in place.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ksfs.cas.gc import GC_GENERATION
from ksfs.errors import ManifestCorrupt
from ksfs.model import CheckpointRecord

log = logging.getLogger(__name__)

class ChunkHolders:
    """How many checkpoint records hold each chunk; thread-safe."""

    def __init__(self, store: Any, ledger: Any) -> None:
        self.store = store
        self.ledger = ledger
        self._lock = threading.Lock()  # the fields below; never held while a build reads
        self._counts: dict[bytes, int] | None = None  # None until first built
        self._records: dict[bytes, tuple[str, ...]] = {}  # record key -> its manifests
        self._live: set[tuple[str, ...]] = set()  # the manifests of every live record
        self._stamp: tuple[int, int] | None = None  # (LMDB txn id, gc generation) counted
        self._results: dict[tuple, int] = {}  # (manifests, file) -> bytes, this version
        self._builder: threading.Thread | None = None
        self._closing = False
        self.version = 0

    def exclusive_bytes(self, record: CheckpointRecord, name: str, wait: bool = False
                        ) -> int | None:
        """The record bytes of the chunks of ``record``'s file ``name`` that no other checkpoint
        holds and no earlier file of ``record`` has; 0 for a file it does not have or a record
        no longer live. None while the counts are first being built, unless ``wait``."""
        if not self._refresh(wait):
            return None
        manifests = tuple(f.manifest for f in record.files)
        key = (manifests, name)
        with self._lock:
            if manifests not in self._live:
                return 0  # deleted since: it holds nothing any more
            if key in self._results:
                return self._results[key]
            version = self.version
        # The manifests are read outside the lock (the slow part), the counts under it.
        files: list[tuple[str, dict[bytes, int]]] = []
        for f in record.files:
            files.append((f.name, self._held((f.manifest,))))
            if f.name == name:
                break
        with self._lock:
            counts = self._counts or {}
            seen: set[bytes] = set()
            total = 0
            for fname, held in files:
                if fname == name:
                    total = sum(n for cid, n in held.items()
                                if cid not in seen and counts.get(cid, 0) <= 1)
                    break
                seen.update(held)
            if self.version == version:
                self._results[key] = total
        return total

    def poll(self) -> int | None:
        """Bring the counts up to date if they were ever asked for; their ``version``, or None."""
        with self._lock:
            if self._counts is None:
                return None
        self._refresh(wait=False)
        return self.version

    def close(self) -> None:
        """Stop a build in progress (before the store closes under it)."""
        self._closing = True
        builder = self._builder
        if builder is not None:
            builder.join(timeout=30)

    # --- keeping the counts -------------------------------------------------------------------

    def _stamp_now(self) -> tuple[int, int]:
        # Read before the records: a commit after it is seen at the next look.
        with self.store.env.begin(db=self.store.db["cas_meta"]) as txn:
            gen = int(txn.get(GC_GENERATION) or b"0")
        return self.store.env.info()["last_txnid"], gen

    def _refresh(self, wait: bool) -> bool:
        """Counts as current as can be had now; False when there are none yet."""
        stamp = self._stamp_now()
        with self._lock:
            if self._counts is not None and stamp == self._stamp:
                return True
            full = self._counts is None or self._stamp is None or stamp[1] != self._stamp[1]
        if full:
            if wait:
                self._build()
            else:
                self._start_build()
            with self._lock:
                return self._counts is not None
        try:
            self._catch_up(stamp)
        except Exception:  # noqa: BLE001 - the last good counts stay; a build starts afresh
            log.warning("st_blocks: counts could not be brought up to date; counting afresh",
                        exc_info=True)
            with self._lock:
                self._stamp = None
            self._start_build()
        return True

    def _catch_up(self, stamp: tuple[int, int]) -> None:
        now = self.ledger.manifests_by_checkpoint(skip_damaged=True)
        with self._lock:
            old = self._records
        gone = [m for k, m in old.items() if now.get(k) != m]
        came = [m for k, m in now.items() if old.get(k) != m]
        # Everything is read before anything is applied: a failure changes nothing.
        minus = [self.store.held_chunks(m) for m in gone]  # ManifestCorrupt: GC swept it
        plus = [self._held(m) for m in came]
        with self._lock:
            if self._records is not old:  # another thread caught up meanwhile
                return
            counts = self._counts
            assert counts is not None
            for held in minus:
                _apply(counts, held, -1)
            for held in plus:
                _apply(counts, held, +1)
            self._records, self._live, self._stamp = now, set(now.values()), stamp
            if gone or came:
                self.version += 1
                self._results.clear()

    def _start_build(self) -> None:
        with self._lock:
            if self._builder is not None and self._builder.is_alive():
                return
            self._builder = threading.Thread(target=self._build_logged, daemon=True,
                                             name="ksfs-holdings")
            self._builder.start()

    def _build_logged(self) -> None:
        try:
            self._build()
        except Exception:  # noqa: BLE001 - a figure: the next question tries again
            if not self._closing:
                log.warning("st_blocks: counting the chunks of every checkpoint failed",
                            exc_info=True)

    def _build(self) -> None:
        stamp = self._stamp_now()
        records = self.ledger.manifests_by_checkpoint(skip_damaged=True)
        counts: dict[bytes, int] = {}
        for manifests in records.values():
            if self._closing:
                return
            _apply(counts, self._held(manifests), +1)
        with self._lock:
            self._counts, self._records, self._stamp = counts, records, stamp
            self._live = set(records.values())
            self._results.clear()
            self.version += 1

    def _held(self, manifests: tuple[str, ...]) -> dict[bytes, int]:
        # A damaged manifest holds nothing here, so its file and the others beside it still
        # stat and list; reading it is what says EIO.
        held: dict[bytes, int] = {}
        for m in manifests:
            try:
                held.update(self.store.held_chunks((m,)))
            except ManifestCorrupt:
                pass
        return held


def _apply(counts: dict[bytes, int], held: dict[bytes, int], step: int) -> None:
    for cid in held:
        n = counts.get(cid, 0) + step
        if n > 0:
            counts[cid] = n
        else:
            counts.pop(cid, None)
