"""Random-access reads of one stored file: ``FileReader`` over a manifest.

A reader builds the cumulative-offset table of its manifest once, bisects it per read and keeps
a bounded LRU of decompressed chunks. It is thread-safe. It never returns bytes that were not
checked against their chunk id: damage raises ChunkCorrupt, a lost chunk ChunkMissing, each
naming the chunk.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from ksfs.cas.format import Location
from ksfs.errors import BadInput

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore


class FileReader:
    """Reads a stored file. Invariant: ``starts[i]`` is the file offset of ``entries[i]``."""

    def __init__(self, store: ChunkStore, manifest_hex: str, cache_bytes: int) -> None:
        info = store.load_manifest(manifest_hex)
        self.store = store
        self.manifest = manifest_hex
        self.size = info.size
        self.chunking = info.chunking
        self.entries = info.entries
        self.starts = [0, *itertools.accumulate(length for _, length in self.entries)][:-1]
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()

    def read(self, offset: int, n: int) -> bytes:
        """Up to n bytes at offset (fewer only at the end of the file)."""
        if offset < 0 or n < 0:
            raise BadInput(f"cannot read {n} bytes at offset {offset}")
        end = min(self.size, offset + n)
        if offset >= end:
            return b""
        first = bisect.bisect_right(self.starts, offset) - 1
        parts = []
        pos = offset
        i = first
        txn = None  # one index snapshot for all the lookups of this read
        try:
            while pos < end:
                cid, length = self.entries[i]
                start = self.starts[i]
                lo = pos - start
                hi = min(length, end - start)
                if cid is None:
                    parts.append(bytes(hi - lo))
                else:
                    data = self._cached_chunk(cid)
                    if data is None:
                        if txn is None:
                            txn = self.store.env.begin(db=self.store.db["chunks"])
                        raw = txn.get(cid)
                        data = self._load(cid, None if raw is None else Location.decode(raw))
                    parts.append(data[lo:hi] if (lo, hi) != (0, length) else data)
                pos = start + hi
                i += 1
        finally:
            if txn is not None:
                txn.abort()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _cached_chunk(self, cid: bytes) -> bytes | None:
        with self._lock:
            data = self._cache.get(cid)
            if data is not None:
                self._cache.move_to_end(cid)
            return data

    def _load(self, cid: bytes, loc: Location | None) -> bytes:
        data = self.store.read_chunk(cid, loc)  # outside the lock: readers in threads overlap
        with self._lock:
            self._remember(cid, data)
        return data

    def _remember(self, cid: bytes, data: bytes) -> None:
        if cid in self._cache:
            return
        self._cache[cid] = data
        self._cached += len(data)
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)

    def chunk_ids(self) -> list[bytes | None]:
        """The chunk id of every manifest entry, in file order; None for a hole."""
        return [cid for cid, _ in self.entries]

    def holes(self) -> list[tuple[int, int]]:
        """(offset, length) of every hole (all-zero run that takes no space)."""
        return [(s, length) for s, (cid, length) in zip(self.starts, self.entries, strict=True)
                if cid is None]

    def stored_extents(self) -> list[tuple[int, int, bytes]]:
        """(offset, length, chunk id) of every entry that is not a hole."""
        return [(s, length, cid) for s, (cid, length) in zip(self.starts, self.entries, strict=True)
                if cid is not None]


def changed_share(old: FileReader, new: FileReader) -> float:
    """The share of new's bytes held in chunks old does not have (holes count as unchanged)."""
    if new.size == 0:
        return 0.0
    have = {cid for cid in old.chunk_ids() if cid is not None}
    changed = sum(length for _, length, cid in new.stored_extents() if cid not in have)
    return changed / new.size
