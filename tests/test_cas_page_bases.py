"""Page bases: a new chunk whose pages repeat those of another new chunk of the same ingest is
stored as a delta against that chunk, when that beats its old version.

A guest's page cache holds the bytes it just wrote from a tmpfs buffer, and a disk block written
back holds what the page cache still has: those copies cost their pages once. The tests show
such chunks become deltas on a plain chunk of the same ingest, read back byte-identical and
check clean, and that a base another import commits first as a delta never leaves a delta two
hops from its bytes.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksfs.cas import format as fmt
from ksfs.cas import pagecut
from ksfs.cas import reader as reader_module
from ksfs.cas.chunking import FIXED_SIZE
from ksfs.errors import ChunkCorrupt
from tests import test_cas_delta
from tests.cas_helpers import BytesSource, flip, put, record
from tests.test_cas_delta import PAGE, locations, memory_image, read_back

stores = test_cas_delta.stores  # the fixture: a store per name, closed after the test


@pytest.fixture(autouse=True)
def one_digest_part(monkeypatch):
    """These tests look at what a chunk finds as it is stored, in file order: one part per
    batch, so no two of their groups are stored at once on the two workers (what the seal then
    finds is tests/test_cas_rework.py's)."""
    from ksfs.cas import ingest

    monkeypatch.setattr(ingest, "DIGEST_PARTS", 1)

GROUP = pagecut.GROUP_PAGES  # pages per page group
CLUSTER = FIXED_SIZE // PAGE  # pages per disk cluster
# A copy finds its source as it is stored only if that was stored before it: with one digest
# part per batch (the fixture above) chunks are stored in file order, so each test's source
# group comes before its copies (groups 1 and 3 of 16, and so on).


def chunk_holding(entries: list, image: bytes, page: bytes, second: bool = False) -> bytes:
    """The id of the chunk (of a manifest's entries) holding the first place of ``page`` in
    ``image``, or its second place."""
    at = image.index(page)
    if second:
        at = image.index(page, at + 1)
    pos = 0
    for cid, length in entries:
        if pos <= at < pos + length:
            return cid
        pos += length
    raise AssertionError("page not found in the manifest")


def guest(rng: random.Random, groups: int = 16) -> dict[int, bytes | None]:
    return {i * PAGE: rng.randbytes(PAGE) for i in range(groups * GROUP)}


def with_group(pages: dict, group: int, content: list[bytes]) -> dict:
    new = dict(pages)
    for k, page in enumerate(content):
        new[(group * GROUP + k) * PAGE] = page
    return new


def test_a_group_that_copies_another_new_group_is_a_delta_on_it(stores):
    rng = random.Random(3)
    store, alone = stores("pages"), stores("alone")
    v0 = guest(rng)
    fresh = [rng.randbytes(PAGE) for _ in range(GROUP)]
    # group 1 is new random bytes, group 3 the same bytes again (written from it), both new
    v1 = with_group(with_group(v0, 1, fresh), 3, fresh[3:] + fresh[:3])
    img0, img1 = memory_image(v0), memory_image(v1)
    f0 = put(store, img0, "cdc")
    f1 = put(store, img1, "cdc", like=f0.manifest)
    put(alone, img0, "cdc")
    g1 = put(alone, img1, "cdc")
    entries = store.load_manifest(f1.manifest).entries
    source = chunk_holding(entries, img1, fresh[0])
    copy = chunk_holding(entries, img1, fresh[3], second=True)
    assert source != copy
    loc_copy, loc_source = store.lookup(copy), store.lookup(source)
    assert loc_source.codec not in fmt.DELTA_CODECS
    # on the chunk it copies (and its old version, the old bytes of its addresses, when the
    # copy was found as it was stored rather than at the seal: the two workers race for it)
    assert loc_copy.codec in fmt.DELTA_CODECS and source in loc_copy.base_ids
    assert loc_copy.stored_len < 0.1 * loc_source.stored_len
    # the copy costs about nothing: what the new version stored is about one group of pages
    assert f1.stored < 0.6 * g1.stored, (f1.stored, g1.stored)
    read_back(store, f1.manifest, img1, rng)
    assert store.check(read_data=True).ok


def test_a_disk_cluster_written_back_is_a_delta_on_the_memory_that_holds_it(stores):
    rng = random.Random(5)
    store = stores("pages")
    # Cluster 1 is written back from fresh memory groups 1 and 5, half of it from each (from
    # groups 1, 5, 9 and so on, the same share from each, where a group holds under half of it)
    spread = max(2, -(-CLUSTER // GROUP))
    v0 = guest(rng, max(16, 4 * spread))
    disk0 = b"".join(rng.randbytes(PAGE) for _ in range(4 * CLUSTER))  # four 64 KiB clusters
    fresh = [[rng.randbytes(PAGE) for _ in range(GROUP)] for _ in range(spread)]
    v1 = v0
    for n, group in enumerate(fresh):
        v1 = with_group(v1, 1 + 4 * n, group)
    share = -(-CLUSTER // spread)
    cluster1 = b"".join(page for group in fresh for page in group[:share])[: FIXED_SIZE]
    disk1 = disk0[:FIXED_SIZE] + cluster1 + disk0[2 * FIXED_SIZE :]
    assert len(disk1) == len(disk0)
    img0, img1 = memory_image(v0), memory_image(v1)
    with store.ingest() as ing:
        m0 = ing.add_file(BytesSource(img0), chunking="cdc")
        d0 = ing.add_file(BytesSource(disk0))
        ing.seal()
        with store.env.begin(write=True) as txn:
            ing.commit(txn)
    with store.ingest() as ing:
        m1 = ing.add_file(BytesSource(img1), chunking="cdc", like=m0.manifest)
        d1 = ing.add_file(BytesSource(disk1), like=d0.manifest)
        ing.seal()
        with store.env.begin(write=True) as txn:
            ing.commit(txn)
    cluster = store.load_manifest(d1.manifest).entries[1][0]
    loc = store.lookup(cluster)
    memory_chunks = {cid for cid, _ in store.load_manifest(m1.manifest).entries}
    assert loc.codec in fmt.DELTA_CODECS and set(loc.base_ids) & memory_chunks
    assert all(store.lookup(b).codec not in fmt.DELTA_CODECS for b in loc.base_ids)
    # under what a base holding half its pages would leave (its pages are all in its bases)
    assert loc.stored_len < 0.6 * FIXED_SIZE
    read_back(store, d1.manifest, disk1, rng)
    read_back(store, m1.manifest, img1, rng)
    assert store.check(read_data=True).ok


def racing(rng: random.Random, store) -> tuple:
    """Two imports of the same new group: (v2, v2_other, f0, f1, the group's pages). v1's
    group 1 is fresh but for one page: against v1, v2's group 1 is a good delta; against v0 it
    is new, so an ingest of v2 like v0 stores it whole and builds its copy in group 3 on it.
    v2_other has that group 1 but another group 3."""
    v0 = guest(rng)
    fresh = [rng.randbytes(PAGE) for _ in range(GROUP)]
    v1 = with_group(v0, 1, [rng.randbytes(PAGE)] + fresh[1:])
    v2 = with_group(with_group(v0, 1, fresh), 3, fresh[::-1])
    v2_other = with_group(v2, 3, [rng.randbytes(PAGE) for _ in range(GROUP)])
    f0 = put(store, memory_image(v0), "cdc")
    f1 = put(store, memory_image(v1), "cdc", like=f0.manifest)
    return v2, v2_other, f0, f1, fresh


def test_a_base_another_import_commits_first_as_a_delta_leaves_no_second_hop(stores):
    rng = random.Random(9)
    store = stores("pages")
    v2, v2_other, f0, f1, fresh = racing(rng, store)
    img2 = memory_image(v2)
    with store.ingest() as ing:
        f2 = ing.add_file(BytesSource(img2), chunking="cdc", like=f0.manifest)
        entries = fmt.decode_manifest(ing.manifests[bytes.fromhex(f2.manifest)]).entries
        copy = ing.new[chunk_holding(entries, img2, fresh[-1], second=True)]
        assert copy.codec in fmt.DELTA_CODECS  # on group 1's chunk, new in this ingest
        base = group1 = chunk_holding(entries, img2, fresh[0])
        assert group1 in copy.base_ids
        # another import commits group 1's chunk first, as a delta on v1's group 1
        other = put(store, memory_image(v2_other), "cdc", like=f1.manifest)
        assert store.lookup(base).codec in fmt.DELTA_CODECS
        ing.seal()
        with store.env.begin(write=True) as txn:
            ing.commit(txn)
    for cid, loc in locations(store, f2.manifest).items():
        for b in loc.base_ids:
            assert store.lookup(b).codec not in fmt.DELTA_CODECS, cid.hex()
    read_back(store, f2.manifest, img2, rng)
    read_back(store, other.manifest, memory_image(v2_other), rng)
    assert store.check(read_data=True).ok


def test_a_base_committed_as_a_delta_between_seal_and_commit_publishes_nothing(stores,
                                                                               monkeypatch):
    from ksfs.cas import ingest as ingest_mod
    from ksfs.errors import Busy

    monkeypatch.setattr(ingest_mod, "SEAL_WAIT_S", 0.2)  # the other import seals without it
    rng = random.Random(13)
    store = stores("pages")
    v2, v2_other, f0, f1, _ = racing(rng, store)
    before = store.stats()
    try:
        with store.ingest() as ing:
            f2 = ing.add_file(BytesSource(memory_image(v2)), chunking="cdc", like=f0.manifest)
            ing.seal()  # holds the seal lock until it closes
            other = put(store, memory_image(v2_other), "cdc", like=f1.manifest)
            with store.env.begin(write=True) as txn:
                ing.commit(txn)
    except Busy as exc:
        assert "import again" in str(exc)
    else:
        raise AssertionError("a delta two hops from its bytes was published")
    assert store.load_manifest(other.manifest)
    read_back(store, other.manifest, memory_image(v2_other), rng)
    assert store.stats()["chunks"] == before["chunks"] + len(
        {c for c, _ in store.load_manifest(other.manifest).entries if c is not None}
        - {c for f in (f0, f1) for c, _ in store.load_manifest(f.manifest).entries})
    assert bytes.fromhex(f2.manifest) not in dict(store.env.begin().cursor(
        db=store.db["manifests"]))
    assert store.check(read_data=True).ok


def copies(rng: random.Random, store) -> tuple:
    """v0, then v1 whose group 3 copies its new group 1: (images, files, the copy's id)."""
    v0 = guest(rng)
    fresh = [rng.randbytes(PAGE) for _ in range(GROUP)]
    v1 = with_group(with_group(v0, 1, fresh), 3, fresh[3:] + fresh[:3])
    imgs = memory_image(v0), memory_image(v1)
    f0 = put(store, imgs[0], "cdc")
    f1 = put(store, imgs[1], "cdc", like=f0.manifest)
    entries = store.load_manifest(f1.manifest).entries
    return imgs, (f0, f1), chunk_holding(entries, imgs[1], fresh[3], second=True)


def test_gc_keeps_every_base_of_a_delta_on_several_or_stores_it_whole(stores):
    rng = random.Random(21)
    store = stores("pages")
    imgs, (f0, f1), copy = copies(rng, store)
    loc = store.lookup(copy)
    assert loc.codec == fmt.CODEC_DELTAS and len(loc.base_ids) == 2
    old = next(b for b in loc.base_ids if b not in dict(store.load_manifest(f1.manifest).entries))
    # v0 goes: its group 3 stays as a base of the copy alone. Without a repack no bytes come
    # back by storing the copy whole, so the base is kept
    res = store.gc([f1.manifest], threshold=0.0)
    assert res.deltas_flattened == 0 and store.lookup(copy) == loc
    assert all(store.lookup(b) is not None for b in loc.base_ids)
    read_back(store, f1.manifest, imgs[1], rng)
    assert store.check(read_data=True).ok
    # repacking the pack: the copy whole costs less than it and the old base, which goes
    res = store.gc([f1.manifest], threshold=1.0)
    assert res.deltas_flattened == 1
    assert store.lookup(copy).codec not in fmt.DELTA_CODECS and store.lookup(old) is None
    read_back(store, f1.manifest, imgs[1], rng)
    assert store.check(read_data=True).ok


def test_a_damaged_second_base_is_named_with_its_delta(stores):
    rng = random.Random(23)
    store = stores("pages")
    imgs, (f0, f1), copy = copies(rng, store)
    loc = store.lookup(copy)
    second = loc.base_ids[1]
    flip(store, second)
    report = store.check(read_data=True)
    assert second.hex() in report.damaged_chunks
    assert second.hex() in report.damaged_chunks[copy.hex()]
    reader = store.open_file(f1.manifest)
    start = next(s for s, _, c in reader.stored_extents() if c == copy)
    with pytest.raises(ChunkCorrupt) as err:
        reader.read(start, 100)
    assert err.value.fields["chunk"] == copy.hex() and second.hex() in str(err.value)
    with pytest.raises(ChunkCorrupt) as err:  # the stream reads bases ahead: same answer
        b"".join(bytes(p) for part in store.open_file(f1.manifest).stream() for p in part)
    assert err.value.fields["chunk"] == copy.hex() and second.hex() in str(err.value)


def test_an_index_entry_whose_base_count_and_codec_disagree_is_named(stores):
    rng = random.Random(25)
    store = stores("pages")
    _, _, copy = copies(rng, store)
    loc = store.lookup(copy)
    one_base = dataclasses.replace(loc, base=loc.base_ids[0])  # codec 3 with a single base
    with store.env.begin(write=True) as txn:
        txn.put(copy, one_base.encode(), db=store.db["chunks"])
    report = store.check(read_data=False)
    assert "codec and base disagree" in report.damaged_chunks[copy.hex()]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=20_000), st.integers(0, 2**16))
def test_data_pages_reads_any_bytes_and_real_records_exactly(noise, addr):
    pagecut.data_pages(noise)  # a hint only: any bytes give some list, never an exception
    rng = random.Random(addr)
    pages = {(addr + i) * PAGE: (rng.randbytes(PAGE) if rng.random() < 0.5 else None)
             for i in range(12)}
    chunk = b"".join(record(a, pages[a], first=(i == 0)) for i, a in enumerate(sorted(pages)))
    assert pagecut.data_pages(chunk) == [p for _, p in sorted(pages.items()) if p is not None]


def test_what_a_checkpoint_holds_counts_every_base_of_its_deltas(stores):
    """Review: held_chunks (the mount's st_blocks, `du`) took a delta's bases for one id."""
    rng = random.Random(21)
    store = stores("pages")
    _, (_, f1), copy = copies(rng, store)
    loc = store.lookup(copy)
    held = store.held_chunks([f1.manifest])
    for base in loc.base_ids:
        assert held[base] == store.lookup(base).record_len
    assert loc.base not in held  # no key made of several ids


def test_gc_frees_nothing_while_an_entry_names_fewer_bases_than_its_codec(stores):
    """Review: an entry that lost a base id still decoded, and GC swept the base its record
    needs; now GC stops before deleting anything, as for any entry it cannot read."""
    from ksfs.errors import StoreDamaged

    rng = random.Random(21)
    store = stores("pages")
    imgs, (_, f1), copy = copies(rng, store)
    loc = store.lookup(copy)
    live = dict(store.load_manifest(f1.manifest).entries)
    with store.env.begin(write=True) as txn:
        txn.put(copy, dataclasses.replace(loc, base=next(
            b for b in loc.base_ids if b in live)).encode(), db=store.db["chunks"])
    with pytest.raises(StoreDamaged, match="names 1 bases for codec 3"):
        store.gc([f1.manifest], threshold=1.0)
    assert all(store.lookup(b) is not None for b in loc.base_ids)
    with store.env.begin(write=True) as txn:  # the entry mended: nothing was lost
        txn.put(copy, loc.encode(), db=store.db["chunks"])
    read_back(store, f1.manifest, imgs[1], rng)
    assert store.check(read_data=True).ok


def test_new_chunks_kept_as_page_homes_leave_the_old_bases_their_budget(stores, monkeypatch):
    """Review: page homes took from the budget of old versions' bases, so after 64 MiB of new
    data the seal read every later delta's base from its pack again."""
    from ksfs.cas import ingest as ingest_mod

    monkeypatch.setattr(ingest_mod, "BASES_KEPT", 2 << 20)  # 64 MiB at 1/32 scale
    rng = random.Random(1)
    store = stores("pages")
    old = [rng.randbytes(64 << 10) for _ in range(16)]
    # 128 clusters (8 MiB) of new data first, then the old clusters with one page changed each
    new = [rng.randbytes(64 << 10) for _ in range(128)] + [
        c[:PAGE] + rng.randbytes(PAGE) + c[2 * PAGE :] for c in old]
    f0 = put(store, bytes(128 << 16) + b"".join(old))
    reads = []
    monkeypatch.setattr(store, "read_base", lambda cid: reads.append(cid) or 1 / 0)
    f1 = put(store, b"".join(new), like=f0.manifest)
    assert not reads  # the seal verified the deltas against the bases it kept
    assert sum(store.lookup(c).codec in fmt.DELTA_CODECS
               for c, _ in store.load_manifest(f1.manifest).entries[128:]) == 16


def test_a_stream_reads_a_base_several_deltas_share_once(stores, monkeypatch):
    rng = random.Random(27)
    store = stores("pages")
    v0 = guest(rng)
    fresh = [rng.randbytes(PAGE) for _ in range(GROUP)]
    v1 = with_group(with_group(with_group(v0, 1, fresh), 3, fresh[::-1]), 5, fresh[2:] + fresh[:2])
    imgs = memory_image(v0), memory_image(v1)
    f0 = put(store, imgs[0], "cdc")
    f1 = put(store, imgs[1], "cdc", like=f0.manifest)
    entries = store.load_manifest(f1.manifest).entries
    source = chunk_holding(entries, imgs[1], fresh[0])
    copies_of = [chunk_holding(entries, imgs[1], page, second=True)
                 for page in (fresh[-1], fresh[2])]
    assert all(source in store.lookup(c).base_ids for c in copies_of)
    # a base is read either ahead, with the task's other bases (_check_record without bases:
    # a base is never a delta), or on its own (read_base)
    asked: list[bytes] = []
    read_base = store.read_base
    monkeypatch.setattr(store, "read_base", lambda cid: asked.append(cid) or read_base(cid))
    check_record = reader_module._check_record

    def check_counted(cid, loc, span, span_off, dctx, bases):
        if bases is None:
            asked.append(cid)
        return check_record(cid, loc, span, span_off, dctx, bases)

    monkeypatch.setattr(reader_module, "_check_record", check_counted)
    assert b"".join(bytes(p) for part in store.open_file(f1.manifest).stream() for p in part) \
        == imgs[1]
    assert asked.count(source) == 1, asked
