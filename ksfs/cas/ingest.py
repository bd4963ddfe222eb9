"""Putting files into the store: ``Ingest``, one batch of files that becomes visible at once.

An ingest holds the store lock shared (GC waits), cuts each file into chunks, hashes, skips holes
and chunks the store (in a pack file that is there) or this ingest already has, compresses the
rest on the worker threads and appends them to its own packs. ``seal`` takes the store's seal
lock (held until the ingest closes, so ingests publish one at a time), drops from its packs the
chunks another ingest committed meanwhile (two imports of the same new data keep it once), then
fsyncs and re-reads every record; ``commit(txn)`` writes index entries, pack figures and
manifests into the caller's LMDB write transaction, where the caller also writes its own records.
Nothing an ingest does is visible before that transaction commits, and an abandoned ingest leaves
only unindexed pack bytes, which GC reclaims.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import stat as stat_
import threading
import time
from collections.abc import Callable, Container, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import lmdb
import zstandard

from ksfs.cas import delta, hints, rework
from ksfs.cas import format as fmt
from ksfs.cas.chunking import (
    FIXED_SIZE,
    ZERO_CHUNK,
    Batch,
    FileSource,
    HoleRun,
    changed_spans,
    iter_cdc,
    iter_fixed,
    open_source,
)
from ksfs.cas.flatten import release
from ksfs.cas.packs import (
    TARGET_PACK_BYTES,
    PackWriter,
    decode_payload,
    decompress_payload,
    encode_alone,
)
from ksfs.cas.pagecut import chunk_pages, iter_pages, stream_start
from ksfs.cas.patching import BaseSlots, Patcher
from ksfs.cas.store import list_packs_dir
from ksfs.crashpoints import crash_point
from ksfs.errors import (
    BadInput,
    Busy,
    ChunkCorrupt,
    ChunkMissing,
    IntegrityError,
    KsfsError,
    translate,
)
from ksfs.regularfile import open_lock_file

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore

log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
PAGE_CUTTER = True  # False: memory images go through plain FastCDC too (for the benchmark)
BASES_KEPT = 64 * 1024 * 1024  # plain bytes of delta bases an ingest keeps for its seal
# plain bytes of new chunks it keeps as page homes, apart: a save that changed much never takes
# from the old versions' bases the budget above keeps for later deltas and the seal's verify
HOMES_KEPT = 32 * 1024 * 1024
CHECKED_KEPT = 64 * 1024 * 1024  # stored bytes of new chunks kept, checked, for the seal
DIGEST_PARTS = 8  # parts each batch is digested in, on the store's workers
SURE_DELTA_SHARE = 128  # a delta under 1/128 of its chunk is kept without trying it alone
SEAL_LOCK = "seal.lock"
# How long a seal waits for another ingest's publish; then it seals without the lock (the
# figures stay true, commit still skips what another committed; only the bytes may stay twice)
SEAL_WAIT_S = 120.0
COMMITS = fmt.INGEST_COMMITS  # in cas_meta: how many ingests committed, so a seal with none
# since its ingest began skips looking every new chunk up again
_zeros: dict[int, bytes] = {FIXED_SIZE: ZERO_CHUNK}  # the chunker's own: compared by identity


def _zero(n: int) -> bytes:
    z = _zeros.get(n)
    if z is None:
        z = bytes(n)
        if len(_zeros) < 256:
            _zeros[n] = z
    return z


def _refuse_if_changed(src: Any) -> None:
    """A file that grew, shrank or was written while it was read is refused, whatever its
    chunking: what was read of it is no version the file ever had, and storing the first
    ``size`` bytes of a growing file would cut it at a point nobody chose."""
    change = src.change() if isinstance(src, FileSource) else None
    if change is not None:
        raise BadInput(f"{src.path} changed while it was imported ({change}): import it when "
                       "nothing writes to it, or import a copy")


def _refuse_oversized(batches: Iterator[Batch | HoleRun], src: Any
                      ) -> Iterator[Batch | HoleRun]:
    """The chunker's batches, but a chunk longer than any the store reads back
    (``format.MAX_STORED_LEN``) is an error before it is hashed or written: stored, it would
    make a checkpoint whose file no read, check or GC can use. No chunker cuts one (the page
    cutter stops at ``pagecut.CHUNK_MAX``); this is the guard behind them."""
    for batch in batches:
        for off, data in () if isinstance(batch, HoleRun) else batch:
            if len(data) > fmt.MAX_STORED_LEN:
                what = getattr(src, "path", None) or "a source"
                raise IntegrityError(
                    f"{what}: its chunker cut a chunk of {len(data)} bytes at byte {off}, more "
                    f"than the store reads back ({fmt.MAX_STORED_LEN}): refused before anything "
                    "is published (a ksfs bug: please report it)")
        yield batch


@dataclass(frozen=True)
class IngestedFile:
    """One ingested file. ``stored``: compressed record bytes it was first to bring, as added
    (``Ingest.stored(file)`` after seal and commit leaves out what another ingest committed
    first). ``digest``: ksfs content digest (see ``format.content_digest``), not the b3sum of
    the file."""

    manifest: str
    size: int
    stored: int
    digest: str
    chunking: str
    base_bytes_read: int = 0  # stored bytes of base chunks read back to patch changed ranges
    number: int = -1  # which add_file of its ingest made it (for ``Ingest.stored``)


class Ingest:
    """Invariant: every location in ``new`` lies in a pack this ingest alone appends to."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.level = store.level
        self.new: dict[bytes, fmt.Location] = {}
        # chunks the index lists in a pack file that is gone, stored again: their index value
        # as seen, which commit replaces if it is still the same (re-importing repairs)
        self.replacing: dict[bytes, bytes] = {}
        self._pack_sizes: dict[int, int | None] = {}  # pack number -> its file's size (cached)
        self.manifests: dict[bytes, bytes] = {}  # id -> plain bytes
        self._manifest_values: dict[bytes, bytes] = {}  # id -> as stored (plain, or a delta)
        self.brought: list[list[bytes]] = []  # per add_file: the chunks it stored first
        self.lost: set[bytes] = set()  # stored here, but another ingest committed them first
        self._seal_fd = -1
        self.writers: list[PackWriter] = []
        self.writer: PackWriter | None = None
        self.sealed = True
        self.committed = False
        self._local = threading.local()
        # bases the deltas were made against, checked when read: seal verifies the deltas
        # against these instead of reading every base from its pack again
        self._bases: dict[bytes, bytes] = {}
        self._bases_bytes = 0
        self._homes_bytes = 0
        self._mutex_bases = threading.Lock()
        # Page homes: hash of a 4 KiB page -> a plain chunk holding it that this ingest stores
        # (``_local_bases``) or read as an old version's base, its bytes kept in ``_bases``. A
        # new chunk whose pages repeat those of other chunks (a file's page cache and the tmpfs
        # buffer it was written from; a disk block written back and the page cache that still
        # holds it) is a delta on the chunks holding most of them together with its old
        # version. Keyed by hints.page_key: a collision only proposes a useless base.
        self._homes: dict[int, bytes] = {}
        # the same from the page hints of the versions files are ingested like: plain chunks of
        # earlier checkpoints, read only when chosen (see ksfs.cas.hints)
        self._hinted: dict[int, bytes] = {}
        self._hints: dict[bytes, bytes] = {}  # manifest id -> its page hints, kept at commit
        self._hints_dropped: set[bytes] = set()  # manifest ids whose hints commit deletes
        self._page_keys: dict[bytes, bytes] = {}  # plain chunk stored -> its pages' keys
        self._hinted_bytes = 0
        self._base_pages: dict[bytes, set[int]] = {}  # a base -> its pages' keys (_page_set)
        # The deltas of this ingest, for the seal to make again where a page home found after
        # them serves (ksfs.cas.rework): plain bytes, bases, kind (fixed) and page keys, while
        # HOMES_KEPT allows.
        self._deltas_kept: dict[bytes, tuple[bytes, list[bytes], bool, list[int]]] = {}
        self._deltas_bytes = 0
        self._local_bases: set[bytes] = set()
        # chunk -> the payload a worker decompressed and found equal to the chunk's bytes right
        # after making it (``_keep_checked``): the seal's verify then only compares what the
        # pack holds with these bytes, while CHECKED_KEPT allows
        self._checked: dict[bytes, tuple[int, bytes]] = {}  # chunk -> (codec, payload)
        self._checked_bytes = 0
        # a local base -> its old version's bases and whether it is a fixed chunk
        self._plain_olders: dict[bytes, tuple[list[bytes], bool]] = {}
        self._lock_fd = store.lock(exclusive=False)
        self._commits_seen = self._commits()  # after the lock: no GC runs from here on
        self._mutex = threading.Lock()  # add_file from two threads would interleave packs

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)

    def close(self, failed: bool = False) -> None:
        """Let go of packs and the store lock; unsealed or uncommitted work stays invisible.

        ``failed`` (the block raised) also gives back the bytes this ingest wrote and never
        committed, at once, instead of leaving them for GC: a full disk must not stay full.
        """
        give_back = failed and not self.committed
        for w in self.writers:
            if w.created and (not w.written or give_back):
                try:
                    os.unlink(w.path)
                except OSError:
                    pass
            elif give_back:
                # Nothing references an uncommitted tail, and we hold the pack's flock. Also
                # when no record was appended whole: the first, cut short by a full disk, left
                # its part behind (QA, thirty-fourth session: 4,028 bytes until the next gc).
                try:
                    if os.fstat(w.fd).st_size > w.start:
                        os.ftruncate(w.fd, w.start)
                except OSError:
                    pass
            w.close()
        self.writers = []
        self.writer = None
        if self._seal_fd >= 0:
            os.close(self._seal_fd)
            self._seal_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # --- adding files --------------------------------------------------------------------

    def add_file(self, source: Any, chunking: str = "fixed", base: str | None = None,
                 changed: list[tuple[int, int]] | None = None,
                 progress: Progress | None = None, like: str | None = None,
                 map_source: bool = False) -> IngestedFile:
        """Store one file; its manifest is committed with the ingest.

        ``base`` + ``changed``: an incremental ingest of a fixed-chunked file that differs from
        manifest ``base`` only in the ``changed`` (offset, length) ranges. ``like``: the manifest
        of an earlier version of this file (the same file in the checkpoint before): new chunks
        are stored as deltas against their old versions where that saves bytes (``delta``). An
        incremental ingest uses its base for this. A ``like`` that is missing or cut another way
        only means no deltas. ``map_source``: a path chunked at fixed 64 KiB may be read through
        a mapping (faster; SIGBUS if the file shrinks meanwhile: ``FileSource.mapping``).
        """
        if chunking not in fmt.CHUNKINGS:
            raise BadInput(f"chunking must be 'fixed' or 'cdc', not {chunking!r}")
        if (base is None) != (changed is None):
            raise BadInput("base and changed go together: give both or neither")
        if base is not None and chunking != "fixed":
            raise BadInput("an incremental ingest (base + changed) needs fixed chunking")
        if self._lock_fd < 0:
            raise KsfsError("this ingest is closed; start a new one")
        src, opened = open_source(source, mappable=map_source)
        try:
            with self._mutex:
                self.sealed = False
                return self._add(src, chunking, base, changed, progress, like)
        finally:
            if opened:
                src.close()

    def _add(self, src: Any, chunking: str, base: str | None,
             changed: list[tuple[int, int]] | None, progress: Progress | None,
             like: str | None) -> IngestedFile:
        size = src.size
        if base is None:
            slots: BaseSlots | None = None
            batches = iter_fixed(src) if chunking == "fixed" else self._cdc_batches(src)
            total = size
            ref = self._reference(like, chunking) if like else None
        else:
            slots, ranges = self._slots_from_base(base, size, changed or [])
            total = sum(e - s for s, e in changed_spans(ranges, size))
            patcher = Patcher(self.store, src, slots, keep=self._keep_base)
            batches = patcher.batches(ranges)
            ref = delta.Reference(slots.entries, by_offset=True)
        replaced: dict[int, fmt.Entry] = {}  # slot -> its new entry (incremental)
        if ref is not None:
            self._load_hints(base or like)
        entries = fmt.ManifestBuilder()
        brought: list[bytes] = []
        stored = 0
        done = 0
        base_read = 0
        pipeline = self._pipeline(_refuse_oversized(batches, src), ref, chunking == "fixed")
        try:
            for results in pipeline:
                for off, cid, length, payload in results:
                    if payload is not None and cid not in self.new:
                        codec, data, read_back, stale = payload
                        loc = self._append(cid, data, length, codec)
                        brought.append(cid)
                        if stale is not None:
                            self.replacing[cid] = stale
                        stored += loc.record_len
                        base_read += read_back
                    if slots is None:
                        entries.add(cid, length)
                    else:
                        replaced[off // FIXED_SIZE] = (cid, length)
                    done += length
                if progress is not None:
                    progress(done, total)
        except BadInput:  # a source that ended early: a file cut short under us says so
            _refuse_if_changed(src)
            raise
        finally:
            # On failure too: a chunker holding a view of a mapped source lets go of it here,
            # before add_file closes the source.
            pipeline.close()
            if hasattr(batches, "close"):
                batches.close()
        _refuse_if_changed(src)  # before its manifest is kept: a refused file leaves none
        raw = (fmt.encode_manifest(slots.patched(replaced, size), chunking)
               if slots is not None else entries.encode(chunking))
        info = fmt.decode_manifest(raw)
        if info.size != size:
            raise IntegrityError(f"ingest produced {info.size} bytes of manifest for a "
                                 f"{size}-byte file")
        mid = fmt.manifest_id(raw)
        self.manifests[mid] = raw
        self._manifest_values[mid] = self._manifest_value(raw, base or like)
        self._keep_hints(mid, info, brought)
        self.brought.append(brought)
        crash_point("ingest.file")
        if base is not None:
            base_read += patcher.base_bytes_read
        return IngestedFile(mid.hex(), size, stored, fmt.content_digest(raw), chunking, base_read,
                            len(self.brought) - 1)

    @staticmethod
    def _cdc_batches(src: Any) -> Iterator[Batch | HoleRun]:
        """Memory images (libvirt save images, QEMU streams) are cut at their page records."""
        start = stream_start(src.pread(0, 4096)) if src.size else None
        if start is not None and PAGE_CUTTER:
            return iter_pages(src, start)
        return iter_cdc(src)

    def _reference(self, like: str, chunking: str) -> delta.Reference | None:
        """The earlier version to take delta bases from, or None when it cannot serve."""
        try:
            info = self.store.load_manifest(like)
        except KsfsError:  # gone or damaged: store this file without deltas
            return None
        if info.chunking != chunking:
            return None
        # A 64 KiB chunk's old version is the old one at its offset: found in the manifest's
        # entries by bisection, not in a slot list as long as the file (a sparse 10 TiB disk
        # image would take 160 million slots)
        return delta.Reference(info.entries, by_offset=chunking == "fixed")

    def _slots_from_base(self, base: str, size: int, changed: list[tuple[int, int]]
                         ) -> tuple[BaseSlots, list[tuple[int, int]]]:
        """The base's slots, and the ranges that must be re-read."""
        info = self.store.load_manifest(base)
        if info.chunking != "fixed":
            raise BadInput(f"base manifest {base} was not chunked at fixed 64 KiB")
        slots = BaseSlots(info, base)
        ranges = list(changed)
        if size != info.size:
            # the old last chunk may be short, and everything past the old end is new
            tail = (min(size, info.size) // FIXED_SIZE) * FIXED_SIZE
            ranges.append((tail, max(size, info.size) - tail))
        return slots, ranges

    def _pipeline(self, batches: Iterator[Batch | HoleRun], ref: delta.Reference | None,
                  fixed: bool) -> Iterator[list[tuple[int, bytes | None, int, Any]]]:
        """Hash and compress batch k on the workers while batch k+1 is read."""
        pending: list[Any] | None = None
        for batch in batches:
            if isinstance(batch, HoleRun):  # nothing to hash or store: one hole, in its place
                if pending is not None:
                    yield [r for f in pending for r in f.result()]
                    pending = None
                yield [(batch.start, None, batch.length, None)]
                continue
            futs = self._submit(batch, ref, fixed)
            if pending is not None:
                yield [r for f in pending for r in f.result()]
            pending = futs
        if pending is not None:
            yield [r for f in pending for r in f.result()]

    def _submit(self, batch: list[tuple[int, bytes]], ref: delta.Reference | None,
                fixed: bool) -> list[Any]:
        # In DIGEST_PARTS parts, not one per worker: the new chunks of a save cluster, and a
        # worker given the half without them would wait for the other
        pool = self.store.pool
        step = max(1, -(-len(batch) // DIGEST_PARTS))
        return [pool.submit(self._digest, batch[i:i + step], ref, fixed)
                for i in range(0, len(batch), step)]

    def _digest(self, part: list[tuple[int, bytes]], ref: delta.Reference | None, fixed: bool
                ) -> list[tuple[int, bytes | None, int, Any]]:
        """On a worker: hole or id, and the payload (codec, stored bytes, base bytes read) of
        chunks nobody has yet, as a delta against their old version and the page homes that
        hold their other pages (``_homes_of``), where that is smaller."""
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(level=self.level)
        ids: list[bytes | None] = []
        for _, data in part:
            ids.append(None if data == _zero(len(data)) else fmt.chunk_id(data))
        olds = ref.candidates([off for off, _ in part], ids) if ref else None
        out = []
        bases: dict[bytes, tuple[bytes, int] | None] = {}  # this part's base reads
        with self.store.env.begin(db=self.store.db["chunks"]) as txn:
            for k, (off, data) in enumerate(part):
                cid, n = ids[k], len(data)
                raw = None if cid is None or cid in self.new else txn.get(cid)
                if cid is None or cid in self.new or (raw is not None and
                                                      self._readable(txn, raw)):
                    out.append((off, cid, n, None))
                    continue
                stale = None if raw is None else bytes(raw)
                old = olds[k] if olds else None
                # a chunk stored again stays plain: other deltas may name it as their base
                olders, read_back = ({}, 0) if old in (None, cid) or stale is not None else \
                    self._old_bases(txn, old, bases, fixed)
                # Pages are looked for only in later versions of a file (a reference): a first
                # checkpoint has few repeats, and its import stays as fast as before.
                pages = None if ref is None or stale is not None else chunk_pages(data, fixed)
                keys = [hints.page_key(p) for p in pages] if pages else None
                if keys:
                    chosen, cost = self._homes_of(txn, keys, cid, olders, fixed)
                    read_back += cost
                else:
                    chosen = olders
                diff = None
                if chosen:
                    # the old version's bases last: most matches are there, at short distances
                    diff = fmt.delta_payload(list(chosen), delta.compress(
                        data, b"".join(chosen.values())))
                # A delta under 1/128 of its chunk is kept without compressing the chunk alone
                # to compare: it could lose only to a chunk that compresses to under 1/115 of
                # itself alone, and then by less than that.
                sure = diff is not None and len(diff[1]) <= n // SURE_DELTA_SHARE
                payload = diff if sure else encode_alone(cctx, data)
                if sure or diff is not None and delta.worth_it(len(diff[1]), len(payload[1])):
                    payload = diff
                    if keys and self._deltas_bytes < HOMES_KEPT:
                        with self._mutex_bases:
                            self._deltas_kept[cid] = (data, list(chosen), fixed, keys)
                            self._deltas_bytes += len(data)
                elif keys:
                    # a plain new chunk: a page home here, and for the next version (hints)
                    if self._hinted_bytes < hints.KEPT:
                        self._page_keys[cid] = hints.pack_keys(keys)
                        self._hinted_bytes += 4 * len(keys)
                    if self._keep_base(cid, data, home=True):
                        self._local_bases.add(cid)
                        self._plain_olders[cid] = (list(olders), fixed)
                        for key in keys:
                            self._homes.setdefault(key, cid)
                self._keep_checked(cid, payload, data, chosen)
                out.append((off, cid, n, (*payload, read_back, stale)))
        return out

    def _keep_checked(self, cid: bytes, payload: tuple[int, bytes], data: bytes,
                      bases: dict[bytes, bytes]) -> None:
        """On a worker: decompress a payload just made and, when it gives back ``data`` (the
        bytes whose BLAKE3 is ``cid``), keep it for the seal. The seal then checks the record in
        the pack by comparing bytes, and decompresses only the others: that work is done here
        while the next chunks are cut and hashed, not after the last one (a tenth of a later
        checkpoint's import was the seal's verify; docs/performance.md, thirtieth session).
        A payload that does not decode to ``data`` is left to the seal, which names it."""
        codec, stored = payload
        if self._checked_bytes + len(stored) > CHECKED_KEPT:
            return
        try:
            plain = decompress_payload(cid, stored, codec, len(data), self.store.dctx,
                                       bases.__getitem__)
        except ChunkCorrupt:
            return
        if plain == data:
            with self._mutex_bases:
                self._checked[cid] = (codec, stored)
                self._checked_bytes += len(stored)

    def _homes_of(self, txn: lmdb.Transaction, keys: list[int], cid: bytes,
                  olders: dict[bytes, bytes], fixed: bool) -> tuple[dict[bytes, bytes], int]:
        """({id: plain bytes} of the bases of a new chunk: the page homes (plain chunks this
        ingest stores, read as old versions, or hinted) that hold the most of its pages (their
        ``hints.page_key``: ``keys``), not the chunk itself, then its old version's bases
        (``olders``); stored bytes read for them). Past MAX_BASES the bases holding the fewest
        of its pages are left out, old version's too: a delta's bases pass to its next
        versions, and would fill every place."""
        votes: dict[bytes, int] = {}
        homes, hinted = self._homes, self._hinted
        for key in keys:
            home = homes.get(key) or hinted.get(key)
            if home is not None and home != cid and home not in olders:
                votes[home] = votes.get(home, 0) + 1
        old = list(olders)
        if len(old) + len(votes) > fmt.MAX_BASES:
            mine = set(keys)
            keep = rework.keep_most_pages(
                {b: len(mine & self._page_set(b, fixed, olders[b])) for b in old}, votes)
            old = [b for b in old if b in keep]
            votes = {h: v for h, v in votes.items() if h in keep}
        out, cost = {}, 0
        for home in sorted(votes, key=votes.__getitem__, reverse=True):
            plain = self._bases.get(home)
            if plain is None:  # hinted: read now (gone, damaged or a delta: not a base)
                got = self._read_base(txn, home, None)
                if got is None:
                    continue
                plain, read = got
                cost += read
            out[home] = plain
        for b in old:  # the old version's bases last: most matches are there, at short distances
            out[b] = olders[b]
        return out, cost

    def _page_set(self, base: bytes, fixed: bool, plain: bytes | None = None) -> set[int]:
        """The page keys of plain chunk ``base`` (its bytes read when not given and not kept
        as those of a chunk this ingest stored)."""
        got = self._base_pages.get(base)
        if got is None:
            packed = self._page_keys.get(base)
            if packed is not None:
                got = {k for (k,) in hints.PAGE_KEY.iter_unpack(packed)}
            else:
                got = {hints.page_key(p) for p in chunk_pages(
                    self._base(base) if plain is None else plain, fixed)}
            self._base_pages[base] = got
        return got

    def _load_hints(self, like: str) -> None:
        """Take the page hints kept with ``like`` (see ksfs.cas.hints) as page homes."""
        try:
            key = bytes.fromhex(like)
            with self.store.env.begin(db=self.store.db["cas_meta"]) as txn:
                raw = txn.get(hints.key(key))
                if raw is None:
                    return
                entries = self.store.load_manifest(like, txn).entries
                found = hints.homes(bytes(raw), entries)
        except (ValueError, KsfsError):  # no hints to go by: the deltas are as they were
            return
        for page, cid in found.items():
            self._hinted.setdefault(page, cid)
        self._hints_dropped.add(key)

    def _keep_hints(self, mid: bytes, info: fmt.ManifestInfo, brought: list[bytes]) -> None:
        """Page hints of the plain chunks this file brought, for its next version."""
        keys = self._page_keys
        mine = {cid for cid in brought if cid in keys}
        if not mine:
            return
        chunks = []
        for n, (cid, _) in enumerate(info.entries):
            if cid in mine:
                mine.discard(cid)
                chunks.append((n, keys[cid]))
        if chunks:
            self._hints[mid] = hints.encode(chunks)

    def _readable(self, txn: lmdb.Transaction, raw: bytes) -> bool:
        """Whether an index entry can serve as a dedup hit: its pack file (and its bases', for
        a delta) is there and long enough to hold its record. One whose pack is gone or cut
        short is stored again, so importing the same data repairs the store instead of
        publishing a file that cannot be read. GC, the only one that deletes packs, waits for
        this ingest, so what is there now stays until commit. (Bytes damaged inside a pack are
        not looked for: reading every hit would cost what dedup saves.)"""
        if len(raw) not in fmt.INDEX_VALUE_SIZES:
            return True  # damaged: check names it, as before
        loc = fmt.Location.decode(raw)
        if loc.problem() is not None:
            return True  # its figures cannot be trusted to release: check names it
        if not self._pack_holds(loc):
            return False
        for base in loc.base_ids:
            braw = txn.get(base)
            if braw is None or len(braw) not in fmt.INDEX_VALUE_SIZES or \
                    not self._pack_holds(fmt.Location.decode(braw)):
                return False
        return True

    def _pack_holds(self, loc: fmt.Location) -> bool:
        """Pack ``loc.pack`` is a regular file that reaches the end of ``loc``'s record; one
        lstat per pack per ingest (a pack only grows while this ingest runs)."""
        if loc.pack not in self._pack_sizes:
            try:
                st = os.lstat(os.path.join(self.store.packs_dir, fmt.pack_name(loc.pack)))
                size = st.st_size if stat_.S_ISREG(st.st_mode) else -1
            except FileNotFoundError:
                size = -1
            except OSError:  # cannot tell (EACCES, EIO): trust the index, as before
                size = None
            self._pack_sizes[loc.pack] = size
        size = self._pack_sizes[loc.pack]
        return size is None or loc.offset + loc.record_len <= size

    def _old_bases(self, txn: lmdb.Transaction, old: bytes,
                   bases: dict[bytes, tuple[bytes, int] | None], fixed: bool
                   ) -> tuple[dict[bytes, bytes], int]:
        """({id: plain bytes} of the plain chunks a new version of ``old`` may be a delta on:
        ``old`` itself, or the bases of ``old`` if it is a delta (bases are never deltas: one
        hop); and the stored bytes read for them (each base is charged once). Empty when one
        cannot be read."""
        raw = txn.get(old)
        if raw is None or len(raw) not in fmt.INDEX_VALUE_SIZES:  # damage: stored alone
            return {}, 0
        loc = fmt.Location.decode(raw)
        out, cost = {}, 0
        for base_id in loc.base_ids or (old,):
            if base_id not in bases:
                bases[base_id] = self._read_base(txn, base_id, None if loc.base else loc)
                if bases[base_id] is not None and base_id in self._bases:
                    for key in self._page_set(base_id, fixed, bases[base_id][0]):
                        self._homes.setdefault(key, base_id)
            got = bases[base_id]
            if got is None:
                return {}, 0
            out[base_id] = got[0]
            cost += got[1]
            bases[base_id] = (got[0], 0)
        return out, cost

    def _read_base(self, txn: lmdb.Transaction, base_id: bytes, loc: fmt.Location | None
                   ) -> tuple[bytes, int] | None:
        kept = self._bases.get(base_id)
        if kept is not None:  # the patcher read it already (and counted it)
            return kept, 0
        if loc is None:
            raw = txn.get(base_id)
            loc = None if raw is None or len(raw) not in fmt.INDEX_VALUE_SIZES else \
                fmt.Location.decode(raw)
        if loc is None or loc.codec in fmt.DELTA_CODECS:
            return None
        try:
            plain = self.store.read_chunk(base_id, loc)
        except (ChunkCorrupt, ChunkMissing) as exc:  # damage never stops a save: store it alone
            log.warning("base chunk %s unreadable, storing without a delta: %s",
                        base_id.hex(), exc)
            return None
        self._keep_base(base_id, plain)
        return plain, loc.record_len

    def _keep_base(self, base_id: bytes, plain: bytes, home: bool = False) -> bool:
        """Remember a checked plain base chunk (``home``: a new chunk of this ingest, as a page
        home) for later deltas and for the seal's verify; False when the ingest keeps enough
        of that kind already."""
        if (self._homes_bytes >= HOMES_KEPT) if home else (self._bases_bytes >= BASES_KEPT):
            return False
        with self._mutex_bases:
            if base_id not in self._bases:
                self._bases[base_id] = plain
                if home:
                    self._homes_bytes += len(plain)
                else:
                    self._bases_bytes += len(plain)
        return True

    def _base(self, base_id: bytes) -> bytes:
        plain = self._bases.get(base_id)
        return self.store.read_base(base_id) if plain is None else plain

    def _append(self, cid: bytes, data: bytes, plain_len: int, codec: int) -> fmt.Location:
        w = self.writer
        if w is None or w.size >= TARGET_PACK_BYTES:
            w = self.writer = self._new_writer()
            self.writers.append(w)
        loc = w.append(cid, data, plain_len, codec)
        self.new[cid] = loc
        return loc

    def _new_writer(self) -> PackWriter:
        """Append to the newest pack if it has room and nobody holds it, else start a pack."""
        store = self.store
        packs_db, meta_db = store.db["packs"], store.db["cas_meta"]
        with store.env.begin() as txn:
            cur = txn.cursor(db=packs_db)
            newest = None
            if cur.last():
                newest = (int.from_bytes(cur.key(), "big"),
                          fmt.decode_pack_value(cur.key(), cur.value()))
            next_no = fmt.next_pack(txn, meta_db)
        mine = {w.no for w in self.writers}
        if newest is not None:
            no, (size, _) = newest
            next_no = max(next_no, no + 1)
            if size < TARGET_PACK_BYTES * 0.9 and no not in mine:
                w = PackWriter.try_reopen(store.packs_dir, no, lambda: self._committed_size(no))
                if w is not None:
                    return w
        on_disk = [no for n in list_packs_dir(store.path, store.packs_dir)
                   if (no := fmt.pack_number(n)) is not None]
        next_no = max([next_no, *(n + 1 for n in on_disk)])
        return PackWriter.create(store.packs_dir, next_no)

    def _committed_size(self, no: int) -> int | None:
        """Where pack ``no``'s committed records end, so a reopen may cut what lies past it as
        a crashed ingest's tail; None when that tail cannot be told to be one. Its size figure,
        or past it while the record found there is one the index places there (a figure damage
        made too small). A tail of a crashed ingest starts with a whole record the index does
        not place there; anything else (bytes that are no record header: the figure may point
        into a record) is left for gc, which knows where every indexed record ends. One header
        read and one lookup when the figure is right."""
        db = self.store.db
        with self.store.env.begin() as txn:
            raw = txn.get(fmt.pack_key(no), db=db["packs"])
            size = fmt.decode_pack_value(fmt.pack_key(no), raw)[0] if raw else 0
            path = os.path.join(self.store.packs_dir, fmt.pack_name(no))
            with translate("read pack", path):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    while True:
                        raw_head = os.pread(fd, fmt.HEADER_SIZE, size)
                        if not raw_head:
                            return size
                        head = fmt.decode_record_header(raw_head)
                        if isinstance(head, str):
                            return None
                        placed = txn.get(head[0], db=db["chunks"])
                        loc = None if placed is None or len(placed) not in \
                            fmt.INDEX_VALUE_SIZES else fmt.Location.decode(placed)
                        if loc is None or (loc.pack, loc.offset) != (no, size) or \
                                loc.problem() is not None:
                            return size
                        size += loc.record_len
                finally:
                    os.close(fd)

    # --- sealing and committing ----------------------------------------------------------

    def stored(self, f: IngestedFile) -> int:
        """The record bytes file ``f`` (of this ingest) brought that the ingest keeps: after
        seal and commit, what no other ingest committed first (the truthful ``stored``)."""
        return sum(self.new[c].record_len for c in self.brought[f.number]
                   if c in self.new and c not in self.lost)

    def seal(self) -> None:
        """Take the seal lock, drop the chunks another ingest committed meanwhile, fsync every
        pack written, then re-read, decompress and re-hash every new chunk."""
        self._seal(locked=True)

    def _seal(self, locked: bool) -> None:
        with self._mutex:
            if locked and self._seal_fd < 0 and self._lock_fd >= 0:
                self._seal_fd = self._take_seal_lock()
            self._drop_committed()
            # The packs as they stand are fsynced (on a thread of its own: rework's deltas take
            # the store's two workers) while rework works out what to store again; the records
            # it replaces then cost a second, short fsync.
            with ThreadPoolExecutor(1, thread_name_prefix="ksfs-seal-fsync") as fsyncing:
                synced = fsyncing.submit(self._sync_packs)
                plan = rework.plan(self)
                synced.result()
            rework.apply(self, plan)
            self._store_orphans_whole()
            self._sync_packs()
            for w in self.writers:
                w.verify(self.store.dctx, self.store.run_split, self._base, self._checked)
            self._checked = {}  # verified: their bytes need not be held any more
            self._checked_bytes = 0
            self.sealed = True

    def _sync_packs(self) -> None:
        for w in self.writers:
            if w.written and not w.synced:
                w.sync()

    def commit(self, txn: lmdb.Transaction) -> None:
        """Write index entries, pack figures and manifests into the caller's write txn.

        Must run inside the ``with store.ingest()`` block: once the lock is released a GC may
        take the unindexed pack bytes.
        """
        if self._lock_fd < 0:
            raise KsfsError("commit must happen inside the 'with store.ingest()' block")
        if not self.sealed:
            # inside the caller's write transaction: waiting here for an ingest that waits for
            # that transaction would never end, so this seal goes without the lock
            self._seal(locked=False)
        db = self.store.db
        added: dict[int, int] = {}
        try:
            for cid, loc in self.new.items():
                if self._index(txn, cid, loc):
                    added[loc.pack] = added.get(loc.pack, 0) + loc.record_len
                else:
                    self.lost.add(cid)  # committed by another ingest since our seal
            self._refuse_delta_bases(txn)
            top = 0
            for w in self.writers:
                top = max(top, w.no)
                if not w.written:
                    continue
                key = fmt.pack_key(w.no)
                raw = txn.get(key, db=db["packs"])
                size, live = fmt.decode_pack_value(key, raw) if raw else (0, 0)
                txn.put(key, fmt.PACK_VALUE.pack(max(size, w.end), live + added.get(w.no, 0)),
                        db=db["packs"])
            if top and top + 1 > fmt.next_pack(txn, db["cas_meta"]):
                txn.put(fmt.NEXT_PACK, str(top + 1).encode(), db=db["cas_meta"])
            for mid, value in self._manifest_values.items():
                self._put_manifest(txn, mid, value)
            for mid in self._hints_dropped - self._hints.keys():
                txn.delete(hints.key(mid), db=db["cas_meta"])
            for mid, raw in self._hints.items():
                txn.put(hints.key(mid), raw, db=db["cas_meta"])
            count = txn.get(COMMITS, db=db["cas_meta"])
            txn.put(COMMITS, str(fmt.meta_int(count, "ingest_commits") + 1).encode(),
                    db=db["cas_meta"])
        except lmdb.Error as exc:
            from ksfs.cas.store import _lmdb_error

            raise _lmdb_error("commit the ingest", self.store.path, exc) from exc
        crash_point("index.commit")
        self.committed = True

    def _manifest_value(self, raw: bytes, like: str | None) -> bytes:
        """How to store manifest ``raw``: as a delta on the plain manifest that ``like`` (the
        same file's earlier version) is, or is a delta on; else plain."""
        if like is None:
            return raw
        try:
            like_id = bytes.fromhex(like)
        except ValueError:
            return raw
        with self.store.env.begin(db=self.store.db["manifests"]) as txn:
            value = txn.get(like_id)
            base_id = None if value is None else (fmt.manifest_base(value) or like_id)
            base = None if base_id is None else txn.get(base_id)
            if base is None or fmt.manifest_base(base) is not None or \
                    fmt.manifest_id(base) != base_id:
                return raw  # damage: check names it; this manifest does not lean on it
            return delta.manifest_delta(raw, base_id, bytes(base)) or raw

    def _put_manifest(self, txn: lmdb.Transaction, mid: bytes, value: bytes) -> None:
        """Store a manifest, unless the store holds it intact already: other manifests may be
        deltas on that value, which must stay plain. A damaged one is replaced by the plain
        bytes, so importing the same file again repairs it and every delta on it."""
        mdb = self.store.db["manifests"]
        old = txn.get(mid, db=mdb)
        if old is not None:
            try:
                delta.expand_manifest(mid, old, lambda b: txn.get(b, db=mdb))
                return
            except IntegrityError:
                pass
            value = self.manifests[mid]
        txn.put(mid, value, db=mdb)

    def _refuse_delta_bases(self, txn: lmdb.Transaction) -> None:
        """Busy (exit 8) where a base of this ingest's deltas was committed since the seal by
        another ingest as a delta (only when the seal went without the lock, two imports of the
        same new data at once): read, ours would take two hops. The caller's transaction aborts,
        nothing is published; the import can run again."""
        for cid, loc in self.new.items():
            if cid in self.lost:
                continue
            for base in loc.base_ids:
                if base not in self.lost:
                    continue
                raw = txn.get(base, db=self.store.db["chunks"])
                if raw is not None and len(raw) in fmt.INDEX_VALUE_SIZES and \
                        fmt.Location.decode(raw).codec not in fmt.DELTA_CODECS:
                    continue
                raise Busy(f"another import stored chunk {base.hex()} at the same moment, in a "
                           "form this import cannot build on: nothing was published; import "
                           "again")

    def _take_seal_lock(self) -> int:
        """The store's seal lock (fd), held until close: ingests seal and publish one at a
        time, so each sees what the one before committed. -1 after SEAL_WAIT_S."""
        path = os.path.join(self.store.path, SEAL_LOCK)
        try:
            # (a directory, symlink or FIFO in its place is damage, exit 6: QA, one there
            # made every ingest seal alone, unsaid, and a symlink was followed)
            fd = open_lock_file(path, self.store.path, os.O_RDWR, 0o600)
        except OSError as exc:  # no lock, no worse than before it: commit still dedups
            log.info("sealing without the seal lock %s: %s", path, exc)
            return -1
        deadline = time.monotonic() + SEAL_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or \
                        time.monotonic() >= deadline:
                    log.info("sealing without the seal lock %s: %s", path, exc)
                    os.close(fd)
                    return -1
            time.sleep(0.02)

    def _commits(self) -> bytes | None:
        with self.store.env.begin(db=self.store.db["cas_meta"]) as txn:
            raw = txn.get(COMMITS)
        return None if raw is None else bytes(raw)

    def _drop_committed(self) -> None:
        """Take out of our packs the chunks another ingest committed since we stored them
        (two imports of the same new data at once): the index keeps theirs, and ours would be
        dead bytes. Our records past each writer's start are ours alone and not yet fsynced or
        indexed, so the ones we keep are moved down over the gaps and the file cut."""
        now = self._commits()
        if not self.new or now == self._commits_seen:
            return  # no ingest committed since ours began: nothing to look up
        self._commits_seen = now  # chunks added after this lookup saw those commits
        chunks = self.store.db["chunks"]
        with self.store.env.begin(db=chunks) as txn:
            for cid in self.new:
                now = txn.get(cid)
                if now is not None and bytes(now) != self.replacing.get(cid):
                    self.lost.add(cid)
        if not self.lost:
            return
        for w in self.writers:
            if any(cid in self.lost for cid, _ in w.written):
                self._compact(w, self.lost)
        for cid in self.lost:
            self.new.pop(cid, None)
            self.replacing.pop(cid, None)

    def _orphan(self, loc: fmt.Location) -> bool:
        """A delta whose base was to be a chunk of this ingest that is not here as a plain
        record: another ingest committed it first (it may be a delta there), or a copy of it
        on another worker was stored as a delta."""
        for base in loc.base_ids:
            if base in self._local_bases:
                here = self.new.get(base)
                if here is None or here.codec in fmt.DELTA_CODECS:
                    return True
        return False

    def _store_orphans_whole(self) -> None:
        """Store each orphan delta (``_orphan``) whole instead: bases are never deltas."""
        orphans = {cid: loc for cid, loc in self.new.items() if self._orphan(loc)}
        if not orphans:
            return
        plain = {}
        for w in self.writers:
            for cid, loc in w.written:
                if cid in orphans:
                    with translate("read pack", w.path):
                        raw = os.pread(w.fd, loc.record_len, loc.offset)
                    plain[cid] = decode_payload(cid, raw[fmt.HEADER_SIZE :], loc.codec,
                                                loc.plain_len, self.store.dctx, self._base)
            if any(cid in orphans for cid, _ in w.written):
                self._compact(w, orphans.keys())
        cctx = zstandard.ZstdCompressor(level=self.level)
        for cid, data in plain.items():
            codec, stored = encode_alone(cctx, data)
            self._append(cid, stored, len(data), codec)

    def _compact(self, w: PackWriter, drop: Container[bytes]) -> None:
        with translate("compact pack", w.path):
            raw = os.pread(w.fd, w.end - w.start, w.start)
            if len(raw) != w.end - w.start:
                raise IntegrityError(f"pack {w.path} is shorter than what was just written "
                                     "to it")
            pos = w.start
            kept = []
            for cid, loc in w.written:
                if cid in drop:
                    continue
                if loc.offset != pos:  # pos only trails offset: the bytes read are the old ones
                    rec = raw[loc.offset - w.start : loc.offset - w.start + loc.record_len]
                    if os.pwrite(w.fd, rec, pos) != len(rec):
                        raise OSError(errno.EIO, "short write to pack", w.path)
                    loc = dataclasses.replace(loc, offset=pos)
                    self.new[cid] = loc
                kept.append((cid, loc))
                pos += loc.record_len
            os.ftruncate(w.fd, pos)
        w.written = kept
        w.end = pos
        w.synced = False

    def _index(self, txn: lmdb.Transaction, cid: bytes, loc: fmt.Location) -> bool:
        """Point the index at a new record; False where another ingest indexed the chunk first.
        A chunk stored again over an entry whose pack was gone replaces that entry, unless
        another ingest replaced it meanwhile; the old record's bytes leave its pack's figure."""
        chunks = self.store.db["chunks"]
        stale = self.replacing.get(cid)
        if stale is None:
            return txn.put(cid, loc.encode(), db=chunks, overwrite=False)
        now = txn.get(cid, db=chunks)
        if now is not None and bytes(now) != stale:
            return False
        txn.put(cid, loc.encode(), db=chunks)
        if now is not None:
            old = fmt.Location.decode(stale)
            release(txn, self.store, {old.pack: old.record_len})
        return True
