"""Random-access reads of one stored file: ``FileReader`` over a manifest.

A reader builds the cumulative-offset table of its manifest once, bisects it per read and keeps
a bounded LRU of decompressed chunks. It is thread-safe. It never returns bytes that were not
checked against their chunk id: damage raises ChunkCorrupt, a lost chunk ChunkMissing, each
naming the chunk.
"""

from __future__ import annotations

import array
import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ksfs.cas.format import (
    CODEC_RAW,
    HEADER_SIZE,
    INDEX_VALUE,
    INDEX_VALUE_SIZES,
    Location,
    chunk_id,
    decode_record_header,
    split_base_ids,
)
from ksfs.cas.packs import decode_payload
from ksfs.errors import BadInput, KsfsError
from ksfs.lru import LRU

if TYPE_CHECKING:
    import lmdb
    import zstandard

    from ksfs.cas.store import ChunkStore


STREAM_BATCH = 2 * 1024 * 1024  # plain bytes per task of a streamed read
# Tasks in flight: both workers busy while the consumer writes. On the shared 2-core test box
# they gained little over one thread for /dev/null; they matter when the consumer is a pipe.
STREAM_AHEAD = 4
BASES_CACHED = 32 * 1024 * 1024  # plain bytes of delta bases one stream keeps, read once each
SPAN_MAX = 4 * 1024 * 1024  # adjacent records of one pack are read with one pread up to this
_ZEROS = memoryview(bytes(1024 * 1024))  # holes are handed out as views of this


def is_hole(piece: bytes | memoryview) -> bool:
    """Whether a piece ``stream`` yielded is (part of) a hole: all zeros, never stored."""
    return isinstance(piece, memoryview) and piece.obj is _ZEROS.obj


class FileReader:
    """Reads a stored file. Invariant: ``starts[i]`` is the file offset of ``entries[i]``."""

    def __init__(self, store: ChunkStore, manifest_hex: str, cache_bytes: int) -> None:
        info = store.load_manifest(manifest_hex)
        self.store = store
        self.manifest = manifest_hex
        self.size = info.size
        self.chunking = info.chunking
        self.entries = info.entries
        # the file offset of each entry, 8 bytes apiece (a list of ints costs ~36)
        self.starts = array.array("Q", itertools.accumulate(self.entries.lengths(), initial=0))
        self.starts.pop()
        self.cache_bytes = cache_bytes
        self._cache = LRU(cache_bytes, weight=len)  # decompressed chunks by id

    def read(self, offset: int, n: int) -> bytes:
        """Up to n bytes at offset (fewer only at the end of the file)."""
        if offset < 0 or n < 0:
            raise BadInput(f"cannot read {n} bytes at offset {offset}")
        end = min(self.size, offset + n)
        if offset >= end:
            return b""
        parts = []
        with _IndexSnapshot(self.store) as index:
            for cid, length, lo, hi in self._spans(offset, end):
                if cid is None:
                    parts.append(bytes(hi - lo))
                    continue
                data = self._cached_chunk(cid)
                if data is None:
                    data = self._load(cid, _location(index.get(cid), cid))
                parts.append(data[lo:hi] if (lo, hi) != (0, length) else data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, offset: int, buf: bytearray | memoryview, zeroed: bool = False) -> int:
        """Fill buf with the bytes at offset (fewer only at the end of the file); the count.

        The mount's read path: a raw (incompressible) chunk that the request covers whole is
        read from its pack straight into buf and hashed there, instead of being read, copied
        out of its record and copied again into the reply. ``zeroed``: buf is known to hold
        zeros, so holes need no writing. Checked exactly as ``read``: any chunk the fast path
        cannot vouch for goes through ``store.read_chunk``, which raises the integrity errors.
        When it raises, buf may hold bytes that failed their check: drop it.
        """
        view = memoryview(buf).cast("B")
        if offset < 0:
            raise BadInput(f"cannot read at offset {offset}")
        end = min(self.size, offset + len(view))
        if offset >= end:
            return 0
        at = 0  # where in buf the next span goes
        with _IndexSnapshot(self.store) as index:
            for cid, length, lo, hi in self._spans(offset, end):
                dst = view[at : at + hi - lo]
                at += hi - lo
                if cid is None:
                    if not zeroed:
                        for k in range(0, len(dst), len(_ZEROS)):
                            piece = dst[k : k + len(_ZEROS)]
                            piece[:] = _ZEROS[: len(piece)]
                    continue
                data = self._cached_chunk(cid)
                if data is None:
                    raw = index.get(cid)
                    if (raw is not None and hi - lo == length
                            and _read_raw_into(self.store, cid, raw, dst)):
                        continue
                    data = self._load(cid, _location(raw, cid))
                dst[:] = data if hi - lo == length else memoryview(data)[lo:hi]
        return end - offset

    def _spans(self, offset: int, end: int) -> Iterator[tuple[bytes | None, int, int, int]]:
        """(chunk id or None for a hole, entry length, lo, hi) of each manifest entry that the
        range offset..end touches, in file order: the range takes bytes lo..hi of it."""
        i = bisect.bisect_right(self.starts, offset) - 1
        pos = offset
        while pos < end:
            cid, length = self.entries[i]
            start = self.starts[i]
            hi = min(length, end - start)
            yield cid, length, pos - start, hi
            pos = start + hi
            i += 1

    def stream(self, offset: int = 0, end: int | None = None) -> Iterator[list[bytes | memoryview]]:
        """The bytes from offset to end (default: the end of the file) in order, as lists of
        pieces, for reading a whole file once (``ksfs cat``).

        Chunks are read, decompressed and checked against their ids ahead of the consumer on the
        store's two workers (zstd and BLAKE3 release the GIL), adjacent records with one pread,
        without going through the LRU: a file read once would only evict what others cached.
        Any chunk the fast path cannot vouch for is read again through ``store.read_chunk``,
        which finds chunks GC moved and raises ChunkMissing or ChunkCorrupt like ``read``.
        """
        end = self.size if end is None else min(end, self.size)
        if offset < 0 or end < 0:
            raise BadInput(f"cannot read from offset {offset} to {end}")
        if offset >= end:
            return
        tasks = self._tasks(offset, end)
        bases = _Bases(self.store)
        first = next(tasks)
        second = next(tasks, None)
        if second is None or not STREAM_AHEAD:  # one task: no thread to hand it to
            for t in itertools.chain((first,), () if second is None else (second,), tasks):
                yield self._read_task(t, bases)
            return
        tasks = itertools.chain((first, second), tasks)
        pool = self.store.pool
        pending: deque = deque()
        try:
            for t in tasks:
                pending.append(pool.submit(self._read_task, t, bases))
                if len(pending) >= STREAM_AHEAD:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:  # the consumer stopped early or a read failed
                fut.cancel()

    def _tasks(self, offset: int, end: int) -> Iterator[list[_Item]]:
        """The read tasks of offset..end, [(chunk id or None, entry length, lo, hi)] each, made
        as they are needed (all of them at once cost ~100 bytes an entry: most of a big file's
        reader)."""
        task: list[_Item] = []
        task_bytes = 0
        i = bisect.bisect_right(self.starts, offset) - 1
        starts = self.starts
        for cid, length in itertools.islice(self.entries, i, None):
            start = starts[i]
            if start >= end:
                break
            lo, hi = max(offset - start, 0), min(length, end - start)
            task.append((cid, length, lo, hi))
            task_bytes += hi - lo
            if task_bytes >= STREAM_BATCH or len(task) >= 512:  # 512: well under IOV_MAX
                yield task
                task, task_bytes = [], 0
            i += 1
        if task:
            yield task

    def _read_task(self, task: list[_Item], bases: _Bases) -> list[bytes | memoryview]:
        store = self.store
        ids = [item[0] for item in task]
        with store.env.begin(db=store.db["chunks"]) as txn:  # one index snapshot per task
            locs = _locations(txn, ids)
            bases.fetch(txn, locs)
        plains = _read_records(store, ids, locs, bases)
        out: list[bytes | memoryview] = []
        for (cid, length, lo, hi), plain in zip(task, plains, strict=True):
            if cid is None:
                size = hi - lo
                while size > 0:
                    out.append(_ZEROS[: min(size, len(_ZEROS))])
                    size -= len(out[-1])
                continue
            if plain is None:  # not vouched for: read_chunk finds it, or names what is wrong
                plain = store.read_chunk(cid)
            out.append(plain if lo == 0 and hi == length else memoryview(plain)[lo:hi])
        return out

    def _cached_chunk(self, cid: bytes) -> bytes | None:
        return self._cache.get(cid)

    def _load(self, cid: bytes, loc: Location | None) -> bytes:
        data = self.store.read_chunk(cid, loc)  # outside the cache's lock: readers overlap
        self._cache.put(cid, data)
        return data

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


class _IndexSnapshot:
    """One read transaction of the chunk index, begun at the first lookup, for all the lookups
    of one read (aborted at the end, whatever happens)."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.txn = None

    def get(self, cid: bytes) -> bytes | None:
        if self.txn is None:
            self.txn = self.store.env.begin(db=self.store.db["chunks"])
        return self.txn.get(cid)

    def __enter__(self) -> _IndexSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.txn is not None:
            self.txn.abort()


def _location(raw: bytes | None, cid: bytes) -> Location | None:
    return None if raw is None else Location.decode(raw, cid)


def _read_raw_into(store: ChunkStore, cid: bytes, raw: bytes, dst: memoryview) -> bool:
    """Read the raw-codec chunk whose index value is raw straight into dst (its exact plain
    length) and check it like ``ChunkStore._read_at``; False when it is not a raw chunk of that
    length or anything is off (the caller then reads it the checked slow way)."""
    if len(raw) != INDEX_VALUE.size:
        return False  # a delta: its value names a base
    pack, off, stored_len, plain_len, codec = INDEX_VALUE.unpack(raw)
    if codec != CODEC_RAW or stored_len != len(dst) or plain_len != stored_len:
        return False
    head = bytearray(HEADER_SIZE)
    try:
        got = store.handles.preadv(pack, [head, dst], off)
    except OSError:
        return False
    return (got == HEADER_SIZE + stored_len
            and decode_record_header(head) == (cid, plain_len, stored_len, codec)
            and chunk_id(dst) == cid)


class _Bases:
    """The plain bytes of the delta bases one stream read, up to BASES_CACHED: a base several
    deltas share (a chunk holding pages others repeat, kept once for them all) is read from its
    pack and checked once. Two workers may ask at once: a base read twice is the only cost."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.kept: dict[bytes, bytes] = {}
        self.size = 0

    def __call__(self, cid: bytes) -> bytes:
        plain = self.kept.get(cid)
        if plain is None:
            plain = self.store.read_base(cid)
            self._keep(cid, plain)
        return plain

    def fetch(self, txn: lmdb.Transaction, locs: list[_Loc | None]) -> None:
        """Read the bases the deltas among locs name and that are not kept yet, in pack order
        and adjacent ones with one pread, as a task's own chunks are read: one at a time
        through ``read_base`` they cost a lookup, a pread and the checked slow path each. A
        base not read here (damaged, gone, itself a delta) is left to ``read_base``."""
        if self.size >= BASES_CACHED:
            return
        ids = list({base: None for loc in locs if loc is not None
                    for base in split_base_ids(loc[5]) if base not in self.kept})
        if not ids:
            return
        found = [(loc, cid) for loc, cid in zip(_locations(txn, ids), ids, strict=True)
                 if loc is not None and not loc[5]]
        found.sort(key=lambda lc: (lc[0][0], lc[0][1]))  # pack order: adjacent records, one pread
        plains = _read_records(self.store, [cid for _, cid in found], [loc for loc, _ in found],
                               None)
        for (_, cid), plain in zip(found, plains, strict=True):
            if plain is not None:
                self._keep(cid, plain)

    def _keep(self, cid: bytes, plain: bytes) -> None:
        if self.size < BASES_CACHED:
            self.kept[cid] = plain
            self.size += len(plain)


# (chunk id or None for a hole, entry length, lo, hi): one manifest entry of a stream's task
_Item = tuple[bytes | None, int, int, int]
# (pack, record offset, stored len, plain len, codec, base ids): a decoded index value
_Loc = tuple[int, int, int, int, int, bytes]


def _locations(txn: lmdb.Transaction, ids: list[bytes | None]) -> list[_Loc | None]:
    """The index values of ids (None for a hole, or a value missing or that does not decode:
    ``read_chunk``'s own lookup then names it)."""
    get = txn.get
    unpack = INDEX_VALUE.unpack_from
    locs: list[_Loc | None] = []
    for cid in ids:
        raw = None if cid is None else get(cid)
        locs.append(None if raw is None or len(raw) not in INDEX_VALUE_SIZES else
                    (*unpack(raw), raw[INDEX_VALUE.size :]))
    return locs


def _read_records(store: ChunkStore, ids: list[bytes | None], locs: list[_Loc | None],
                  bases: _Bases | None) -> list[bytes | None]:
    """The checked plain bytes of each chunk, or None where locs has None (a hole has no
    location) or the record cannot be vouched for. Runs of records that follow each other in
    one pack, up to SPAN_MAX, are read with one pread."""
    out: list[bytes | None] = [None] * len(ids)
    dctx = store.dctx
    n = len(ids)
    k = 0
    while k < n:
        loc = locs[k]
        if loc is None:  # a hole, or not in the index
            k += 1
            continue
        pack, first_off = loc[0], loc[1]
        span_end = first_off + HEADER_SIZE + loc[2]
        j = k + 1
        while j < n:
            nxt = locs[j]
            if (nxt is None or nxt[0] != pack or nxt[1] != span_end
                    or span_end + HEADER_SIZE + nxt[2] - first_off > SPAN_MAX):
                break
            span_end += HEADER_SIZE + nxt[2]
            j += 1
        try:
            span = memoryview(store.handles.pread(pack, span_end - first_off, first_off))
        except OSError:
            k = j  # gone or unreadable: each chunk's own read says which
            continue
        for m in range(k, j):
            out[m] = _check_record(ids[m], locs[m], span, first_off, dctx, bases)
        k = j
    return out


def _check_record(cid: bytes, loc: _Loc, span: memoryview, span_off: int,
                  dctx: zstandard.ZstdDecompressor, bases: _Bases | None) -> bytes | None:
    """The plain bytes of the record at loc within span, checked like ``ChunkStore._read_at``
    (header against the index, header crc, length, id); None when anything is off."""
    _, off, stored_len, plain_len, codec, base = loc
    rec = span[off - span_off : off - span_off + HEADER_SIZE + stored_len]
    if len(rec) != HEADER_SIZE + stored_len:
        return None
    if decode_record_header(rec) != (cid, plain_len, stored_len, codec):
        return None
    try:
        return decode_payload(cid, rec[HEADER_SIZE:], codec, plain_len, dctx, bases,
                              base or None)
    except KsfsError:
        return None


def changed_share(old: FileReader, new: FileReader) -> float:
    """The share of new's bytes held in chunks old does not have (holes count as unchanged)."""
    if new.size == 0:
        return 0.0
    have = {cid for cid in old.chunk_ids() if cid is not None}
    changed = sum(length for _, length, cid in new.stored_extents() if cid not in have)
    return changed / new.size
