"""Delta chunks: a new version of a chunk stored against its old version as zstd dictionary.

Successive memory images and disk images of one machine are ingested with ``like`` (the earlier
version); the tests show the new versions read back byte-identical, cost a fraction of what they
cost alone, always decode against a plain base (one hop), and that GC, repack and check treat a
base as the live, movable, checkable dependency it is.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ksfs.cas import ChunkStore, delta
from ksfs.cas import format as fmt
from ksfs.errors import ChunkCorrupt, NotAStore
from tests.cas_helpers import K64, flip, put, record
from tests.cli_helpers import KSFS, ksfs

PAGE = 4096


def memory_image(pages: dict[int, bytes | None]) -> bytes:
    """A libvirt save image whose RAM section holds ``pages`` (address -> page, None: zero)."""
    out = bytearray(b"QEVM\0\0\0\x03\x01\x00\x00\x00\x02")
    for i, addr in enumerate(sorted(pages)):
        out += record(addr, pages[addr], first=(i == 0))
    out += struct.pack(">Q", 0x10) + b"device state " * 200
    xml = b"<domain/>\0"
    head = b"LibvirtQemudSave" + struct.pack("<5I", 2, len(xml), 1, 0, 0) + bytes(56)
    return head + xml + bytes(out)


def guest_pages(rng: random.Random, n: int = 2048) -> dict[int, bytes | None]:
    """8 MiB of guest RAM: runs of zero pages and of pages of random bytes."""
    pages: dict[int, bytes | None] = {}
    data = False
    for i in range(n):
        if rng.random() < 1 / 16:
            data = rng.random() < 0.4
        pages[i * PAGE] = rng.randbytes(PAGE) if data else None
    return pages


def evolve(rng: random.Random, pages: dict[int, bytes | None], changes: int = 40
           ) -> dict[int, bytes | None]:
    """The next save of the same guest: pages rewritten, half-rewritten, freed (turned zero) and
    allocated (zero turned data), so the stream's offsets shift as in a real one."""
    new = dict(pages)
    for addr in rng.sample(sorted(pages), changes):
        old = pages[addr]
        kind = rng.random()
        if kind < 0.5:
            new[addr] = rng.randbytes(PAGE)
        elif kind < 0.7:
            new[addr] = None
        else:
            new[addr] = (old or bytes(PAGE))[: PAGE // 2] + rng.randbytes(PAGE // 2)
    return new


def disk_image(rng: random.Random, clusters: int = 48) -> bytes:
    return b"".join(rng.choice([bytes(K64), rng.randbytes(K64)]) for _ in range(clusters))


def touch(rng: random.Random, image: bytes, writes: int = 12) -> tuple[bytes, list]:
    """The disk after a guest wrote ``writes`` 512-byte blocks: (image, changed ranges)."""
    buf = bytearray(image)
    changed = []
    for _ in range(writes):
        off = rng.randrange(len(buf) // 512) * 512
        buf[off : off + 512] = rng.randbytes(512)
        changed.append((off, 512))
    return bytes(buf), changed


def locations(store: ChunkStore, manifest: str) -> dict[bytes, fmt.Location]:
    info = store.load_manifest(manifest)
    return {cid: store.lookup(cid) for cid, _ in info.entries if cid is not None}


def read_back(store: ChunkStore, manifest: str, want: bytes, rng: random.Random) -> None:
    reader = store.open_file(manifest)
    assert reader.read(0, len(want) + 1) == want
    for _ in range(60):
        off = rng.randrange(len(want))
        n = rng.randrange(1, 3 * K64)
        assert reader.read(off, n) == want[off : off + n]
    assert b"".join(bytes(p) for part in store.open_file(manifest).stream() for p in part) == want


@pytest.fixture
def stores(tmp_path):
    opened = []

    def make(name: str) -> ChunkStore:
        s = ChunkStore.open(tmp_path / name, create=True)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def test_memory_versions_are_deltas_read_back_and_cost_a_fraction(stores):
    rng = random.Random(7)
    versions = [guest_pages(rng)]
    for _ in range(3):
        versions.append(evolve(rng, versions[-1]))
    images = [memory_image(p) for p in versions]
    with_like, alone = stores("like"), stores("alone")
    prev = None
    later = {"like": 0, "alone": 0}
    made = []
    for i, image in enumerate(images):
        f = put(with_like, image, "cdc", like=prev)
        g = put(alone, image, "cdc")
        made.append(f)
        prev = f.manifest
        if i:
            later["like"] += f.stored
            later["alone"] += g.stored
    for f, image in zip(made, images, strict=True):
        read_back(with_like, f.manifest, image, rng)
    # every changed page costs its whole page group (pagecut.GROUP_PAGES pages) alone, about itself
    # as a delta
    assert later["like"] < 0.5 * later["alone"], later
    deltas = [loc for f in made[1:] for loc in locations(with_like, f.manifest).values()
              if loc.codec == fmt.CODEC_DELTA]
    assert len(deltas) >= 20
    for loc in deltas:  # one hop: a base is always a plain chunk
        base = with_like.lookup(loc.base)
        assert base is not None and base.codec != fmt.CODEC_DELTA
    assert with_like.check(read_data=True).ok


def test_disk_versions_are_deltas_whole_and_incremental(stores):
    rng = random.Random(11)
    v0 = disk_image(rng)
    v1, changed1 = touch(rng, v0)
    v2, changed2 = touch(rng, v1)
    store, alone = stores("like"), stores("alone")
    f0 = put(store, v0)
    f1 = put(store, v1, like=f0.manifest)  # a whole image, as `ksfs import` reads it
    f2 = put(store, v2, base=f1.manifest, changed=changed2)  # a save's changed ranges
    put(alone, v0)
    g1 = put(alone, v1)
    assert f1.stored < 0.2 * g1.stored, (f1.stored, g1.stored)
    assert f2.stored < 0.2 * g1.stored
    assert f2.base_bytes_read > 0  # the bases it read are counted
    for f, want in ((f0, v0), (f1, v1), (f2, v2)):
        read_back(store, f.manifest, want, rng)
    # v2's new chunks go back past v1's deltas to their plain bases (v0's, or v1's where v0
    # had a hole)
    plain = {cid for f in (f0, f1) for cid, loc in locations(store, f.manifest).items()
             if loc.codec != fmt.CODEC_DELTA}
    v1_deltas = {cid for cid, loc in locations(store, f1.manifest).items()
                 if loc.codec == fmt.CODEC_DELTA}
    assert v1_deltas
    for cid, loc in locations(store, f2.manifest).items():
        if cid not in v1_deltas and loc.codec == fmt.CODEC_DELTA:
            assert loc.base in plain


def disk_versions(store: ChunkStore, rng: random.Random):
    """Version 0 of a disk and versions 1 to 4, each rewriting a 512-byte block in the same 4
    clusters, each stored against the one before: (IngestedFiles, images, the 4 bases)."""
    image = disk_image(random.Random(1), 16)
    clusters = [i for i in range(16) if image[i * K64 : i * K64 + 8] != bytes(8)][:4]
    versions, made = [image], [put(store, image)]
    for _ in range(4):
        buf = bytearray(versions[-1])
        for c in clusters:
            off = c * K64 + rng.randrange(K64 // 512) * 512
            buf[off : off + 512] = rng.randbytes(512)
        versions.append(bytes(buf))
        made.append(put(store, versions[-1], like=made[-1].manifest))
    bases = {loc.base for f in made[1:] for loc in locations(store, f.manifest).values()
             if loc.base is not None}
    assert len(bases) == len(clusters)
    return made, versions, bases


def test_gc_keeps_bases_that_pay_and_stores_deltas_whole_where_that_is_smaller(stores):
    """Versions 1 to 4 of a disk each rewrite a block of the same clusters: their deltas all go
    back to version 0's chunks. Deleting version 0 keeps those bases (one base + four small
    deltas beat four whole chunks); deleting all but version 1 rewrites version 1's deltas whole
    and frees the bases (one whole chunk beats base + delta) when their pack is repacked."""
    rng = random.Random(3)
    store = stores("s")
    made, versions, bases = disk_versions(store, rng)
    ids0 = set(locations(store, made[0].manifest))
    live = {cid for f in made[1:] for cid in locations(store, f.manifest)}
    garbage = set(locations(store, put(store, rng.randbytes(200_000), "cdc").manifest))

    res = store.gc([f.manifest for f in made[1:]], threshold=0.0)
    assert res.deltas_flattened == 0 and all(store.lookup(b) for b in bases)
    assert res.chunks_freed == len(ids0 - live - bases) + len(garbage)
    # the bases only deltas keep alive move with a repack (the garbage made the pack thin)
    res = store.gc([f.manifest for f in made[1:]], threshold=1.0)
    assert res.packs_repacked and all(store.lookup(b) for b in bases)
    for f, want in zip(made[1:], versions[1:], strict=True):
        read_back(store, f.manifest, want, rng)

    v1 = locations(store, made[1].manifest)
    rest = {cid: loc for f in made[2:] for cid, loc in locations(store, f.manifest).items()
            if cid not in v1}
    base_bytes = sum(store.lookup(b).record_len for b in bases)
    before = store.stats()["stored_bytes"]
    res = store.gc([made[1].manifest], threshold=1.0)
    assert res.deltas_flattened == len(bases)
    assert not any(store.lookup(b) for b in bases)
    after = locations(store, made[1].manifest)
    flattened = [cid for cid, loc in v1.items() if loc.codec == fmt.CODEC_DELTA]
    assert len(flattened) == len(bases)
    assert all(loc.codec != fmt.CODEC_DELTA for loc in after.values())
    # freed: the other versions' chunks, the bases and v1's delta records; v1's chunks whole
    # were written instead, and they are smaller than base + delta
    freed = sum(loc.record_len for loc in rest.values()) + base_bytes + \
        sum(v1[c].record_len for c in flattened)
    whole = sum(after[c].record_len for c in flattened)
    assert res.bytes_freed == freed
    assert store.stats()["stored_bytes"] == before - freed + whole
    assert whole < base_bytes + sum(v1[c].record_len for c in flattened)
    read_back(store, made[1].manifest, versions[1], rng)
    assert store.check(read_data=True).ok


def test_gc_never_grows_pack_bytes_by_flattening(stores):
    """QA (issue 2): rm + gc of disk versions grew pack bytes (62 to 77 MB): deltas were
    flattened, counting their base's record as given back, while the base's pack stayed (too
    full to repack) with the base's bytes in it. Here version 0's pack keeps 3/4 of its bytes
    live, so no gc at threshold 0.5 repacks it: flattening would only add bytes."""
    rng = random.Random(30)
    store = stores("s")
    v0 = rng.randbytes(16 * K64)
    v1, _ = touch(rng, v0, writes=4)
    f0 = put(store, v0)
    f1 = put(store, v1, like=f0.manifest)
    assert any(loc.codec == fmt.CODEC_DELTA for loc in locations(store, f1.manifest).values())
    before = store.stats()["pack_bytes"]
    res = store.gc([f1.manifest], threshold=0.5)
    assert res.deltas_flattened == 0 and res.bytes_rewritten == 0
    assert store.stats()["pack_bytes"] <= before
    read_back(store, f1.manifest, v1, rng)
    assert store.check(read_data=True).ok
    # once the pack is repacked (garbage made it thin), the base's bytes do come back: then
    # the deltas go whole
    put(store, rng.randbytes(40 * K64), "cdc")
    before = store.stats()["pack_bytes"]
    res = store.gc([f1.manifest], threshold=0.5)
    assert res.deltas_flattened > 0 and res.packs_repacked
    assert store.stats()["pack_bytes"] < before
    read_back(store, f1.manifest, v1, rng)
    assert store.check(read_data=True).ok


GC = ("import sys; from ksfs.cas import ChunkStore; "
      "print(ChunkStore.open(sys.argv[1]).gc(sys.argv[2:], threshold=1.0).deltas_flattened)")


@pytest.mark.parametrize("point", ["gc.flatten", "gc.sweep"])
def test_gc_killed_around_flattening_loses_nothing(stores, point):
    rng = random.Random(8)
    store = stores("s")
    made, versions, bases = disk_versions(store, rng)
    live = [made[1].manifest]
    env = {**os.environ, "KSFS_CRASH_AT": point}
    res = subprocess.run([sys.executable, "-c", GC, store.path, *live], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr
    read_back(store, made[1].manifest, versions[1], rng)
    assert store.check(read_data=True).ok
    env.pop("KSFS_CRASH_AT")
    res = subprocess.run([sys.executable, "-c", GC, store.path, *live], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    # killed before its commit, flattening is done again; killed after it, only the sweep is
    assert int(res.stdout) == (len(bases) if point == "gc.flatten" else 0)
    assert not any(store.lookup(b) for b in bases)
    read_back(store, made[1].manifest, versions[1], rng)
    report = store.check(read_data=True)
    assert report.ok and not report.orphan_packs and report.orphan_bytes == 0


def test_repack_moves_bases_and_deltas(stores):
    rng = random.Random(4)
    store = stores("s")
    pages0 = guest_pages(rng)
    m0, m1 = memory_image(pages0), memory_image(evolve(rng, pages0))
    f0 = put(store, m0, "cdc")
    f1 = put(store, m1, "cdc", like=f0.manifest)
    put(store, rng.randbytes(300_000), "cdc")  # garbage, so the pack is thin
    res = store.gc([f0.manifest, f1.manifest], threshold=1.0)
    assert res.packs_repacked and res.deltas_flattened == 0
    read_back(store, f1.manifest, m1, rng)
    assert store.check(read_data=True).ok
    store.gc([], threshold=0.5)
    assert store.stats()["chunks"] == 0


def test_a_damaged_or_lost_base_is_named_with_its_deltas(stores):
    rng = random.Random(5)
    store = stores("s")
    v0 = disk_image(rng)
    v1, _ = touch(rng, v0, writes=10)
    f0 = put(store, v0)
    f1 = put(store, v1, like=f0.manifest)
    deltas = {cid: loc for cid, loc in locations(store, f1.manifest).items()
              if loc.codec == fmt.CODEC_DELTA}
    cid, loc = next(iter(deltas.items()))
    flip(store, loc.base)
    reader = store.open_file(f1.manifest)
    start = next(s for s, _, c in reader.stored_extents() if c == cid)
    with pytest.raises(ChunkCorrupt) as err:
        reader.read(start, 100)
    assert err.value.fields["chunk"] == cid.hex() and loc.base.hex() in str(err.value)
    with pytest.raises(ChunkCorrupt) as err:  # the stream reads bases ahead: same answer
        b"".join(bytes(p) for part in store.open_file(f1.manifest).stream() for p in part)
    assert err.value.fields["chunk"] == cid.hex() and loc.base.hex() in str(err.value)
    report = store.check(read_data=True)
    assert loc.base.hex() in report.damaged_chunks
    assert loc.base.hex() in report.damaged_chunks[cid.hex()]
    assert {f0.manifest, f1.manifest} <= set(report.affected_manifests)

    # a base gone from the index: check names the delta without reading any data
    with store.env.begin(write=True) as txn:
        txn.delete(loc.base, db=store.db["chunks"])
    report = store.check(read_data=False)
    assert "not in the index" in report.damaged_chunks[cid.hex()]
    assert f1.manifest in report.affected_manifests


def test_a_reference_that_cannot_serve_only_means_no_deltas(stores):
    rng = random.Random(9)
    store = stores("s")
    v0 = disk_image(rng, 8)
    v1, _ = touch(rng, v0)
    mem = put(store, memory_image(guest_pages(rng, 64)), "cdc")
    for like in ("00" * 32, mem.manifest):  # unknown; cut another way
        f = put(store, v1, like=like)
        assert all(loc.codec != fmt.CODEC_DELTA for loc in locations(store, f.manifest).values())
        read_back(store, f.manifest, v1, rng)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), edits=st.lists(
    st.tuples(st.floats(0, 1), st.integers(0, 3000), st.integers(0, 3)), max_size=12))
def test_edited_files_round_trip_as_deltas(tmp_path_factory, seed, edits):
    """Overwrites, inserts and deletes at any place: every version reads back exactly."""
    rng = random.Random(seed)
    text = b" ".join(b"w%d" % rng.randrange(5000) for _ in range(60_000))
    data = bytearray(text[: 200_000] + rng.randbytes(60_000) + bytes(70_000) + text[200_000:])
    for where, n, kind in edits:
        at = int(where * len(data))
        if kind == 0:
            data[at : at + n] = rng.randbytes(n)
        elif kind == 1:
            data[at:at] = rng.randbytes(n)
        elif kind == 2:
            del data[at : at + n]
        else:
            data[at : at + n] = bytes(n)
    store = ChunkStore.open(tmp_path_factory.mktemp("h") / "s", create=True)
    try:
        f0 = put(store, text, "cdc")
        f1 = put(store, bytes(data), "cdc", like=f0.manifest)
        read_back(store, f1.manifest, bytes(data), rng)
        read_back(store, f0.manifest, text, rng)
    finally:
        store.close()


def test_ksfs_import_stores_against_the_sessions_last_checkpoint(tmp_path):
    rng = random.Random(13)
    pages = guest_pages(rng)
    images = [memory_image(pages), memory_image(evolve(rng, pages))]
    paths = []
    for i, image in enumerate(images):
        p = tmp_path / f"c{i}" / "memory"
        p.parent.mkdir()
        p.write_bytes(image)
        paths.append(p)
    store, plain = tmp_path / "store", tmp_path / "plain"

    def stored(where, *args: str) -> int:
        files = json.loads(ksfs(where, None, "import", "--json", *args).stdout)["files"]
        return sum(f["stored"] for f in files)

    assert stored(store, "s", "c0", str(paths[0])) > 0
    second = stored(store, "s", "c1", str(paths[1]))
    stored(plain, "a", "c0", str(paths[0]))
    alone = stored(plain, "b", "c1", str(paths[1]))  # another session: nothing to go by
    assert second < 0.5 * alone, (second, alone)
    cat = subprocess.run([*KSFS, "--store", str(store), "cat", "s", "c1", "memory"],
                         capture_output=True, check=True).stdout
    assert cat == images[1]
    assert ksfs(store, None, "check", "--read-data").returncode == 0


def test_a_version_1_store_is_read_and_marked_current_before_its_first_delta(tmp_path):
    """Stores from before deltas open as they are; an ingest raises the marker first, so an
    older ksfs refuses the store instead of taking its deltas for damage. An unknown version is
    refused and left alone."""
    rng = random.Random(17)
    v0 = disk_image(rng, 8)
    path = tmp_path / "s"
    with ChunkStore.open(path, create=True) as store:
        f0 = put(store, v0)
    marker = path / "ksfs.json"
    old = json.loads(marker.read_text())
    marker.write_text(json.dumps({**old, "version": 1}))
    with ChunkStore.open(path) as store:
        assert store.open_file(f0.manifest).read(0, len(v0)) == v0
        assert json.loads(marker.read_text())["version"] == 1  # reading changes nothing
        v1, _ = touch(rng, v0)
        put(store, v1, like=f0.manifest)
    assert json.loads(marker.read_text()) == {**old, "version": 4}
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("ksfs.json")) == [
        "ksfs.json"]
    marker.write_text(json.dumps({**old, "version": 5}))
    with pytest.raises(NotAStore, match="version 5"):
        ChunkStore.open(path)
    assert json.loads(marker.read_text())["version"] == 5


def test_old_versions_are_found_by_byte_distance_across_zero_runs():
    """The reference merges a zero run into one hole entry; the new file has a chunk per 64 KiB
    of it. Chunks after the run still map to their own old versions, from the nearer anchor."""
    a, b, c, d, x = (bytes([i]) * 32 for i in range(1, 6))
    ref = delta.Reference([(a, 1000), (None, 5 * K64), (b, 3000), (c, 2000), (d, 500)])
    offsets = [0, 1000] + [1000 + i * K64 for i in range(1, 5)] + [1000 + 5 * K64]
    offsets += [offsets[-1] + 3000, offsets[-1] + 5000]
    ids = [a] + [None] * 5 + [x, x + b"2", d]  # b and c rewritten, d kept
    got = delta.Reference.candidates(ref, offsets, ids)
    assert got[6] == b and got[7] == c
    assert got[1:6] == [None] * 5 and got[0] is None and got[8] is None
    # an id held twice in the old file anchors nothing
    twice = delta.Reference([(a, 100), (b, 100), (a, 100), (c, 100)])
    assert twice.candidates([0, 100], [a, x]) == [None, None]
    assert twice.candidates([0, 100], [b, x]) == [None, a]


def test_a_chunk_that_grew_finds_its_old_version_from_the_anchor_after_it():
    """Measured back from the anchor after it, a chunk's end lines up with its old version's
    end: a page group whose zero pages took data is longer than before, and its start, measured
    back, lies in the old chunk before its own (which holds none of its pages)."""
    a, b, c, d, x, y = (bytes([i]) * 32 for i in range(1, 7))
    ref = delta.Reference([(a, 5000), (b, 1000), (c, 5000), (d, 1000)])
    # b grew from 1000 to 3000 bytes (x), c is kept: c anchors x, and a is too far to
    assert ref.candidates([0, 3000], [x, c]) == [b, None]
    # two changed chunks before the anchor: each maps back by the bytes between it and c
    assert ref.candidates([0, 4000, 7000], [y, x, c]) == [a, b, None]
    # from an anchor before, starts line up as they did
    assert ref.candidates([0, 5000, 8000], [a, x, y]) == [None, b, c]


def test_a_delta_is_kept_only_when_a_tenth_smaller_than_the_chunk_alone(stores):
    rng = random.Random(19)
    store = stores("s")
    pages = guest_pages(rng)
    for k in list(pages)[::7]:  # pages that compress well alone, changed or not
        pages[k] = (b"%d " % k * PAGE)[: PAGE // 2] + bytes(PAGE // 2)
    f0 = put(store, memory_image(pages), "cdc")
    f1 = put(store, memory_image(evolve(rng, pages, 80)), "cdc", like=f0.manifest)
    alone = zstandard.ZstdCompressor(level=3)
    kept = 0
    for cid, loc in locations(store, f1.manifest).items():
        if loc.codec == fmt.CODEC_DELTA:
            plain = store.read_chunk(cid)
            assert loc.stored_len < 0.9 * min(len(alone.compress(plain)), len(plain))
            kept += 1
    assert kept


def test_check_names_an_index_entry_whose_codec_and_base_disagree(stores):
    rng = random.Random(23)
    store = stores("s")
    v0 = disk_image(rng, 16)
    f0 = put(store, v0)
    f1 = put(store, touch(rng, v0)[0], like=f0.manifest)
    cid, loc = next((c, lo) for c, lo in locations(store, f1.manifest).items()
                    if lo.codec == fmt.CODEC_DELTA)
    with store.env.begin(write=True) as txn:  # the base id lost from the index entry
        txn.put(cid, fmt.Location(loc.pack, loc.offset, loc.stored_len, loc.plain_len,
                                  loc.codec).encode(), db=store.db["chunks"])
    assert "disagree" in store.check().damaged_chunks[cid.hex()]
    with store.env.begin(write=True) as txn:  # an index entry naming another base
        txn.put(cid, fmt.Location(loc.pack, loc.offset, loc.stored_len, loc.plain_len,
                                  loc.codec, base=bytes(32)).encode(), db=store.db["chunks"])
    with pytest.raises(ChunkCorrupt, match="another base"):
        store.read_chunk(cid)
    assert cid.hex() in store.check().damaged_chunks


def test_racing_marker_upgrades_leave_one_whole_marker(tmp_path):
    import threading

    from ksfs.cas import store as store_mod

    path = tmp_path / "s"
    ChunkStore.open(path, create=True).close()
    old = json.loads((path / "ksfs.json").read_text())
    threads = [threading.Thread(target=store_mod._write_marker,
                                args=(str(path), {**old, "n": i})) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads((path / "ksfs.json").read_text())["id"] == old["id"]
    assert [p.name for p in path.iterdir() if p.name.startswith("ksfs.json")] == ["ksfs.json"]


def test_a_failing_flatten_leaves_nothing_and_gc_goes_on(stores, monkeypatch):
    """A full disk while the deltas are rewritten: the packs begun are removed, the deltas and
    their bases stay as they were, and the sweep still frees the garbage."""
    import errno

    from ksfs.cas import flatten

    rng = random.Random(21)
    store = stores("s")
    made, versions, bases = disk_versions(store, rng)

    real = flatten.append_to
    begun = []

    def full(writers, *a, **k):
        real(writers, *a, **k)  # a pack begun, then the disk is full
        begun.append(writers[-1].path)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(flatten, "append_to", full)
    res = store.gc([made[1].manifest], threshold=1.0)
    assert "No space left" in res.flatten_skipped and res.deltas_flattened == 0
    assert res.chunks_freed > 0 and all(store.lookup(b) for b in bases)
    assert begun  # ... and removed: no pack file is left that the index does not list
    read_back(store, made[1].manifest, versions[1], rng)
    report = store.check(read_data=True)
    assert report.ok and not report.orphan_packs and report.orphan_bytes == 0
    monkeypatch.undo()
    put(store, rng.randbytes(len(versions[1])), "cdc")  # garbage: the pack is thin again
    assert store.gc([made[1].manifest], threshold=1.0).deltas_flattened == len(bases)


@pytest.mark.parametrize("base_len, count", [(32 * 1024, 1), (32 * 1024, fmt.MAX_BASES),
                                             (K64, 1), (K64, fmt.MAX_BASES), (2 << 20, 1)])
def test_a_delta_finds_pages_in_every_base_and_decodes_with_them(base_len, count):
    """A delta's frame is made with its bases as a zstd prefix and read with them as a
    raw-content dictionary: the pages it repeats from the first base's start and the last
    base's end (the far ends of the prefix, which a hash table sized to less would miss) cost
    a few bytes, and the frame decodes to the chunk byte for byte."""
    rng = random.Random(base_len * 100 + count)
    bases = [rng.randbytes(base_len) for _ in range(count)]
    joined = b"".join(bases)
    new = rng.randbytes(PAGE)
    data = bases[0][:PAGE] + new + bases[-1][-PAGE:] + bases[count // 2][base_len // 2:][:PAGE]
    frame = delta.compress(data, joined)
    assert len(frame) < PAGE + 200, len(frame)  # only the new page costs its bytes
    assert delta.decompress(b"\0" * 32, frame, joined, len(data)) == data
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == len(data) and params.dict_id == 0
    # zstd keeps no checksum of a delta: other bases decode to other bytes (or fail), which
    # the chunk's id then refuses (the store's reads check every chunk)
    other = rng.randbytes(len(joined))
    try:
        assert delta.decompress(b"\0" * 32, frame, other, len(data)) != data
    except ChunkCorrupt:
        pass


@pytest.mark.parametrize("base_len", [0, 1, 7, 8, 9])
def test_a_base_of_a_few_bytes_makes_a_frame_that_decodes(base_len):
    """zstd takes no prefix under 8 bytes: a delta on such a base is a plain frame, which
    decodes with the base as a raw dictionary like any other."""
    base = bytes(range(1, base_len + 1))
    data = base + b"grown by a few bytes"
    frame = delta.compress(data, base)
    assert delta.decompress(b"\0" * 32, frame, base, len(data)) == data


def test_a_disk_image_of_a_few_bytes_grown_is_imported(tmp_path):
    """QA (thirtieth session): a disk image of 1 byte imported again at 2 bytes failed with a
    traceback (its old version, 1 byte, was given to zstd as a prefix); each size in turn is
    imported, read back and checked clean."""
    store, disk = tmp_path / "store", tmp_path / "disk.raw"
    for n, content in enumerate([b"a", b"ab", b"abcdefghijkl", b"", b"x" * 9]):
        disk.write_bytes(content)
        res = ksfs(store, None, "import", "s", f"c{n}", str(disk))
        assert res.returncode == 0, res
        cat = subprocess.run([*KSFS, "--store", str(store), "cat", "s", f"c{n}", "disk.raw"],
                             capture_output=True, check=True).stdout
        assert cat == content
    assert ksfs(store, None, "check", "--read-data").returncode == 0
