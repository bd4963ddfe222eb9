"""Incremental ingest of a fixed-chunked file: rebuild only the chunks whose ranges changed."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ksfs.cas import format as fmt
from ksfs.cas.chunking import BATCH_BYTES, FIXED_SIZE, merge_spans, read_exact
from ksfs.errors import BadInput, ChunkCorrupt, ChunkMissing

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore

log = logging.getLogger(__name__)


class BaseSlots:
    """The 64 KiB slots of a fixed-chunked base manifest, found in its entries by bisection.

    A hole run is one entry however long, so an incremental save costs the disk's data and
    what changed, not one slot per 64 KiB of its size: with a slot list, one changed block of a
    sparse 1 TiB disk took 10 s and 392 MiB (docs/performance.md, thirtieth session).
    """

    def __init__(self, info: fmt.ManifestInfo, name: str) -> None:
        self.entries = info.entries
        self.size = info.size
        self.starts: list[int] = []
        pos = 0
        for cid, length in info.entries:
            # holes fill what lies between chunks: they need no check of their own
            if cid is not None and (pos % FIXED_SIZE or
                                    (length != FIXED_SIZE and pos + length != info.size)):
                raise BadInput(f"base manifest {name} is not cut at 64 KiB boundaries")
            self.starts.append(pos)
            pos += length

    def __getitem__(self, index: int) -> fmt.Entry:
        """Slot ``index`` as the base has it: (id, length), (None, length) in a hole, and
        (None, 0) past the base's end (new ground, read whole)."""
        pos = index * FIXED_SIZE
        if pos >= self.size:
            return (None, 0)
        k = bisect.bisect_right(self.starts, pos) - 1
        cid, length = self.entries[k]
        if cid is None:
            return (None, min(FIXED_SIZE, self.starts[k] + length - pos))
        return (cid, length)

    def patched(self, new: dict[int, fmt.Entry], size: int) -> list[fmt.Entry]:
        """The entries of the new version, ``size`` bytes long: the base's, with slot i
        replaced by ``new[i]`` (every slot whose bytes changed, and every one past the base's
        end or cut by a smaller size; a slot missing there makes the size come out wrong,
        which the ingest refuses)."""
        out: list[fmt.Entry] = []
        order = sorted(new)
        j = 0
        for k, (cid, length) in enumerate(self.entries):
            start = self.starts[k]
            if start >= size:
                break
            end = min(start + length, size)
            if cid is not None:
                if j < len(order) and order[j] == start // FIXED_SIZE:
                    out.append(new[order[j]])
                    j += 1
                else:
                    out.append((cid, length))
                continue
            pos, last = start, -(-end // FIXED_SIZE)  # a hole: the slots replaced within it
            while j < len(order) and order[j] < last:
                at = order[j] * FIXED_SIZE
                if at > pos:
                    out.append((None, at - pos))
                out.append(new[order[j]])
                pos = at + new[order[j]][1]
                j += 1
            if pos < end:
                out.append((None, end - pos))
        out.extend(new[i] for i in order[j:])  # past the base's end
        return out


class Patcher:
    """Rebuild the 64 KiB chunks an incremental ingest must replace, reading only what changed.

    The changed ranges come at the overlay's cluster size (4 KiB by default), finer than a
    chunk. A chunk whose ranges cover it whole is read from the source; otherwise its base
    (zeros for a hole, else the base chunk from the store, checked against its id) is patched
    with just the changed ranges. So a save reads about what the guest wrote from the frozen
    image, not whole chunks around each written block.
    """

    def __init__(self, store: ChunkStore, src: Any, slots: BaseSlots,
                 keep: Callable[[bytes, bytes], None] | None = None) -> None:
        self.store = store
        self.src = src
        self.slots = slots
        self.keep = keep  # told each plain base chunk read, so a delta against it reads none
        self.base_bytes_read = 0

    def batches(self, ranges: list[tuple[int, int]]) -> Iterator[list[tuple[int, bytes]]]:
        batch: list[tuple[int, bytes]] = []
        for start, parts in _per_chunk(ranges, self.src.size):
            batch.append((start, self._chunk(start, parts)))
            if len(batch) * FIXED_SIZE >= BATCH_BYTES:
                yield batch
                batch = []
        if batch:
            yield batch

    def _chunk(self, start: int, parts: list[tuple[int, int]]) -> bytes:
        n = min(FIXED_SIZE, self.src.size - start)
        cid, length = self.slots[start // FIXED_SIZE]
        if length != n or parts == [(start, start + n)]:
            return read_exact(self.src, start, n)  # new ground, or rewritten whole
        if cid is None:
            buf = bytearray(n)
        else:
            loc = self.store.lookup(cid)
            try:
                base = self.store.read_chunk(cid, loc)
            except (ChunkCorrupt, ChunkMissing) as exc:
                # The frozen image has every byte: read the chunk whole, as if no base were
                # known, so damage in the store never stops a running session's saves.
                # ``check`` still reports the damaged chunk.
                log.warning("base chunk unreadable, reading the chunk at %d whole: %s",
                            start, exc)
                return read_exact(self.src, start, n)
            self.base_bytes_read += loc.record_len if loc is not None else 0
            if self.keep is not None and loc is not None and loc.codec not in fmt.DELTA_CODECS:
                self.keep(cid, base)
            buf = bytearray(base)
        for a, b in parts:
            buf[a - start : b - start] = read_exact(self.src, a, b - a)
        return bytes(buf)


def _per_chunk(ranges: list[tuple[int, int]], size: int
               ) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """Group (offset, length) ranges by 64 KiB chunk: (chunk start, merged [a, b) parts)."""
    merged = merge_spans((off, min(off + length, size)) for off, length in ranges
                         if length > 0 and off < size)
    current = -1
    parts: list[tuple[int, int]] = []
    for a, b in merged:
        while a < b:
            start = a - a % FIXED_SIZE
            end = min(b, start + FIXED_SIZE)
            if start != current:
                if parts:
                    yield current, parts
                current, parts = start, []
            parts.append((a, end))
            a = end
    if parts:
        yield current, parts
