"""Cutting a source file into chunks: fixed 64 KiB for disk images, FastCDC for the rest.

Chunkers read the source and yield batches of ``(offset, bytes)``; they never hash, compress or
write, and never decide what is a hole (the ingest does, on the worker threads). Both skip the
ranges the file system says hold no data (``_extents``), handing them on as zeros unread. The
CDC cutter is pyfastcdc's compiled module only: its pure-Python fallback is some 200x slower, so
when only the fallback loads we refuse with ChunkerUnavailable rather than crawl.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat as stat_
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from ksfs.errors import BadInput, ChunkerUnavailable, translate

FIXED_SIZE = 64 * 1024  # the qcow2 cluster: an incremental checkpoint replaces whole clusters
CDC_MIN = 4 * 1024  # tuned by tools/bench-store: memory images change in 4 KiB pages
CDC_AVG = 16 * 1024  # pyfastcdc cuts at about min + avg = 20 KiB on average
CDC_MAX = 64 * 1024
BATCH_BYTES = 8 * 1024 * 1024  # read this much per batch: big sequential reads, bounded memory

Batch = list[tuple[int, bytes]]
ZERO_CHUNK = bytes(FIXED_SIZE)


class Source(Protocol):
    size: int

    def pread(self, offset: int, n: int) -> bytes: ...


class FileSource:
    """A regular file opened for reading; ``size`` is taken once at open. ``mappable``: fixed
    chunking may read it through a mapping (see ``mapping``)."""

    def __init__(self, path: str | os.PathLike[str], mappable: bool = False) -> None:
        with translate("open source file", path):
            # O_NONBLOCK: a FIFO would block the open until a writer came
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                st = os.fstat(self.fd)
                if not stat_.S_ISREG(st.st_mode):
                    # a device, FIFO or directory: its size says nothing of what reads give
                    raise BadInput(f"{os.fspath(path)} is not a regular file: only regular "
                                   "files are imported")
                fcntl.fcntl(self.fd, fcntl.F_SETFL,
                            fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            except BaseException:
                os.close(self.fd)
                raise
        self.size = st.st_size
        self._times_ns = (st.st_mtime_ns, st.st_ctime_ns)
        self.path = os.fspath(path)
        self._map: mmap.mmap | None = None
        self._unmappable = not mappable
        self.lease_broken = False  # another process opened the file to write or truncate it

    def pread(self, offset: int, n: int) -> bytes:
        with translate("read source file", self.path):
            return os.pread(self.fd, n, offset)

    def change(self) -> str | None:
        """How the file changed since it was opened (its size, or its modification time for
        bytes rewritten in place), or None. What was read of a changing file is no version the
        file ever had as a whole."""
        with translate("stat source file", self.path):
            st = os.fstat(self.fd)
        if self.lease_broken and st.st_size == self.size:
            return "another process opened it to write to it"
        if st.st_size != self.size:
            return f"{self.size} bytes when its import began, {st.st_size} now"
        # ctime too: it moves with every write and cannot be set back (an mtime can, by utime)
        if (st.st_mtime_ns, st.st_ctime_ns) != self._times_ns:
            return "it was written to"
        return None

    def mapping(self) -> mmap.mmap | None:
        """The file mapped read-only (made once), or None where it cannot be mapped.

        A disk image is mostly zeros: scanning them in the page cache through a mapping skips
        copying every byte into a buffer first (a third of an import's disk time). The price: a
        file truncated by another process (or failing with an I/O error) while it is read kills
        the reading process with SIGBUS, where pread would fail cleanly. So only a process that
        is nothing but this one import asks for it (``ksfs import``, not the daemon that also
        serves the mount); see docs/limits.md.
        """
        if self._map is None and self.size and not self._unmappable:
            self._unmappable = True  # tried once
            if not _take_lease(self):
                return None
            try:
                self._map = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
                self._map.madvise(mmap.MADV_SEQUENTIAL)  # read ahead when not in page cache
            except (OSError, ValueError, OverflowError):  # a pipe, /proc, 2 GiB on 32 bits
                self._map = None
                self.unmap()
        return self._map

    def unmap(self) -> None:
        """Drop the mapping, then the lease, which lets a writer waiting on it go on (the
        chunker's views must be released first)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a chunker's view outlived this (an error in flight): GC unmaps
                pass
            self._map = None
        if _leases.pop(self.fd, None) is not None:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass

    def close(self) -> None:
        self.unmap()
        os.close(self.fd)


# The mapping is read only under a read lease (fcntl F_SETLEASE): a process that opens the file
# to write or truncates it then waits (up to /proc/sys/fs/lease-break-time, 45 s) until the
# lease is given back, and SIGIO tells us; the chunker drops the mapping at its next batch and
# goes on with pread, which sees the change, so a file cut short is an error line, not SIGBUS
# on a page past its new end. No lease (someone has it open for writing already, another
# user's file, a file system without leases, not the main thread): no mapping.
_leases: dict[int, FileSource] = {}


def _on_lease_break(signum: int, frame: Any) -> None:
    for src in list(_leases.values()):
        src.lease_broken = True


def _take_lease(src: FileSource) -> bool:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False  # signal handlers are set in the main thread only
    current = signal.getsignal(signal.SIGIO)
    if current is not _on_lease_break:
        if current != signal.SIG_DFL:
            return False  # SIGIO is someone else's
        signal.signal(signal.SIGIO, _on_lease_break)
    try:
        fcntl.fcntl(src.fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        return False
    _leases[src.fd] = src
    return True


def open_source(source: Any, mappable: bool = False) -> tuple[Source, bool]:
    """Return (source, opened_here): a path becomes a FileSource the caller must close."""
    if isinstance(source, str | bytes | os.PathLike):
        return FileSource(source, mappable), True
    if not hasattr(source, "size") or not hasattr(source, "pread"):
        raise BadInput("a source must be a path or have .size and .pread(offset, n)")
    return source, False


def read_exact(source: Source, offset: int, n: int) -> bytes:
    """Read n bytes at offset, looping over short reads; a source that ends early is an error."""
    data = source.pread(offset, n)
    if len(data) == n:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = source.pread(offset + got, n - got)
        if not more:
            what = getattr(source, "path", None) or "the source"
            raise BadInput(f"{what} ended at byte {offset + got}, before the {source.size} bytes "
                           "its size says (a file the kernel makes as it is read, as in /proc "
                           "or /sys, cannot be imported: import a copy)")
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def load_fastcdc() -> Any:
    """The compiled FastCDC class, or ChunkerUnavailable."""
    try:
        with warnings.catch_warnings():
            # the package warns (two lines) when only its fallback loads: ours is the one line
            warnings.simplefilter("ignore")
            from pyfastcdc.cy import FastCDC
    except ImportError as exc:
        raise ChunkerUnavailable(
            "pyfastcdc's compiled chunker (pyfastcdc.cy) cannot be imported, and its pure-Python "
            f"fallback is far too slow to use: reinstall pyfastcdc with its wheel ({exc})"
        ) from exc
    return FastCDC


def iter_fixed(
    source: Source, ranges: Iterable[tuple[int, int]] | None = None
) -> Iterator[Batch | HoleRun]:
    """Yield batches of 64 KiB chunks (the last one may be short), all of them or only those
    overlapping ``ranges``."""
    size = source.size
    if ranges is None:
        spans = [(0, size)]
    else:
        spans = changed_spans(ranges, size)
    mapping = source.mapping() if isinstance(source, FileSource) else None
    view = memoryview(mapping) if mapping is not None else None
    try:
        for start, end in spans:
            for lo, hi, is_data in _extents(source, start, end):
                if not is_data:
                    yield HoleRun(lo, hi - lo)  # unread
                    continue
                for pos in range(lo, hi, BATCH_BYTES):
                    n = min(BATCH_BYTES, hi - pos)
                    if view is not None and source.lease_broken:  # type: ignore[union-attr]
                        # a writer waits on our lease: let it go, read on with pread
                        view.release()
                        view = None
                        source.unmap()  # type: ignore[union-attr]
                    # mapped: the page cache itself, nothing copied but the chunks kept below
                    batch = _fixed_batch(view[pos : pos + n], pos) if view is not None else \
                        _fixed_batch(memoryview(read_exact(source, pos, n)), pos)
                    yield batch  # no view of the mapping held while suspended here
    finally:
        if view is not None:
            view.release()


def _extents(source: Source, start: int, end: int) -> Iterator[tuple[int, int, bool]]:
    """(lo, hi, is_data) pieces of [start, end) in order, on 64 KiB boundaries (but the file's
    end): where the file system says a range of a sparse file holds no data (SEEK_DATA,
    SEEK_HOLE), it is not read at all, so an 8 GiB image with 3 MiB written costs 3 MiB of
    reads, not 8 GiB of zeros paged in and compared. Anything else is all data."""
    if not isinstance(source, FileSource):
        yield start, end, True
        return
    fd = source.fd
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data from pos to the end of the file
                yield pos, end, False
                return
            yield pos, end, True  # the file system cannot tell: read it all
            return
        lo = max(pos, min(end, data - data % FIXED_SIZE))  # the chunk the data starts in
        if lo > pos:
            yield pos, lo, False
        if data >= end:
            return
        try:
            hole = os.lseek(fd, data, os.SEEK_HOLE)  # from the data itself, not its chunk
        except OSError:
            hole = end
        hole = min(end, -(-hole // FIXED_SIZE) * FIXED_SIZE)
        if hole <= lo:  # the file changed under us: read the rest
            hole = end
        yield lo, hole, True
        pos = hole


def _fixed_batch(data: memoryview, pos: int) -> Batch:
    """The 64 KiB chunks of data (read at pos). A disk image is mostly zeros: a zero chunk is
    compared where it lies (memcmp) and handed on as the one shared ZERO_CHUNK, not copied out
    (page faults in a fresh process) and compared again; the others are copied out as bytes,
    which workers may hold past the buffer or mapping. A shorter last chunk always goes out
    whole, and the workers see whether it is zero."""
    batch = []
    for i in range(0, len(data), FIXED_SIZE):
        piece = data[i : i + FIXED_SIZE]
        if len(piece) == FIXED_SIZE and ZERO_CHUNK.startswith(piece):
            batch.append((pos + i, ZERO_CHUNK))
        else:
            batch.append((pos + i, bytes(piece)))
    return batch


def changed_spans(ranges: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Round ranges out to 64 KiB boundaries, clip to size, sort and merge them."""
    spans = []
    for off, length in ranges:
        if off < 0 or length < 0:
            raise BadInput(f"changed range ({off}, {length}) is negative")
        if length == 0 or off >= size:
            continue
        start = off - off % FIXED_SIZE
        end = min(size, -(-(off + length) // FIXED_SIZE) * FIXED_SIZE)
        spans.append((start, end))
    return merge_spans(spans)


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) spans sorted, with overlapping and touching ones merged."""
    merged: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def iter_cdc(source: Source, min_size: int = CDC_MIN, avg_size: int = CDC_AVG,
             max_size: int = CDC_MAX, start: int = 0) -> Iterator[Batch | HoleRun]:
    """Yield batches of content-defined chunks.

    Ranges the file system holds no data for (``_extents``) are not read: each goes out as one
    HoleRun, which the ingest keeps as a hole like any zero run, and the data before a hole ends
    with a cut of its own. So a sparse file costs the reads of its data, not of its size.
    """
    cutter = load_fastcdc()(avg_size, min_size=min_size, max_size=max_size)
    for lo, hi, is_data in _extents(source, start, source.size):
        if is_data:
            yield from _cdc_span(cutter, source, lo, hi)
        else:
            yield HoleRun(lo, hi - lo)  # unread


def _cdc_span(cutter: Any, source: Source, start: int, end: int) -> Iterator[Batch]:
    """The chunks of [start, end), read in big blocks. Every cut but the last in a buffer is
    final (it was found with the whole max_size window in view), the last one is carried into
    the next buffer, so the cuts equal those of one pass over the whole span."""
    pos = start
    carry = b""
    carry_off = start
    while pos < end or carry:
        n = min(BATCH_BYTES, end - pos)
        block = read_exact(source, pos, n) if n else b""
        pos += n
        buf = carry + block if carry else block
        base = carry_off
        cuts = [(c.offset, c.length) for c in cutter.cut_buf(buf)]
        if pos < end and cuts:
            last_off, _ = cuts.pop()
            carry = buf[last_off:]
            carry_off = base + last_off
        else:
            carry = b""
            carry_off = base + len(buf)
        batch = [(base + off, buf[off : off + length]) for off, length in cuts]
        if batch:
            yield batch


class HoleRun:
    """A batch standing for [start, start + length) of a file the file system holds no data
    for (SEEK_DATA, SEEK_HOLE). An ingest takes it whole as one hole: 64 KiB zero pieces, each
    hashed-or-not on a worker and added to the manifest before it merged them, made an
    import's time grow with the file's size (QA: a 10 TiB file holding one byte took two
    minutes of CPU). Iterated, it is those pieces, (offset, the shared ZERO_CHUNK or a
    shorter zero tail), for any reader of batches that does not look for it."""

    __slots__ = ("length", "start")

    def __init__(self, start: int, length: int) -> None:
        self.start = start
        self.length = length

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        end = self.start + self.length
        for pos in range(self.start, end, FIXED_SIZE):
            yield (pos, ZERO_CHUNK if pos + FIXED_SIZE <= end else bytes(end - pos))

    def __len__(self) -> int:
        return -(-self.length // FIXED_SIZE)

    def __repr__(self) -> str:
        return f"HoleRun({self.start}, {self.length})"
