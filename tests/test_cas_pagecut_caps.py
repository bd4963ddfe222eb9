"""The page cutter makes no chunk longer than CHUNK_MAX and holds about one batch, whatever the
input, and the ingest refuses a chunk the store could not read back (QA F1: a libvirt header
whose XML length ran past the file, or page records that never left one page group, made one
chunk of the whole file; the store reads back none over 64 MiB, so `ksfs import` exited 0 and
published a checkpoint whose file `cat` and `check` called damaged, and memory grew with the
file: 1 GB for a 300 MiB stream).

Well-formed streams never reach the cap: tests/test_cas_pagecut.py still finds every cut where
the record walk before the cap made it.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksfs.cas import format as fmt
from ksfs.cas import ingest as ingest_mod
from ksfs.cas import pagecut
from ksfs.cas.chunking import Source, iter_cdc, read_exact
from ksfs.errors import IntegrityError, NotFound
from ksfs.keeper import Keeper
from tests.cas_helpers import BytesSource, record

KSFS = [sys.executable, "-m", "ksfs.cli"]
PAGE = 4096
GROUP_PAGES = pagecut.GROUP_PAGES  # the pages of one group, whatever the cutter is tuned to
QEVM = b"QEVM\0\0\0\x03"
RECORD_MAX = 8 + 1 + 255 + PAGE  # the longest page record: header, block id, page


def libvirt_header(data_len: int) -> bytes:
    return b"LibvirtQemudSave" + struct.pack("<5I", 2, data_len, 1, 0, 0) + bytes(56)


def cut(source: Source) -> list[tuple[int, bytes]]:
    start = pagecut.stream_start(source.pread(0, 4096)) or 0
    return [c for batch in pagecut.iter_pages(source, start) for c in batch]


def assert_capped(source: Source, monkeypatch: pytest.MonkeyPatch,
                  batch_sizes: tuple[int, ...] = (8 << 20, 300_000, (1 << 20) + 17)
                  ) -> list[tuple[int, int]]:
    """Chunks cover the source exactly, none longer than the cap, and they are the same
    whatever the batch size (an import's cuts do not depend on where its reads end)."""
    seen = []
    for batch_bytes in batch_sizes:
        monkeypatch.setattr(pagecut, "BATCH_BYTES", batch_bytes)
        chunks = cut(source)
        pos = 0
        for off, chunk in chunks:
            assert off == pos and chunk
            assert source.pread(off, len(chunk)) == chunk
            pos += len(chunk)
        assert pos == source.size
        longest = max(len(c) for _, c in chunks)
        assert longest <= pagecut.CHUNK_MAX, (batch_bytes, longest)
        seen.append([(off, len(c)) for off, c in chunks])
    assert all(s == seen[0] for s in seen)
    return seen[0]


# --- the shapes that made one chunk of everything ---------------------------------------------

def one_group(n: int, zero: bool, rng: random.Random) -> bytes:
    """n page records, all for address 0: the group never closes."""
    page = None if zero else rng.randbytes(PAGE)
    return QEVM + b"".join(record(0, page, first=(i == 0)) for i in range(n))


def one_group_mixed(n: int, rng: random.Random) -> bytes:
    """Records for the GROUP_PAGES pages of group 0 in any order, data and zero mixed."""
    recs = [record(rng.randrange(GROUP_PAGES) * PAGE,
                   None if rng.random() < 0.5 else rng.randbytes(64) * 64, first=(i == 0))
            for i in range(n)]
    return QEVM + b"".join(recs) + struct.pack(">Q", 0x10) + rng.randbytes(5000)


def aligned_zero_group_again(n: int, data_first: bool, rng: random.Random) -> bytes:
    """The GROUP_PAGES zero-page records of group 1 over and over (the cutter's bulk zero-group
    match takes each repetition whole), after a data page of that group or not."""
    first = record(PAGE * GROUP_PAGES, rng.randbytes(PAGE) if data_first else None, first=True)
    group = b"".join(record(PAGE * (GROUP_PAGES + i), None) for i in range(GROUP_PAGES))
    return QEVM + first + group * n


SHAPES: dict[str, Callable[[random.Random], bytes]] = {
    "data pages of one address": lambda rng: one_group(700, False, rng),
    "zero pages of one address": lambda rng: one_group(400_000, True, rng),
    "pages of one group in any order": lambda rng: one_group_mixed(1500, rng),
    # 320,000 zero-page records (some 2.9 MB) whatever the group size
    "an aligned zero group again and again": lambda rng: aligned_zero_group_again(
        320_000 // GROUP_PAGES, False, rng),
    "... after a data page of it": lambda rng: aligned_zero_group_again(
        320_000 // GROUP_PAGES, True, rng),
    "a libvirt header past the file": lambda rng: libvirt_header(0xFFFFFF00) + rng.randbytes(
        3 << 20),
    "a libvirt header of 3 MiB": lambda rng: libvirt_header(3 << 20) + rng.randbytes(3 << 20)
    + one_group(300, False, rng),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_no_chunk_longer_than_the_cap(monkeypatch, shape):
    data = SHAPES[shape](random.Random(shape))
    assert len(data) > 2 * pagecut.CHUNK_MAX
    cuts = assert_capped(BytesSource(data), monkeypatch)
    if "past the file" in shape:
        # not trusted: the whole file is cut as any other file would be
        assert cuts == [(o, len(c)) for b in iter_cdc(BytesSource(data)) for o, c in b]
    elif "header" in shape:
        # trusted but long: cut at the cap up to where the stream begins, as before after it
        start = pagecut.stream_start(data)
        assert [o for o, _ in cuts if o <= start] == list(range(0, start, pagecut.CHUNK_MAX)) + [
            start]
    else:
        # cut at the cap, not before: the group's chunks but its last (and the stream's head
        # and tail) nearly fill it
        body = [n for o, n in cuts if len(QEVM) < o + n <= len(data) - pagecut.CHUNK_MAX]
        assert body and all(n > pagecut.CHUNK_MAX - RECORD_MAX for n in body), cuts


def test_a_libvirt_header_longer_than_libvirt_writes_is_not_trusted(monkeypatch):
    """A data area past HEADER_DATA_MAX (but inside the file): FastCDC for the whole file."""
    n = pagecut.HEADER_DATA_MAX + 1
    data = libvirt_header(n) + bytes(n) + one_group(10, False, random.Random(1))
    cuts = assert_capped(BytesSource(data), monkeypatch, (8 << 20,))
    assert cuts == [(o, len(c)) for b in iter_cdc(BytesSource(data)) for o, c in b]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 1500), groups=st.integers(1, 3),
       zero_share=st.floats(0, 1), header=st.sampled_from([None, 0, 100, 200_000, 10**9]),
       batch=st.sampled_from([20_000, 70_000, 300_000]))
def test_streams_that_stay_in_few_groups_are_cut_under_the_cap(seed, n, groups, zero_share,
                                                               header, batch):
    """Random records crowded into a few groups, with the cap lowered so that streams of a few
    MiB reach it often (it must stay above PENDING_MAX + RESYNC + a record, which a pending run
    can reach before it is cut): covered exactly, under the cap, the same at every batch
    size."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        page = None if rng.random() < zero_share else rng.randbytes(64) * 64
        recs.append(record(rng.randrange(groups * GROUP_PAGES) * PAGE, page, first=(i == 0)))
        if rng.random() < 0.01:
            recs.append(rng.randbytes(rng.randrange(1, 3000)))  # stray bytes
    data = QEVM + b"".join(recs) + struct.pack(">Q", 0x10) + rng.randbytes(rng.randrange(9000))
    if header is not None:
        data = libvirt_header(header) + bytes(min(header, 300_000)) + data
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pagecut, "CHUNK_MAX", 80 * 1024)
        assert_capped(BytesSource(data), mp, (batch, 8 << 20))


# --- through the command line: QA's repros import, read back and check clean -------------------

def qa_lvsave(path: Path) -> None:
    path.write_bytes(libvirt_header(0xFFFFFF00) + os.urandom(65 << 20))


def qa_memsame(path: Path) -> None:
    with path.open("wb") as f:
        f.write(QEVM)
        for _ in range(65 * 256):
            f.write(struct.pack(">Q", 0x1000 | 0x28) + os.urandom(PAGE))


def qa_zero_pages(path: Path) -> None:
    path.write_bytes(QEVM + (struct.pack(">Q", 0x22) + b"\0") * 7_500_000)


def ksfs(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True)


@pytest.mark.parametrize("make", [qa_lvsave, qa_memsame, qa_zero_pages])
def test_qa_streams_import_read_back_and_check_clean(tmp_path, make):
    src = tmp_path / "memory"
    make(src)
    assert src.stat().st_size > fmt.MAX_STORED_LEN
    store = tmp_path / "s"
    res = ksfs(store, "import", "s", "c1", str(src))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    with out.open("wb") as f:
        res = subprocess.run(KSFS + ["--store", str(store), "cat", "s", "c1", "memory"],
                             stdout=f, stderr=subprocess.PIPE)
    assert res.returncode == 0, res.stderr
    assert out.stat().st_size == src.stat().st_size
    with src.open("rb") as a, out.open("rb") as b:
        while chunk := a.read(8 << 20):
            assert b.read(len(chunk)) == chunk
    res = ksfs(store, "check", "--read-data")
    assert res.returncode == 0, res.stdout + res.stderr
    assert b"store clean" in res.stdout


# --- bounded memory ---------------------------------------------------------------------------

CUT_AND_SAY_PEAK = """
import sys
from ksfs.cas import pagecut
from ksfs.cas.chunking import FileSource

def status(key):
    for x in open('/proc/self/status'):
        if x.startswith(key + ':'):
            return int(x.split()[1]) * 1024

src = FileSource(sys.argv[1])
before = status('VmRSS')
longest = 0
for batch in pagecut.iter_pages(src, pagecut.stream_start(src.pread(0, 4096)) or 0):
    longest = max([longest] + [len(c) for _, c in batch])
print(status('VmHWM') - before, longest)
"""


def test_cutting_a_stream_that_never_leaves_one_group_holds_about_a_batch(tmp_path):
    """docs/limits.md: 8 MiB read batches, bounded memory whatever the file size. The open
    group was carried over and read again with each batch, so memory grew with the stream (QA:
    385 MB to import 100 MiB, 1 GB for 300 MiB). Measured in a child (VmHWM): cutting 128 MiB
    that stay in one group grows it about as much as cutting a real guest's stream does (32
    MiB: the batch read, the chunks copied out of it, the batch before in the consumer's hands),
    nowhere near the stream's size."""
    rec = struct.pack(">Q", 0x1000 | 0x28) + random.Random(3).randbytes(PAGE)
    src = tmp_path / "memory"
    with src.open("wb") as f:
        f.write(QEVM + record(0x1000, rec[8:], first=True))
        for _ in range(128):
            f.write(rec * 256)
    res = subprocess.run([sys.executable, "-c", CUT_AND_SAY_PEAK, str(src)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    grown, longest = map(int, res.stdout.split())
    assert grown < 48 << 20, (grown, src.stat().st_size)
    assert longest <= pagecut.CHUNK_MAX


# --- the ingest's own guard ---------------------------------------------------------------------

def test_an_oversized_chunk_is_refused_before_anything_is_published(tmp_path, monkeypatch):
    """Were a chunker to cut a chunk longer than the store reads back, the import fails (exit 6,
    naming the file) and publishes no checkpoint, rather than one no read can use."""
    src = tmp_path / "big"
    with src.open("wb") as f:  # sparse: 64 MiB + 1 byte, one of them not zero
        f.write(b"x")
        f.truncate(fmt.MAX_STORED_LEN + 1)

    def one_chunk(source: Source, **_: object):
        yield [(0, read_exact(source, 0, source.size))]

    monkeypatch.setattr(ingest_mod, "iter_cdc", one_chunk)
    with Keeper(tmp_path / "s", create=True) as k:
        with pytest.raises(IntegrityError, match=str(src)) as exc:
            k.import_files("s", "c1", [src])
        assert exc.value.exit_code == 6
        assert "more than the store reads back" in str(exc.value)
        with pytest.raises(NotFound):
            k.checkpoint_record("s", "c1")
        assert k.references() == {}
        assert k.check(read_data=True).ok
