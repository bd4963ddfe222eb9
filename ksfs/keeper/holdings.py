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

from ksfs.cas import format as fmt
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
                if self._building():
                    return None  # maybe published since the counts being replaced were made
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
        """Stop a build in progress (before the store closes under it); none starts after."""
        with self._lock:
            self._closing = True
            builder = self._builder
        if builder is not None:
            builder.join()  # it stops at its next record

    # --- keeping the counts -------------------------------------------------------------------

    def _stamp_of(self, txn: Any) -> tuple[int, int]:
        # The id of the read transaction the records are read in, never the environment's
        # last commit: a commit is counted there before new readers can see it.
        return txn.id(), fmt.gc_generation(txn, self.store.db["cas_meta"])

    def _stamp_now(self) -> tuple[int, int]:
        with self.store.env.begin() as txn:
            return self._stamp_of(txn)

    def _building(self) -> bool:
        return self._builder is not None and self._builder.is_alive()

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
            self._catch_up()
        except _GCRan:
            self._start_build()
        except Exception:  # noqa: BLE001 - the last good counts stay; a build starts afresh
            log.warning("st_blocks: counts could not be brought up to date; counting afresh",
                        exc_info=True)
            with self._lock:
                self._stamp = None
            self._start_build()
        return True

    def _catch_up(self) -> None:
        with self._lock:
            old, old_stamp = self._records, self._stamp
        with self.store.env.begin() as txn:  # the records and their stamp from one snapshot
            stamp = self._stamp_of(txn)
            now = self.ledger.manifests_by_checkpoint(txn, skip_damaged=True)
        if old_stamp is None or stamp[1] != old_stamp[1]:
            raise _GCRan  # holdings moved under the records: count afresh
        gone = [m for k, m in old.items() if now.get(k) != m]
        came = [m for k, m in now.items() if old.get(k) != m]
        # Everything is read before anything is applied: a failure changes nothing.
        minus = [self.store.held_chunks(m) for m in gone]  # ManifestCorrupt: GC swept it
        plus = [self._held(m) for m in came]
        with self._lock:
            if self._records is not old:  # another thread caught up meanwhile
                return
            if self._stamp is not None and stamp[0] <= self._stamp[0]:
                return  # never step back to an older snapshot
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
            if self._closing or self._building():
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
        with self.store.env.begin() as txn:  # the records and their stamp from one snapshot
            stamp = self._stamp_of(txn)
            records = self.ledger.manifests_by_checkpoint(txn, skip_damaged=True)
        counts: dict[bytes, int] = {}
        for manifests in records.values():
            if self._closing:
                return
            _apply(counts, self._held(manifests), +1)
        with self._lock:
            if self._stamp is not None and self._counts is not None \
                    and stamp[0] <= self._stamp[0] and stamp[1] == self._stamp[1]:
                return  # caught up past this snapshot already
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


class _GCRan(Exception):
    """A GC changed holdings since the counts were made: only a new count is right."""


def _apply(counts: dict[bytes, int], held: dict[bytes, int], step: int) -> None:
    for cid in held:
        n = counts.get(cid, 0) + step
        if n > 0:
            counts[cid] = n
        else:
            counts.pop(cid, None)
