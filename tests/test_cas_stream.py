"""FileReader.stream (what ``ksfs cat`` writes): the same bytes as read(), every chunk checked.

The stream reads adjacent records with one pread and checks them on the store's workers; these
tests hold it to read()'s answers: same bytes at any range (holes, big holes, both chunkings,
with and without the workers), ChunkCorrupt naming a damaged chunk (payload or header),
ChunkMissing for a lost pack, chunks GC moves under it found again, and an early stop.
"""

from __future__ import annotations

import os
import random
import threading

import pytest

from ksfs.cas import ChunkStore
from ksfs.cas import reader as reader_module
from ksfs.errors import ChunkCorrupt, ChunkMissing
from tests.cas_helpers import K64, flip, put


def image(rng: random.Random, clusters: int) -> bytes:
    """Random, text and zero clusters, and now and then a zero run of several MiB (a hole)."""
    parts = []
    for _ in range(clusters):
        kind = rng.random()
        if kind < 0.05:
            parts.append(bytes(K64 * rng.randrange(20, 80)))
        elif kind < 0.3:
            parts.append(bytes(K64))
        elif kind < 0.7:
            parts.append(rng.randbytes(K64 - rng.randrange(0, 2) * 17))
        else:
            parts.append((b"text %d " % rng.randrange(99) * 9000)[:K64])
    return b"".join(parts)


def streamed(reader, offset=0, end=None) -> bytes:
    return b"".join(bytes(p) for pieces in reader.stream(offset, end) for p in pieces)




@pytest.fixture
def store(tmp_path):
    s = ChunkStore.open(tmp_path / "store", create=True)
    yield s
    s.close()


@pytest.mark.parametrize("ahead", [0, 4])
@pytest.mark.parametrize("chunking", ["fixed", "cdc"])
def test_stream_equals_read_at_any_range(store, monkeypatch, chunking, ahead):
    monkeypatch.setattr(reader_module, "STREAM_AHEAD", ahead)
    monkeypatch.setattr(reader_module, "STREAM_BATCH", 300_000)  # many tasks
    rng = random.Random(5)
    data = image(rng, 300)
    r = store.open_file(put(store, data, chunking).manifest)
    assert any(cid is None for cid in r.chunk_ids())
    assert streamed(r) == data
    for _ in range(40):
        a = rng.randrange(len(data) + 10)
        b = a + rng.choice([0, 1, 4095, K64 + 3, rng.randrange(len(data) + 10)])
        assert streamed(r, a, b) == data[a:b] == r.read(a, b - a)
    assert streamed(r, 0, 0) == b""


def test_stream_of_empty_and_all_hole_files(store):
    assert streamed(store.open_file(put(store, b"").manifest)) == b""
    zeros = bytes(5 * 1024 * 1024 + 3)
    r = store.open_file(put(store, zeros).manifest)
    assert r.chunk_ids() == [None]
    assert [len(p) for pieces in r.stream() for p in pieces][0] <= 1024 * 1024
    assert streamed(r) == zeros


@pytest.mark.parametrize("where", [10, 5000, -40, -51])  # payload, payload, header, magic
def test_damaged_chunk_is_named_by_the_stream(store, where):
    rng = random.Random(7)
    data = image(rng, 120)
    r = store.open_file(put(store, data).manifest)
    victim = [c for c in r.chunk_ids() if c is not None][17]
    flip(store, victim, where)
    with pytest.raises(ChunkCorrupt) as exc:
        streamed(store.open_file(r.manifest))
    assert victim.hex() in str(exc.value)


def test_lost_pack_gives_chunk_missing(store):
    data = image(random.Random(8), 60)
    r = store.open_file(put(store, data).manifest)
    for name in os.listdir(store.packs_dir):
        os.unlink(os.path.join(store.packs_dir, name))
    store.handles.close()  # no fd of this process keeps the packs readable
    with pytest.raises(ChunkMissing):
        streamed(store.open_file(r.manifest))


def test_stopping_early_leaves_the_store_usable(store):
    data = image(random.Random(9), 400)
    r = store.open_file(put(store, data).manifest)
    it = r.stream()
    first = next(it)
    assert b"".join(bytes(p) for p in first) == data[: sum(len(p) for p in first)]
    it.close()
    assert streamed(r) == data


def reads_while_gc_moves_chunks(store, read_whole) -> None:
    """``read_whole(manifest)`` (all the file's bytes) in a thread, again and again, while GC
    repacks the chunks under it: every read must give the original bytes."""
    rng = random.Random(10)
    keep = {put(store, image(rng, 60)).manifest for _ in range(3)}
    datas = {m: store.open_file(m).read(0, 1 << 40) for m in keep}
    for _ in range(3):
        put(store, image(rng, 60))  # garbage, so GC repacks the live chunks
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            for m, d in datas.items():
                try:
                    assert read_whole(m) == d
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(4):
            store.gc(lambda: list(keep), threshold=1.0)
            for _ in range(3):
                put(store, image(rng, 10))  # more garbage for the next round
    finally:
        stop.set()
        t.join()
    assert not errors, errors[0]


def test_stream_while_gc_moves_chunks(store):
    reads_while_gc_moves_chunks(store, lambda m: streamed(store.open_file(m)))
