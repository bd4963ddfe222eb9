"""Incremental ingest of a fixed-chunked file: rebuild only the chunks whose ranges changed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ksfs.cas import format as fmt
from ksfs.cas.chunking import BATCH_BYTES, FIXED_SIZE, merge_spans, read_exact
from ksfs.errors import ChunkCorrupt, ChunkMissing

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore

log = logging.getLogger(__name__)


class Patcher:
    """Rebuild the 64 KiB chunks an incremental ingest must replace, reading only what changed.

    The changed ranges come at the overlay's cluster size (4 KiB by default), finer than a
    chunk. A chunk whose ranges cover it whole is read from the source; otherwise its base
    (zeros for a hole, else the base chunk from the store, checked against its id) is patched
    with just the changed ranges. So a save reads about what the guest wrote from the frozen
    image, not whole chunks around each written block.
    """

    def __init__(self, store: ChunkStore, src: Any, slots: list[fmt.Entry],
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
