"""FileReader.readinto (the mount's READs): the same bytes as read(), every chunk checked.

readinto reads a raw chunk that a request covers whole straight from its pack into the reply
and hashes it there; these tests hold it to read()'s answers: any range, both chunkings,
buffers that start zeroed or dirty, deltas and compressed chunks beside raw ones, damage named
(ChunkCorrupt), a lost pack (ChunkMissing), and chunks GC moves under it.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksfs.cas import ChunkStore
from ksfs.cas.format import CODEC_RAW
from ksfs.errors import ChunkCorrupt, ChunkMissing
from tests.cas_helpers import K64, flip, put
from tests.test_cas_stream import image, reads_while_gc_moves_chunks


def read_into(reader, offset: int, n: int, dirty: bool) -> bytes:
    buf = bytearray(b"\xa5" * n) if dirty else bytearray(n)
    got = reader.readinto(offset, buf, zeroed=not dirty)
    return bytes(buf[:got])


@pytest.fixture
def store(tmp_path):
    s = ChunkStore.open(tmp_path / "store", create=True)
    yield s
    s.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One store holding a fixed and a CDC file with holes, raw and compressed chunks."""
    s = ChunkStore.open(tmp_path_factory.mktemp("readinto") / "store", create=True)
    data = image(random.Random(11), 200)
    files = {c: (s.open_file(put(s, data, c).manifest), data) for c in ("fixed", "cdc")}
    yield files
    s.close()


@settings(max_examples=150, deadline=None)
@given(chunking=st.sampled_from(["fixed", "cdc"]), dirty=st.booleans(),
       offset=st.integers(0, 15_000_000), n=st.integers(0, 3 * 1024 * 1024))
def test_readinto_equals_read_at_any_range(shared, chunking, dirty, offset, n):
    reader, data = shared[chunking]
    assert read_into(reader, offset, n, dirty) == data[offset : offset + n]


def test_whole_file_in_reply_sized_steps_uses_raw_chunks_and_compressed_ones(store):
    rng = random.Random(12)
    data = image(rng, 150)
    r = store.open_file(put(store, data).manifest)
    codecs = {store.lookup(c).codec for c in r.chunk_ids() if c is not None}
    assert CODEC_RAW in codecs and len(codecs) > 1  # both paths are taken
    preads = []
    real = store.handles.preadv
    store.handles.preadv = lambda *a: preads.append(a) or real(*a)  # count the fast path
    out = bytearray()
    while len(out) < len(data):
        out += read_into(r, len(out), 1024 * 1024, dirty=True)
    assert out == data
    raw_whole = sum(1 for c in r.chunk_ids() if c is not None
                    and store.lookup(c).codec == CODEC_RAW)
    # every raw chunk but those cut by a 1 MiB edge went straight into the reply
    assert raw_whole - len(data) // (1024 * 1024) - 1 <= len(preads) <= raw_whole
    assert r.readinto(len(data), bytearray(10)) == 0


def test_deltas_read_back(store):
    rng = random.Random(13)
    old = rng.randbytes(40 * K64)
    new = bytearray(old)
    for k in range(0, len(new), K64):
        new[k + 100 : k + 200] = rng.randbytes(100)  # every chunk changes a little: deltas
    put(store, old)
    r = store.open_file(put(store, bytes(new)).manifest)
    assert read_into(r, 0, len(new), dirty=True) == new
    assert read_into(r, K64 - 5, 3 * K64, dirty=False) == new[K64 - 5 : 4 * K64 - 5]


@pytest.mark.parametrize("where", [10, 5000, -40, -51])  # payload, payload, header, magic
def test_damaged_raw_chunk_is_named(store, where):
    rng = random.Random(14)
    data = rng.randbytes(30 * K64)  # random: every chunk is stored raw
    r = store.open_file(put(store, data).manifest)
    victim = r.chunk_ids()[7]
    assert store.lookup(victim).codec == CODEC_RAW
    flip(store, victim, where)
    with pytest.raises(ChunkCorrupt) as exc:
        read_into(store.open_file(r.manifest), 0, len(data), dirty=False)
    assert victim.hex() in str(exc.value)
    # the chunks before it still read, whole and in part
    assert read_into(r, 0, 7 * K64, dirty=True) == data[: 7 * K64]


def test_lost_pack_gives_chunk_missing(store):
    data = random.Random(15).randbytes(20 * K64)
    r = store.open_file(put(store, data).manifest)
    for name in os.listdir(store.packs_dir):
        os.unlink(os.path.join(store.packs_dir, name))
    store.handles.close()
    with pytest.raises(ChunkMissing):
        read_into(store.open_file(r.manifest), 0, len(data), dirty=False)


def test_readinto_while_gc_moves_chunks(store):
    def whole(m):
        r = store.open_file(m)
        return read_into(r, 0, r.size, dirty=True)

    reads_while_gc_moves_chunks(store, whole)
