"""The page cutter cuts exactly where the record-by-record cutter it replaced did.

Stores made before keep deduplicating against new checkpoints only if every cut point stays
byte-identical, so the old algorithm is kept here, verbatim, as the reference; the new cutter
must give the same (offset, bytes) list on synthetic streams of every shape (zero runs, data
groups, records out of order or repeated, odd fill bytes, addresses near 2**64, stray bytes,
section markers, block ids) at several buffer sizes, on random bytes, and on real memory images
when some are given: KSFS_MEMORY_IMAGES=path1:path2 (tools/bench-store --guest ... --keep-corpus
leaves them in DIR/corpus/c*/memory).
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksfs.cas import pagecut
from ksfs.cas.chunking import Batch, Source, iter_cdc, read_exact
from tests.cas_helpers import BytesSource, record

# --- the reference: ksfs/cas/pagecut.py before the bulk zero-group matching --------------------

# The geometry is the cutter's own, so that the reference cuts as it would at whatever group size
# it is tuned to, and the streams below are laid out in its groups: GROUP_PAGES pages a group, a
# zero run matched at once is RUN_GROUPS groups (RUN_PAGES pages).
PAGE, GROUP_PAGES, PENDING_MAX, RESYNC = (pagecut.PAGE, pagecut.GROUP_PAGES, pagecut.PENDING_MAX,
                                          pagecut.RESYNC)
RUN_GROUPS = pagecut.RUN_GROUPS
RUN_PAGES = RUN_GROUPS * GROUP_PAGES
ZERO_GROUP_BYTES = 9 * GROUP_PAGES  # the records of a group of zero pages, 9 bytes each
F_ZERO, F_PAGE, F_CONT = 0x02, 0x08, 0x20
PAGE_FLAGS = {F_ZERO, F_PAGE, F_ZERO | F_CONT, F_PAGE | F_CONT}
_u64 = struct.Struct(">Q")


def _record_end(buf: bytes, p: int) -> tuple[int, int, bool] | None:
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
    for s in range(p, min(limit, len(buf) - 9)):
        first = _record_end(buf, s)
        if first is not None and _record_end(buf, first[0]) is not None:
            return s
    return None


def reference_iter_pages(source: Source, start: int, batch_bytes: int) -> Iterator[Batch]:
    size = source.size
    if start > 0:
        yield [(0, read_exact(source, 0, min(start, size)))]
    pos = start
    carry = b""
    while pos + len(carry) < size:
        n = min(batch_bytes, size - pos - len(carry))
        buf = carry + read_exact(source, pos + len(carry), n)
        final = pos + len(buf) >= size
        batch, used, lost = reference_cut(buf, pos, final)
        if batch:
            yield batch
        if lost is not None:
            yield from iter_cdc(source, start=pos + lost)
            return
        carry = buf[used:]
        pos += used
        if final and carry:
            yield [(pos, carry)]
            return


def reference_cut(buf: bytes, base: int, final: bool) -> tuple[Batch, int, int | None]:
    out: Batch = []
    chunk_start = 0
    group: int | None = None
    group_start = 0
    group_zero = True
    p = 0
    limit = len(buf) if final else len(buf) - (PAGE + 300)

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

    size = len(buf)
    unpack = _u64.unpack_from
    group_bytes = GROUP_PAGES * PAGE
    while p < limit:
        hdr = unpack(buf, p)[0] if p + 8 <= size else 0
        flags = hdr & 0xFFF
        if flags == F_PAGE | F_CONT and p + 8 + PAGE <= size:
            rec = (p + 8 + PAGE, hdr - flags, False)
        elif flags == F_ZERO | F_CONT and p + 9 <= size:
            rec = (p + 9, hdr - flags, True)
        else:
            rec = _record_end(buf, p)
        if rec is None:
            nxt = _resync(buf, p, p + RESYNC)
            if nxt is None:
                if not final and len(buf) - p < pagecut.RESYNC_AHEAD:
                    break
                if group is not None:
                    close_group(p)
                if p > chunk_start:
                    out.append((base + chunk_start, buf[chunk_start:p]))
                return out, p, p
            if group is not None:
                close_group(p)
                group = None
            p = nxt
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
        group_zero = group_zero and zero
        p = end
    if final:
        if group is not None:
            close_group(p)
        if len(buf) > chunk_start:
            out.append((base + chunk_start, buf[chunk_start:]))
        return out, len(buf), None
    return out, chunk_start, None


# --- comparing -----------------------------------------------------------------------------------

class FileSource:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def pread(self, offset: int, n: int) -> bytes:
        return os.pread(self.fd, n, offset)


def cuts(batches: Iterator[Batch]) -> list[tuple[int, bytes]]:
    return [c for batch in batches for c in batch]


def assert_same_cuts(source: Source, monkeypatch: pytest.MonkeyPatch,
                     batch_bytes: int) -> list[tuple[int, bytes]]:
    start = pagecut.stream_start(source.pread(0, 4096)) or 0
    monkeypatch.setattr(pagecut, "BATCH_BYTES", batch_bytes)
    new = cuts(pagecut.iter_pages(source, start))
    old = cuts(reference_iter_pages(source, start, batch_bytes))
    assert [(o, len(c)) for o, c in new] == [(o, len(c)) for o, c in old]
    assert new == old
    pos = 0
    for off, chunk in new:  # and they still cover the stream exactly
        assert off == pos and chunk
        pos += len(chunk)
    assert pos == source.size
    return new


# --- synthetic streams ---------------------------------------------------------------------------

# A gap in the addresses or a step back spans 1 to STEP - 1 pages: within a group, into the next
# one or past whole ones (two groups and a half).
STEP = 2 * GROUP_PAGES + GROUP_PAGES // 2


def stream(rng: random.Random, pages: int, data_share: float, run: int = 3 * GROUP_PAGES,
           base: int = 0, odd: float = 0.0, libvirt: bool = True) -> bytes:
    """A stream of ``pages`` records in address order from ``base``, data pages in runs of about
    ``run``; with ``odd`` > 0 that share of places gets something unusual."""
    out = bytearray(b"QEVM\0\0\0\x03\x01\x00\x00\x00\x02")
    data = False
    addr = base
    for i in range(pages):
        if rng.random() < 1 / run:
            data = rng.random() < data_share
        page = rng.randbytes(64) * 64 if data else None
        fill = 0
        if odd and rng.random() < odd:
            kind = rng.randrange(8)
            if kind == 0:
                fill = rng.randrange(1, 256)  # a zero-page record whose byte is not 0
            elif kind == 1:
                addr += PAGE * rng.randrange(1, STEP)  # a gap in the addresses
            elif kind == 2:
                addr = max(0, addr - PAGE * rng.randrange(1, STEP))  # going back: repeated pages
            elif kind == 3:
                out += struct.pack(">Q", 0x10) + b"\x02\x00\x00\x00\x02"  # end of a section part
            elif kind == 4:
                out += rng.randbytes(rng.randrange(1, 3000))  # stray bytes
            elif kind == 5:
                # groups no longer start on their first page
                addr += rng.randrange(1, GROUP_PAGES) * PAGE
            elif kind == 6:
                out += record(addr, page, first=True, block=b"vga.vram")  # another block's id
                addr += PAGE
                continue
            else:
                out += bytes(rng.randrange(1, 40))  # zeros that are no record
        out += record(addr, page, first=(i == 0), fill=fill)
        addr += PAGE
    out += struct.pack(">Q", 0x10) + rng.randbytes(rng.randrange(0, 30000))  # device state
    if not libvirt:
        return bytes(out)
    xml = b"<domain/>\0"
    head = b"LibvirtQemudSave" + struct.pack("<5I", 2, len(xml), 1, 0, 0) + bytes(56)
    return head + xml + bytes(out)


@pytest.mark.parametrize("batch_bytes", [8 * 1024 * 1024, 256 * 1024, 70_000])
# run: pages between switches of data and zero pages, three groups, one group, or page by page
@pytest.mark.parametrize(("pages", "data_share", "run", "odd"), [
    (40_000, 0.12, 3 * GROUP_PAGES, 0.0),    # a guest's RAM: long zero runs, clustered data
    (20_000, 0.5, 1, 0.0),                   # data and zero pages mixed page by page
    (20_000, 0.0, 3 * GROUP_PAGES, 0.0),     # all zero: pending runs cut at PENDING_MAX
    (20_000, 1.0, 3 * GROUP_PAGES, 0.0),     # no zero page at all
    (20_000, 0.12, 3 * GROUP_PAGES, 0.002),  # all of the unusual things now and then
    (20_000, 0.3, GROUP_PAGES, 0.02),        # ... often
])
def test_same_cuts_as_the_record_walk(monkeypatch, batch_bytes, pages, data_share, run, odd):
    rng = random.Random(pages * 7 + run)
    data = stream(rng, pages, data_share, run, odd=odd)
    assert len(assert_same_cuts(BytesSource(data), monkeypatch, batch_bytes)) > 1


@pytest.mark.parametrize("base", [
    # zero groups (a run's but three) whose run's address range would pass 2**64 (and wrap to 0)
    2**64 - (RUN_PAGES - 3 * GROUP_PAGES) * PAGE,
    2**64 - RUN_PAGES * PAGE,  # a whole run ending exactly at 2**64
    3 * PAGE,                  # groups start mid-group
    2**40,
])
def test_same_cuts_at_odd_addresses(monkeypatch, base):
    # 25 groups (three runs and one): those at the top of the address space wrap to two whole
    # runs and more
    rng = random.Random(base % 1000)
    data = stream(rng, 25 * GROUP_PAGES, 0.05, 3 * GROUP_PAGES, base=base, libvirt=False)
    assert_same_cuts(BytesSource(data), monkeypatch, 8 * 1024 * 1024)


def test_same_cuts_at_every_phase_of_the_pending_limit(monkeypatch):
    # stray bytes of every length mod ZERO_GROUP_BYTES (72 at 8 pages a group) before a long
    # zero run: one of them puts a group boundary exactly PENDING_MAX after the pending run's
    # start (where the first chunk ends)
    body = b"".join(record(i * PAGE, None, first=(i == 0)) for i in range(12_000))
    exact = []
    for pad in range(ZERO_GROUP_BYTES + 1):
        data = b"QEVM\0\0\0\x03" + b"\xff" * pad + body + struct.pack(">Q", 0x10)
        first = assert_same_cuts(BytesSource(data), monkeypatch, 8 * 1024 * 1024)[0]
        if len(first[1]) == PENDING_MAX:
            exact.append(pad)
    assert exact


# pages back from the end of the zero runs: two pages of the last group, its first page, the last
# page of the group before it, the second and the first page of the last run, the last page of
# the run before it
@pytest.mark.parametrize("back", [1, 2, GROUP_PAGES, GROUP_PAGES + 1, RUN_PAGES - 1, RUN_PAGES,
                                  RUN_PAGES + 1])
@pytest.mark.parametrize("zero", [True, False])
def test_same_cuts_when_a_group_of_a_zero_run_goes_on(monkeypatch, back, zero):
    # a run of zero groups, then a record whose address lies in one of them again: the group it
    # reopens (or the last one, which it continues) starts where the walk started it
    rng = random.Random(back)
    # record 0 has no CONT flag: the three runs start at GROUP_PAGES
    n = GROUP_PAGES + RUN_PAGES * 3
    recs = [record(i * PAGE, None, first=(i == 0)) for i in range(n)]
    recs.append(record((n - back) * PAGE, None if zero else rng.randbytes(PAGE)))
    recs += [record((n + i) * PAGE, rng.randbytes(PAGE) if i % 3 else None)
             for i in range(5 * GROUP_PAGES)]  # five more groups, two pages in three data
    data = b"QEVM\0\0\0\x03" + b"".join(recs) + struct.pack(">Q", 0x10) + rng.randbytes(999)
    for batch_bytes in (8 * 1024 * 1024, 1000, 5000):
        assert_same_cuts(BytesSource(data), monkeypatch, batch_bytes)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), pages=st.integers(0, 3000), data_share=st.floats(0, 1),
       run=st.integers(1, 200), odd=st.sampled_from([0.0, 0.001, 0.05, 0.5]),
       batch_bytes=st.sampled_from([9000, 70_000, 300_000, 8 * 1024 * 1024]),
       cut=st.integers(0, 10**6))
def test_same_cuts_on_random_streams(seed, pages, data_share, run, odd, batch_bytes, cut):
    rng = random.Random(seed)
    data = stream(rng, pages, data_share, run, odd=odd)[:cut]
    with pytest.MonkeyPatch.context() as mp:
        assert_same_cuts(BytesSource(data), mp, batch_bytes)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=30_000), seed=st.integers(0, 99))
def test_same_cuts_on_random_bytes(data, seed):
    rng = random.Random(seed)
    blob = stream(rng, rng.randrange(0, 30), 0.3, 3, odd=0.1)[: rng.randrange(0, 200_000)] + data
    with pytest.MonkeyPatch.context() as mp:
        assert_same_cuts(BytesSource(blob), mp, rng.choice([9000, 8 * 1024 * 1024]))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_same_cuts_where_records_almost_start(seed):
    # junk made of flag-like bytes between runs of records (up to five groups of them):
    # resynchronising tries nearly every position, and many of them look like a record for a while
    rng = random.Random(seed)
    parts = [b"QEVM\0\0\0\x03"]
    for _ in range(rng.randrange(1, 12)):
        parts.append(bytes(rng.choice(b"\x00\x02\x08\x20\x22\x28\x01\x06")
                           for _ in range(rng.randrange(0, 12_000))))
        parts += [record(a * PAGE, None if rng.random() < 0.7 else rng.randbytes(PAGE),
                         first=rng.random() < 0.1)
                  for a in range(rng.randrange(0, 5 * GROUP_PAGES))]
    blob = b"".join(parts)
    with pytest.MonkeyPatch.context() as mp:
        assert_same_cuts(BytesSource(blob), mp, rng.choice([20_000, 8 * 1024 * 1024]))


@pytest.mark.parametrize("stray", [100, 4000, 6000, pagecut.RESYNC - 1])
def test_records_after_stray_bytes_are_found_wherever_a_batch_ends(monkeypatch, stray):
    # Records resume up to RESYNC bytes after something that is none, and their search needs the
    # two records after a match: a batch that ended within them used to hand the whole rest of
    # the stream to FastCDC (review of the thirty-first session).
    rng = random.Random(stray)
    head = b"QEVM\0\0\0\x03" + b"".join(record(i * PAGE, rng.randbytes(PAGE), first=i == 0)
                                        for i in range(4))
    tail = b"".join(record((4 + i) * PAGE, rng.randbytes(PAGE)) for i in range(3))
    blob = head + bytes(stray) + tail + bytes(100)
    whole = [(o, len(c)) for o, c in cuts(pagecut.iter_pages(BytesSource(blob), 0))]
    found = len(head) + stray
    assert any(o == found for o, _ in whole), whole  # the records after the stray bytes
    for batch_bytes in range(len(head) + 1000, len(blob) + 256, 256):
        monkeypatch.setattr(pagecut, "BATCH_BYTES", batch_bytes)
        got = [(o, len(c)) for o, c in cuts(pagecut.iter_pages(BytesSource(blob), 0))]
        assert got == whole, batch_bytes


# --- real memory images --------------------------------------------------------------------------

REAL = [p for p in os.environ.get("KSFS_MEMORY_IMAGES", "").split(os.pathsep) if p]


@pytest.mark.skipif(not REAL, reason="no real memory images given (KSFS_MEMORY_IMAGES=a:b; "
                    "tools/bench-store --guest ... --keep-corpus makes them)")
@pytest.mark.parametrize("path", REAL)
def test_same_cuts_on_real_memory_images(monkeypatch, path):
    src = FileSource(path)
    assert pagecut.stream_start(src.pread(0, 4096)) is not None, f"{path} is no memory image"
    for batch_bytes in (8 * 1024 * 1024, 1024 * 1024 + 17):
        assert len(assert_same_cuts(src, monkeypatch, batch_bytes)) > 100
