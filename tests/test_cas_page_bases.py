"""Page bases: a new chunk whose pages repeat those of another new chunk of the same ingest is
stored as a delta against that chunk, when that beats its old version.

A guest's page cache holds the bytes it just wrote from a tmpfs buffer, and a disk block written
back holds what the page cache still has: those copies cost their pages once. The tests show
such chunks become deltas on a plain chunk of the same ingest, read back byte-identical and
check clean, and that a base another import commits first as a delta never leaves a delta two
hops from its bytes.
"""

from __future__ import annotations

import random

from ksfs.cas import format as fmt
from tests import test_cas_delta
from tests.cas_helpers import BytesSource, put
from tests.test_cas_delta import PAGE, locations, memory_image, read_back

stores = test_cas_delta.stores  # the fixture: a store per name, closed after the test

GROUP = 8  # pages per page group (pagecut.GROUP_PAGES)
# An ingest hashes a batch in two halves on two workers at once: a copy finds its source only if
# that was stored before, so each test's source and copy groups lie in the first half (groups 1
# and 3 of 16).


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
    assert loc_source.codec != fmt.CODEC_DELTA
    assert loc_copy.codec == fmt.CODEC_DELTA and loc_copy.base == source
    assert loc_copy.stored_len < 0.1 * loc_source.stored_len
    # the copy costs about nothing: what the new version stored is about one group of pages
    assert f1.stored < 0.6 * g1.stored, (f1.stored, g1.stored)
    read_back(store, f1.manifest, img1, rng)
    assert store.check(read_data=True).ok


def test_a_disk_cluster_written_back_is_a_delta_on_the_memory_that_holds_it(stores):
    rng = random.Random(5)
    store = stores("pages")
    v0 = guest(rng)
    disk0 = b"".join(rng.randbytes(PAGE) for _ in range(4 * 16))  # four 64 KiB clusters
    fresh = [rng.randbytes(PAGE) for _ in range(2 * GROUP)]
    v1 = with_group(with_group(v0, 1, fresh[:GROUP]), 5, fresh[GROUP:])
    disk1 = disk0[: 16 * PAGE] + b"".join(fresh) + disk0[32 * PAGE :]  # cluster 1 written back
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
    assert loc.codec == fmt.CODEC_DELTA and loc.base in memory_chunks
    assert store.lookup(loc.base).codec != fmt.CODEC_DELTA
    assert loc.stored_len < 0.6 * 16 * PAGE  # half its pages are in the base
    read_back(store, d1.manifest, disk1, rng)
    read_back(store, m1.manifest, img1, rng)
    assert store.check(read_data=True).ok


def test_a_base_another_import_commits_first_as_a_delta_leaves_no_second_hop(stores):
    rng = random.Random(9)
    store = stores("pages")
    v0 = guest(rng)
    fresh = [rng.randbytes(PAGE) for _ in range(GROUP)]
    # v1's group 1 is fresh but for one page: against v1, v2's group 1 is a good delta;
    # against v0 it is new, so an ingest of v2 like v0 stores it whole and builds on it
    v1 = with_group(v0, 1, [rng.randbytes(PAGE)] + fresh[1:])
    v2 = with_group(with_group(v0, 1, fresh), 3, fresh[::-1])
    v2_other = with_group(v2, 3, [rng.randbytes(PAGE) for _ in range(GROUP)])
    img0, img1, img2 = memory_image(v0), memory_image(v1), memory_image(v2)
    f0 = put(store, img0, "cdc")
    f1 = put(store, img1, "cdc", like=f0.manifest)
    with store.ingest() as ing:
        f2 = ing.add_file(BytesSource(img2), chunking="cdc", like=f0.manifest)
        entries = fmt.decode_manifest(ing.manifests[bytes.fromhex(f2.manifest)]).entries
        copy = ing.new[chunk_holding(entries, img2, fresh[-1], second=True)]
        assert copy.codec == fmt.CODEC_DELTA  # on group 1's chunk, new in this ingest
        base = copy.base
        # another import commits group 1's chunk first, as a delta on v1's group 1
        other = put(store, memory_image(v2_other), "cdc", like=f1.manifest)
        assert store.lookup(base).codec == fmt.CODEC_DELTA
        ing.seal()
        with store.env.begin(write=True) as txn:
            ing.commit(txn)
    for cid, loc in locations(store, f2.manifest).items():
        if loc.codec == fmt.CODEC_DELTA:
            assert store.lookup(loc.base).codec != fmt.CODEC_DELTA, cid.hex()
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
    v0 = guest(rng)
    fresh = [rng.randbytes(PAGE) for _ in range(GROUP)]
    v1 = with_group(v0, 1, [rng.randbytes(PAGE)] + fresh[1:])
    v2 = with_group(with_group(v0, 1, fresh), 3, fresh[::-1])
    v2_other = with_group(v2, 3, [rng.randbytes(PAGE) for _ in range(GROUP)])
    f0 = put(store, memory_image(v0), "cdc")
    f1 = put(store, memory_image(v1), "cdc", like=f0.manifest)
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
