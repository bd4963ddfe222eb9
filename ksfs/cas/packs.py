"""Pack files: append-only files of chunk records, and the shared read handles over them.

A ``PackWriter`` owns one pack while an ingest or a repack appends to it: it holds the pack's
flock so no other writer appends beside it, cuts the file back to its committed size before the
first append (bytes past it belong to an ingest that never committed), fsyncs file and directory,
and re-reads every record it wrote. It never appends to a pack shorter than its committed size:
that file was cut, and the records the index places past its end are for check to name. It
never touches the index: what it wrote becomes visible only when the caller commits the
locations it returns.

``PackHandles`` keeps read fds open, counted, so a pack that GC unlinks stays readable to a
reader already inside it (Linux keeps the inode while an fd is open).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import zstandard

from ksfs.cas import delta
from ksfs.cas import format as fmt
from ksfs.crashpoints import crash_point
from ksfs.errors import ChunkCorrupt, ChunkMissing, IntegrityError, translate

TARGET_PACK_BYTES = 32 * 1024 * 1024
PRUNE_EVERY_S = 1.0  # how often readers drop fds of packs another process's GC unlinked


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_alone(cctx: zstandard.ZstdCompressor, plain: bytes) -> tuple[int, bytes]:
    """(codec, stored bytes) of a chunk stored on its own: zstd, or raw when zstd does not
    shrink it."""
    comp = cctx.compress(plain)
    return (fmt.CODEC_ZSTD, comp) if len(comp) < len(plain) else (fmt.CODEC_RAW, plain)


Bases = Callable[[bytes], bytes]  # base chunk id -> its plain bytes, checked (ChunkStore.read_base)


def decode_payload(cid: bytes, payload: bytes | memoryview, codec: int, plain_len: int,
                   dctx: zstandard.ZstdDecompressor, bases: Bases | None = None,
                   index_base: bytes | None = None) -> bytes:
    """Decompress a record's payload and check it against its id; ChunkCorrupt if it differs.

    A delta's bases are fetched through ``bases``; a base that cannot be read makes the delta
    unreadable too, reported as this chunk's damage naming the base. ``index_base``: the bases
    the index names for this chunk, which the record must name too (GC keeps the index's).
    """
    if index_base is not None:
        named = fmt.delta_bases(payload, codec) if codec in fmt.DELTA_CODECS else None
        if named is None or named[0] != index_base:
            raise ChunkCorrupt(chunk=cid.hex(),
                               why="its record names another base than the index")
    plain = decompress_payload(cid, payload, codec, plain_len, dctx, bases)
    if len(plain) != plain_len:
        raise ChunkCorrupt(chunk=cid.hex(), why="its plain length differs from the index")
    if fmt.chunk_id(plain) != cid:
        raise ChunkCorrupt(chunk=cid.hex(), why="its bytes do not hash to its id")
    return plain


def decompress_payload(cid: bytes, payload: bytes | memoryview, codec: int, plain_len: int,
                       dctx: zstandard.ZstdDecompressor, bases: Bases | None = None) -> bytes:
    """A record's payload decompressed, not yet checked against its id (``decode_payload``
    does that); ChunkCorrupt where it cannot be decompressed."""
    if codec in fmt.DELTA_CODECS:
        named = fmt.delta_bases(payload, codec)
        if bases is None or named is None:
            raise ChunkCorrupt(chunk=cid.hex(), why="a delta record without its base")
        ids, start = named
        dictionary = []
        for base_id in fmt.split_base_ids(ids):
            try:
                dictionary.append(bases(base_id))
            except (ChunkCorrupt, ChunkMissing) as exc:
                why = exc.fields.get("why") or str(exc)
                raise ChunkCorrupt(chunk=cid.hex(), why=f"its base chunk {base_id.hex()} is "
                                   f"unreadable: {why}") from None
        plain = delta.decompress(cid, payload[start:], b"".join(dictionary), plain_len)
    elif codec == fmt.CODEC_ZSTD:
        try:
            plain = dctx.decompress(payload, max_output_size=plain_len)
        except zstandard.ZstdError as exc:
            raise ChunkCorrupt(chunk=cid.hex(), why=f"zstd cannot decompress it: {exc}") from None
    else:
        plain = bytes(payload)
    return plain


class PackWriter:
    """Appends records to one pack. Invariant: bytes past ``start`` are this writer's alone."""

    def __init__(self, packs_dir: str, no: int, fd: int, start: int, created: bool) -> None:
        self.packs_dir = packs_dir
        self.no = no
        self.fd = fd
        self.start = start
        self.end = start
        self.created = created
        self.written: list[tuple[bytes, fmt.Location]] = []
        self.synced = False

    @classmethod
    def create(cls, packs_dir: str, first_no: int) -> PackWriter:
        """Make a new pack numbered first_no or above (O_EXCL, so racing writers never share)."""
        no = first_no
        while True:
            path = os.path.join(packs_dir, fmt.pack_name(no))
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                no += 1
                continue
            except OSError:
                with translate("create pack", path):
                    raise
            fcntl.flock(fd, fcntl.LOCK_EX)
            return cls(packs_dir, no, fd, 0, True)

    @classmethod
    def try_reopen(cls, packs_dir: str, no: int, committed: Callable[[], int | None]
                   ) -> PackWriter | None:
        """Take over an existing pack to append to it, or None if another writer holds it,
        ``committed()`` (where its committed records end) is None, or its file is shorter.

        Bytes past the committed size are a crashed ingest's, never indexed: they are cut off.
        A file shorter than that was cut (a truncation, a file system that lost its end): it
        is left as it is, so check goes on calling the records it lost "cut short", and the
        caller starts a new pack. (Padding it back to its size with zeros, as this once did,
        turned those findings into bad record headers, and to a later ingest's dedup the pack
        then looked long enough to hold the records it lost, so importing a good copy again no
        longer repaired them.)
        """
        path = os.path.join(packs_dir, fmt.pack_name(no))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            # Only a file of this one name is appended to: through a symbolic or hard link
            # planted here (in a store its user writes, root running ksfs) root would append
            # records to whatever file it names; a FIFO would never take them.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise OSError(errno.EINVAL, "not a pack file of one name", path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        try:
            size = committed()  # read only now: the last holder committed before letting go
            with translate("truncate pack", path):
                on_disk = os.fstat(fd).st_size
                if size is not None and on_disk > size:
                    os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if size is None or on_disk < size:
            os.close(fd)
            return None
        return cls(packs_dir, no, fd, size, False)

    @property
    def path(self) -> str:
        return os.path.join(self.packs_dir, fmt.pack_name(self.no))

    def append(self, cid: bytes, stored: bytes, plain_len: int, codec: int) -> fmt.Location:
        header = fmt.encode_record_header(cid, plain_len, len(stored), codec)
        crash_point("pack.write")
        with translate("write pack", self.path):
            n = os.pwritev(self.fd, [header, stored], self.end)
            want = len(header) + len(stored)
            while n < want:
                # A short write (a full disk, mostly): write the rest, so the call that fails
                # raises the real reason (ENOSPC becomes NoSpace) instead of a vague EIO.
                m = os.pwrite(self.fd, (header + stored)[n:], self.end + n)
                if m <= 0:
                    raise OSError(errno.EIO, "short write to pack", self.path)
                n += m
        named = fmt.delta_bases(stored, codec) if codec in fmt.DELTA_CODECS else None
        base = None if named is None else named[0]
        loc = fmt.Location(self.no, self.end, len(stored), plain_len, codec, base)
        self.end += n
        self.written.append((cid, loc))
        self.synced = False
        return loc

    @property
    def size(self) -> int:
        return self.end

    def sync(self) -> None:
        crash_point("pack.fsync")
        with translate("fsync pack", self.path):
            os.fsync(self.fd)
            if self.created:
                fsync_dir(self.packs_dir)
        self.synced = True

    def verify(self, dctx: zstandard.ZstdDecompressor,
               run: Callable[[Callable[[list], None], list], None] | None = None,
               bases: Bases | None = None,
               checked: Mapping[bytes, tuple[int, bytes]] | None = None
               ) -> None:
        """Re-read every record this writer appended and check it decompresses to its id.

        ``checked``: (codec, payload) of chunks already decompressed and found to give their
        bytes (``Ingest._keep_checked``); a record whose header, codec and payload are those is
        not decompressed again."""
        if not self.written:
            return
        with translate("re-read pack", self.path):
            raw = os.pread(self.fd, self.end - self.start, self.start)
        if len(raw) != self.end - self.start:
            raise IntegrityError(f"pack {self.path} is shorter than what was just written to it")
        jobs = []
        for cid, loc in self.written:
            rec = raw[loc.offset - self.start : loc.offset - self.start + loc.record_len]
            jobs.append((cid, loc, rec))

        def check(part: list) -> None:
            d = zstandard.ZstdDecompressor()
            for cid, loc, rec in part:
                head = fmt.decode_record_header(rec[: fmt.HEADER_SIZE])
                if isinstance(head, str) or head[0] != cid:
                    raise ChunkCorrupt(chunk=cid.hex(), why=f"re-read after write: {head!r:.60}")
                payload = rec[fmt.HEADER_SIZE :]
                if checked is not None and head == (cid, loc.plain_len, loc.stored_len,
                                                    loc.codec) and \
                        checked.get(cid) == (loc.codec, payload):
                    continue
                decode_payload(cid, payload, loc.codec, loc.plain_len, d, bases)

        if run is None:
            check(jobs)
        else:
            run(check, jobs)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the flock
            self.fd = -1


class _Handle:
    __slots__ = ("dead", "fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.dead = False


class PackHandles:
    """Counted read-only fds of packs, at most ``limit`` idle ones kept open."""

    def __init__(self, packs_dir: str, limit: int = 64) -> None:
        self.packs_dir = packs_dir
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _Handle] = OrderedDict()
        self._pruned = time.monotonic()

    def pread(self, no: int, n: int, offset: int) -> bytes:
        """Read from pack ``no``; FileNotFoundError if the pack is gone (GC moved its chunks)."""
        if n > fmt.MAX_STORED_LEN + fmt.HEADER_SIZE:  # a damaged length, not one to allocate
            raise OSError(errno.EINVAL, f"a read of {n} bytes is more than any record",
                          os.path.join(self.packs_dir, fmt.pack_name(no)))
        return self._on_fd(no, os.pread, n, offset)

    def preadv(self, no: int, buffers: list, offset: int) -> int:
        """Read from pack ``no`` straight into buffers; the byte count, as ``os.preadv``."""
        return self._on_fd(no, os.preadv, buffers, offset)

    def _on_fd(self, no: int, call: Callable[..., Any], *args: Any) -> Any:
        offset = args[-1]
        if not 0 <= offset <= fmt.MAX_PACK_OFFSET:  # a damaged index value: no pack is that big
            raise OSError(errno.EINVAL, f"offset {offset} lies past any pack",
                          os.path.join(self.packs_dir, fmt.pack_name(no)))
        h = self._acquire(no)
        try:
            return call(h.fd, *args)
        finally:
            self._release(h)

    def _acquire(self, no: int) -> _Handle:
        with self._lock:
            if time.monotonic() - self._pruned > PRUNE_EVERY_S:
                self._prune_unlinked()
            h = self._open.get(no)
            if h is not None:
                self._open.move_to_end(no)
                h.users += 1
                return h
        path = os.path.join(self.packs_dir, fmt.pack_name(no))
        # O_NONBLOCK: a FIFO planted as a pack must not hold the read until a writer comes
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "the pack is not a regular file", path)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            h = self._open.get(no)
            if h is None:
                h = _Handle(fd)
                self._open[no] = h
            else:
                os.close(fd)
            h.users += 1
            while len(self._open) > self.limit:
                old_no, old = next(iter(self._open.items()))
                del self._open[old_no]
                self._retire(old)
            return h

    def _release(self, h: _Handle) -> None:
        with self._lock:
            h.users -= 1
            if h.dead and h.users == 0:
                os.close(h.fd)

    def _retire(self, h: _Handle) -> None:
        h.dead = True
        if h.users == 0:
            os.close(h.fd)

    def _prune_unlinked(self) -> None:
        """Retire fds of packs another process (a ``ksfs gc``) unlinked: ``forget`` only runs
        in the process that deleted them, and an idle fd would pin the pack's disk space."""
        self._pruned = time.monotonic()
        for no, h in list(self._open.items()):
            try:
                gone = os.fstat(h.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                del self._open[no]
                self._retire(h)

    def forget(self, no: int) -> None:
        """Drop the fd of a pack GC deleted, so its space is freed once no reader is inside."""
        with self._lock:
            h = self._open.pop(no, None)
            if h is not None:
                self._retire(h)

    def close(self) -> None:
        with self._lock:
            for h in self._open.values():
                self._retire(h)
            self._open.clear()
