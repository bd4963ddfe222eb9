"""Cutting memory images at the page records of QEMU's migration stream.

A libvirt save image is a header with the domain XML, then QEMU's migration stream, whose RAM
part is a run of page records: a big-endian u64 of page address | flags, an id string when the
CONTINUE flag is absent, then either one byte (a zero page) or the 4 KiB page. Zero pages make
records 9 bytes long, so every page turning zero or back shifts all later offsets; plain CDC
re-stores some 20 KiB around each changed page. This cutter instead makes one chunk of the records
of each aligned group of GROUP_PAGES guest pages holding data, and merges runs of zero-page groups
(and any bytes between records) into one chunk. A changed page makes its group's chunk new, and
a delta on the group's old version (ksfs/cas/delta.py) brings that down to about the page.

It only decides where chunks end: any byte sequence is cut into chunks that cover it exactly, so a
stream it misreads is stored correctly, only less compactly. When it cannot find page records it
hands the rest of the file to FastCDC. It never hashes, compresses or writes.

Whatever the input, no chunk it makes is longer than CHUNK_MAX (the store reads back none over
format.MAX_STORED_LEN), and it holds at most one batch and one chunk: a group that never closes
(every record for one address) is cut at a record boundary before it passes CHUNK_MAX, a libvirt
header longer than that is cut every CHUNK_MAX, and a libvirt header whose data area runs past
the file (or past HEADER_DATA_MAX) is not trusted: the whole file goes to FastCDC. A well-formed
stream never comes near the cap, so its cuts are what they were.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator

from ksfs.cas.chunking import BATCH_BYTES, Batch, HoleRun, Source, iter_cdc, read_exact

PAGE = 4096
# 128 KiB of guest RAM per chunk. Tuned by tools/bench-store on checkpoints of a real guest: with
# deltas on the old version, larger groups cost little more per changed page, and each chunk fewer
# costs its index entry, record header and per-chunk work (8 stored 2% more and imported 15-20%
# slower; docs/performance.md, thirty-first session).
GROUP_PAGES = 32
PENDING_MAX = 64 * 1024  # merged zero-page groups and stray bytes never exceed this
# No chunk is longer. Well-formed streams never reach it: their chunks are a group (32 records,
# about 128 KiB), a pending run (under PENDING_MAX + RESYNC) or a libvirt header (92 bytes and a
# data area libvirt pads to some 64 KiB). 1 MiB is far under the 64 MiB the store reads back
# (format.MAX_STORED_LEN) and an eighth of a batch, so what a batch carries over stays small.
CHUNK_MAX = 1024 * 1024
# A libvirt data area (domain XML, cookie, padding) beyond this is no save image (the bound
# ksfs.vm.saveimage.MAX_DATA puts on what it reads): the file goes to FastCDC.
HEADER_DATA_MAX = 64 << 20
LIBVIRT_HEADER = 92
RESYNC = 8192  # bytes searched for page records again after something else
RECORD_MAX = 8 + 1 + 255 + PAGE  # the longest page record: header, id string, page
# What a search for records again may read past where it starts: a record found up to RESYNC on
# must be followed by a second one. A buffer ending sooner waits for the next, or where the
# batches end would decide whether a stream's records are found again.
RESYNC_AHEAD = RESYNC + 2 * RECORD_MAX
F_ZERO, F_PAGE, F_CONT = 0x02, 0x08, 0x20
PAGE_FLAGS = {F_ZERO, F_PAGE, F_ZERO | F_CONT, F_PAGE | F_CONT}
LIBVIRT_MAGIC = b"LibvirtQemudSave"
QEMU_MAGIC = b"QEVM"
_u64 = struct.Struct(">Q")
_FLAG_BYTE = re.compile(b"[" + re.escape(bytes(sorted({f & 0xFF for f in PAGE_FLAGS}))) + b"]")
# The records of whole aligned groups of zero pages in address order, (address | flags, one 0
# byte) each: most of a guest's RAM is runs of these, matched with one comparison per run.
RUN_GROUPS = 8
_zero_group = struct.Struct(">" + "Qx" * GROUP_PAGES)
_zero_run = struct.Struct(">" + "Qx" * (GROUP_PAGES * RUN_GROUPS))


def stream_start(head: bytes) -> int | None:
    """Offset of the QEMU stream in a libvirt save image or a raw stream; None if neither."""
    if head.startswith(QEMU_MAGIC):
        return 0
    if head.startswith(LIBVIRT_MAGIC) and len(head) >= LIBVIRT_HEADER:
        _, data_len, _, compressed = struct.unpack_from("<4I", head, 16)
        if compressed == 0:
            return LIBVIRT_HEADER + data_len
    return None


def _record_end(buf: bytes, p: int) -> tuple[int, int, bool] | None:
    """(end, address, is_zero) of a page record at p, or None if none fits there."""
    if p + 9 > len(buf):
        return None
    hdr = _u64.unpack_from(buf, p)[0]
    flags = hdr & 0xFFF
    if flags not in PAGE_FLAGS:
        return None
    q = p + 8
    if not flags & F_CONT:
        n = buf[q]
        if n == 0:
            return None
        q += 1 + n
    q += 1 if flags & F_ZERO else PAGE
    if q > len(buf):
        return None
    return q, hdr & ~0xFFF, bool(flags & F_ZERO)


def _resync(buf: bytes, p: int, limit: int) -> int | None:
    """The next position before limit where two page records follow each other."""
    stop = min(limit, len(buf) - 9)
    s = p
    while s < stop:
        # Only where the header's last byte is that of a page flag can a record start: the regex
        # skips the rest (device state after the RAM is KiBs of them) without a call each.
        m = _FLAG_BYTE.search(buf, s + 7, stop + 7)
        if m is None:
            return None
        s = m.start() - 7
        first = _record_end(buf, s)
        if first is not None and _record_end(buf, first[0]) is not None:
            return s
        s += 1
    return None


def iter_pages(source: Source, start: int) -> Iterator[Batch | HoleRun]:
    """Yield batches of chunks of a migration stream that begins at ``start``."""
    size = source.size
    if start > size or start > LIBVIRT_HEADER + HEADER_DATA_MAX:
        # the header's lengths run past the file, or past any libvirt writes: no save image
        yield from iter_cdc(source)
        return
    for lo in range(0, start, CHUNK_MAX):  # the header: one chunk unless longer than the cap
        yield [(lo, read_exact(source, lo, min(CHUNK_MAX, start - lo)))]
    pos = start  # absolute offset of buf[0]
    carry = b""
    while pos + len(carry) < size:
        n = min(BATCH_BYTES, size - pos - len(carry))
        # The carried bytes are read again with the new ones rather than prepended: one read
        # instead of copying the whole 8 MiB buffer; the buffer spans the same bytes either way.
        buf = read_exact(source, pos, len(carry) + n)
        final = pos + len(buf) >= size
        batch, used, lost = _cut(buf, pos, final)
        if batch:
            yield batch
        if lost is not None:  # no page records any more: FastCDC for the rest
            yield from iter_cdc(source, start=pos + lost)
            return
        carry = buf[used:]
        pos += used
        if final and carry:
            yield [(pos, carry)]
            return


def _cut(buf: bytes, base: int, final: bool) -> tuple[Batch, int, int | None]:
    """Cut buf; return (chunks, bytes consumed, offset where page records stopped or None).

    Unconsumed bytes (a group that may continue in the next buffer) are carried over. The walk
    keeps ``p - chunk_start <= CHUNK_MAX``: a pending run is cut at PENDING_MAX, and a group
    grows past its GROUP_PAGES records (about 128 KiB) only where records keep coming back to it,
    and there ``split_group`` cuts it at a record boundary. So no chunk, and no carry (but the
    few KiB kept to see a whole record), is longer than the cap.
    """
    out: Batch = []
    chunk_start = 0  # start of the pending run (zero groups, stray bytes) or current group
    group: int | None = None  # address group of the current data group, if one is open
    group_start = 0
    group_zero = True
    p = 0
    limit = len(buf) if final else len(buf) - (PAGE + 300)  # leave room for a whole record

    def close_group(at: int) -> None:
        nonlocal chunk_start
        if group_zero:
            if at - chunk_start >= PENDING_MAX:
                out.append((base + chunk_start, buf[chunk_start:at]))
                chunk_start = at
            return
        if group_start > chunk_start:
            out.append((base + chunk_start, buf[chunk_start:group_start]))
        out.append((base + group_start, buf[group_start:at]))
        chunk_start = at

    def split_group(at: int) -> None:
        # The open group reached CHUNK_MAX (its records keep coming back to one group, which no
        # real stream does): cut it here, as a close would, and go on with the same group.
        nonlocal chunk_start, group_start, group_zero
        if not group_zero and group_start > chunk_start:
            out.append((base + chunk_start, buf[chunk_start:group_start]))
            chunk_start = group_start
        out.append((base + chunk_start, buf[chunk_start:at]))
        chunk_start = group_start = at
        group_zero = True

    size = len(buf)
    unpack = _u64.unpack_from
    group_bytes = GROUP_PAGES * PAGE
    run_bytes = group_bytes * RUN_GROUPS
    zgroup, zgroup_len = _zero_group.pack, _zero_group.size
    zrun, zrun_len = _zero_run.pack, _zero_run.size
    top = (1 << 64) - run_bytes
    while p < limit:
        # the two records that make up nearly all of a stream, without a call
        hdr = unpack(buf, p)[0] if p + 8 <= size else 0
        flags = hdr & 0xFFF
        if flags == F_ZERO | F_CONT and p + 9 <= size:
            addr = hdr - flags
            # Whole zero groups from an aligned address on, walked as the records one by one
            # would be: each group boundary closes the group before it, nothing else changes.
            # Every record of a run starts before limit, as the walk requires. The peek at the
            # last record's flags byte skips building the pattern where data pages interleave.
            n = 0
            # top: the pattern's headers fit a u64. The next header checked first: records
            # that repeat one address would build both patterns at every record for nothing.
            if (not addr % group_bytes and hdr < top and p + 17 <= limit
                    and unpack(buf, p + 9)[0] == hdr + PAGE):
                if (p + zrun_len <= limit and buf[p + zrun_len - 2] == F_ZERO | F_CONT
                        and buf.startswith(zrun(*range(hdr, hdr + run_bytes, PAGE)), p)):
                    n = zrun_len
                elif (p + zgroup_len <= limit and buf[p + zgroup_len - 2] == F_ZERO | F_CONT
                        and buf.startswith(zgroup(*range(hdr, hdr + group_bytes, PAGE)), p)):
                    n = zgroup_len
            if n:
                g = addr // group_bytes
                for q in range(p, p + n, zgroup_len):
                    if g != group:
                        if group is not None:
                            if group_zero:  # close_group's zero case, without the call
                                if q - chunk_start >= PENDING_MAX:
                                    out.append((base + chunk_start, buf[chunk_start:q]))
                                    chunk_start = q
                            else:
                                close_group(q)
                        group, group_start, group_zero = g, q, True
                    elif q + zgroup_len - chunk_start > CHUNK_MAX:  # the same group again
                        split_group(q)
                    g += 1
                p += n
                continue
            end, zero = p + 9, True
        elif flags == F_PAGE | F_CONT and p + 8 + PAGE <= size:
            addr, end, zero = hdr - flags, p + 8 + PAGE, False
        else:
            rec = _record_end(buf, p)
            if rec is None:
                nxt = _resync(buf, p, p + RESYNC)
                if nxt is None:
                    if not final and len(buf) - p < RESYNC_AHEAD:
                        break  # maybe records resume in the next buffer
                    if group is not None:
                        close_group(p)
                    if p > chunk_start:
                        out.append((base + chunk_start, buf[chunk_start:p]))
                    return out, p, p
                if group is not None:
                    close_group(p)
                    group = None
                p = nxt  # the bytes skipped join the pending run
                if p - chunk_start >= PENDING_MAX:
                    out.append((base + chunk_start, buf[chunk_start:p]))
                    chunk_start = p
                continue
            end, addr, zero = rec
        g = addr // group_bytes
        if g != group:
            if group is not None:
                close_group(p)
            group, group_start, group_zero = g, p, True
        elif end - chunk_start > CHUNK_MAX:
            split_group(p)
        if not zero:
            group_zero = False
        p = end
    if final:
        if group is not None:
            close_group(p)
        if len(buf) > chunk_start:
            out.append((base + chunk_start, buf[chunk_start:]))
        return out, len(buf), None
    # keep the open group (and pending run) for the next buffer
    return out, chunk_start, None


def data_pages(chunk: bytes) -> list[bytes]:
    """The 4 KiB data pages of the page records a chunk of this cutter starts with, in order;
    zero-page records hold none. Empty for a chunk that does not start with a page record (a
    header, device state, or FastCDC's chunk of another kind of file). A hint for choosing delta
    bases, never stored: the two records nearly every stream is made of are stepped over
    without a call, a run of zero-page records at once."""
    out = []
    p = 0
    n = len(chunk)
    zero_cont, page_cont = F_ZERO | F_CONT, F_PAGE | F_CONT
    while p + 9 <= n:
        flags = chunk[p + 7]
        if flags == zero_cont and not chunk[p + 6] & 0x0F:
            # the flags bytes of the 9-byte records that follow, one slice for up to 1024
            run = chunk[p + 7 : p + 7 + 9 * 1024 : 9]
            p += 9 * (len(run) - len(run.lstrip(bytes([zero_cont]))))
            continue
        if flags == page_cont and not chunk[p + 6] & 0x0F and p + 8 + PAGE <= n:
            out.append(chunk[p + 8 : p + 8 + PAGE])
            p += 8 + PAGE
            continue
        rec = _record_end(chunk, p)
        if rec is None:
            break
        p, _, zero = rec
        if not zero:
            out.append(chunk[p - PAGE : p])
    return out


_ZERO_PAGE = bytes(PAGE)


def chunk_pages(chunk: bytes, fixed: bool) -> list[bytes]:
    """A chunk's 4 KiB pages that hold data: a disk cluster's blocks (``fixed``), or the data
    pages of a memory group's page records."""
    if not fixed:
        return data_pages(chunk)
    return [page for i in range(0, len(chunk), PAGE)
            if (page := chunk[i : i + PAGE]) != _ZERO_PAGE]
