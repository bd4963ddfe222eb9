"""Read-ahead of checkpoint files (ksfs.fuse.prefetch): unit tests over a fake reader, and the
mount for real: bytes through it equal the store's under sequential, random and abandoned reads."""

from __future__ import annotations

import os
import random
import time

import pytest

from ksfs.errors import ChunkCorrupt
from ksfs.fuse.prefetch import Pool, Prefetcher
from ksfs.keeper import Keeper
from tests.mount_helpers import MIB, mounted, write_disk, write_memory

BLOCK = 64 * 1024


class FakeReader:
    def __init__(self, data: bytes, bad_at: int | None = None) -> None:
        self.data = data
        self.size = len(data)
        self.bad_at = bad_at
        self.reads: list[int] = []

    def read(self, off: int, n: int) -> bytes:
        self.reads.append(off)
        if self.bad_at is not None and off <= self.bad_at < off + n:
            raise ChunkCorrupt(chunk="00", why="damaged for the test")
        return self.data[off : off + n]


@pytest.fixture
def pool():
    p = Pool()
    yield p
    assert p.close()
    assert not p.alive()


def serve(pf: Prefetcher, reader: FakeReader, off: int, n: int) -> tuple[bytes, bool]:
    """What the FUSE read handler does: the block decoded ahead, or the ordinary read."""
    ahead = pf.on_read(off, n)
    if ahead is not None:
        data = ahead.future.result(timeout=10)
        if data is not None:
            return ahead.slice(data), True
    return reader.read(off, min(n, reader.size - off)), False


def test_sequential_reads_are_served_ahead_and_equal_the_file(pool):
    data = random.Random(1).randbytes(40 * BLOCK + 123)
    reader = FakeReader(data)
    pf = Prefetcher(reader, pool, block=BLOCK, window=8 * BLOCK, inflight=4)
    got, hits = [], 0
    for off in range(0, len(data), BLOCK):
        part, hit = serve(pf, reader, off, BLOCK)
        got.append(part)
        hits += hit
    assert b"".join(got) == data
    assert hits >= 30  # all but the first few READs came from blocks decoded ahead
    assert len(pf._blocks) == 0  # every block decoded was taken


def test_a_second_pass_from_the_start_is_served_ahead_again(pool):
    """After a far backward seek (a second cmp/cat of the same open file) read-ahead starts
    again."""
    data = random.Random(2).randbytes(30 * BLOCK)
    reader = FakeReader(data)
    pf = Prefetcher(reader, pool, block=BLOCK, window=8 * BLOCK, inflight=4)
    for _ in range(2):
        got, hits = [], 0
        for off in range(0, len(data), BLOCK):
            part, hit = serve(pf, reader, off, BLOCK)
            got.append(part)
            hits += hit
        assert b"".join(got) == data
        assert hits >= 20
    step = BLOCK + 4096  # READs that straddle block boundaries still get the right bytes
    got = [serve(pf, reader, off, step)[0] for off in range(0, len(data), step)]
    assert b"".join(got) == data


def test_window_and_slots_bound_what_is_decoded(pool):
    reader = FakeReader(bytes(100 * BLOCK))
    pf = Prefetcher(reader, pool, block=BLOCK, window=6 * BLOCK, inflight=3)
    for off in (0, BLOCK):
        serve(pf, reader, off, BLOCK)
    time.sleep(0.2)  # the reader stops: nothing more is decoded
    assert pf.decoded <= 3
    assert len(pf._blocks) <= 3
    assert max(reader.reads) < 2 * BLOCK + 6 * BLOCK


def test_random_reads_start_nothing(pool):
    rnd = random.Random(2)
    data = rnd.randbytes(64 * BLOCK)
    reader = FakeReader(data)
    pf = Prefetcher(reader, pool, block=BLOCK, window=4 * BLOCK)
    for _ in range(200):
        off = rnd.randrange(len(data))
        n = rnd.randrange(1, 3 * BLOCK)
        part, _ = serve(pf, reader, off, n)
        assert part == data[off : off + n]
    assert pf.decoded < 20  # only the odd pair of nearby READs starts a short stream


def test_close_stops_and_drops(pool):
    reader = FakeReader(bytes(100 * BLOCK))
    pf = Prefetcher(reader, pool, block=BLOCK, window=50 * BLOCK, inflight=8)
    serve(pf, reader, 0, BLOCK)
    serve(pf, reader, BLOCK, BLOCK)
    pf.close()
    time.sleep(0.2)
    decoded = pf.decoded
    assert pf.on_read(2 * BLOCK, BLOCK) is None
    time.sleep(0.1)
    assert pf.decoded == decoded and not pf._blocks


def test_a_damaged_block_is_never_served_ahead(pool):
    data = random.Random(3).randbytes(20 * BLOCK)
    reader = FakeReader(data, bad_at=5 * BLOCK + 10)
    pf = Prefetcher(reader, pool, block=BLOCK, window=8 * BLOCK)
    for off in range(0, 5 * BLOCK, BLOCK):
        assert serve(pf, reader, off, BLOCK)[0] == data[off : off + BLOCK]
    with pytest.raises(ChunkCorrupt):  # the ordinary read meets the damage itself: EIO
        serve(pf, reader, 5 * BLOCK, BLOCK)


# --- through the mount ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefetch")
    size = 24 * MIB + 777
    disk = write_disk(root / "disk.raw", size, 4,
                      [(0, 5 * MIB), (7 * MIB + 3, 6 * MIB), (20 * MIB, size - 20 * MIB)])
    memory = write_memory(root / "memory", 17 * MIB + 5, 8)
    with Keeper(root / "store", create=True) as k:
        k.import_files("s", "c", [memory], disks=[disk])
    return {"store": root / "store", "disk.raw": disk, "memory": memory}


def test_mount_sequential_random_and_abandoned_reads(store):
    with mounted(store["store"]) as mnt, Keeper(store["store"]) as k:
        d = mnt / "sessions" / "s" / "checkpoints" / "c"
        rnd = random.Random(9)
        for name in ("disk.raw", "memory"):
            original = store[name].read_bytes()
            reader = k.open_file("s", "c", name)
            # Abandoned: a few sequential reads, then close (the stream must stop, not leak).
            with open(d / name, "rb", buffering=0) as f:
                head = f.read(3 * MIB)
            assert head == original[: 3 * MIB]
            # Sequential in odd sizes, with random jumps in between.
            fd = os.open(d / name, os.O_RDONLY)
            try:
                off = 0
                while off < len(original):
                    n = rnd.choice([4096, 100_000, MIB, 3 * MIB + 1])
                    got = os.pread(fd, n, off)
                    assert got == original[off : off + n] == reader.read(off, n), (name, off)
                    off += len(got)
                    if rnd.random() < 0.1:
                        j = rnd.randrange(len(original))
                        assert os.pread(fd, 5000, j) == original[j : j + 5000]
            finally:
                os.close(fd)
            assert (d / name).read_bytes() == original
    assert "Traceback" not in mounted.last_log
    assert "did not stop" not in mounted.last_log
