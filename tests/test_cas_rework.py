"""Chunks made again at the seal (ksfs.cas.rework): a page that two new chunks of one save hold
(a file's page cache and the buffer it was copied from) is stored once.

- A delta made before the plain chunk that holds its new page existed is made again with that
  chunk among its bases.
- Of two plain chunks stored at once on the two workers, one becomes a delta on the other.
- A page that two deltas hold goes into a shared-page chunk of its own, a base of both.
"""

from __future__ import annotations

import random
import struct

import pytest

from ksfs.cas import ChunkStore, hints, rework
from ksfs.cas import format as fmt
from ksfs.cas.chunking import BATCH_BYTES
from ksfs.cas.ingest import Ingest
from ksfs.cas.pagecut import GROUP_PAGES, PAGE, iter_pages, stream_start
from tests.cas_helpers import F_CONT, F_PAGE, BytesSource, put
from tests.test_cas_delta import memory_image, read_back

PAIRS = 24
GROUP = GROUP_PAGES  # pages per page group: one chunk each
STEP = 2 * GROUP  # the pairs' groups lie every other group, so no two pairs share one
# A pair's page is page 2, 3 or 5 of its group (``n % GROUP``: the same in groups of fewer pages)


def group_aligned(pages: int) -> int:
    return -(-pages // GROUP) * GROUP


# The changed groups' page records end in this batch (a data page's record is 8 bytes and the
# page): the copies lie two 8 MiB batches (chunking.BATCH_BYTES) on from it, and a quarter
# batch more, so they are cut and stored after the workers are done with the changed groups
# (Ingest._pipeline: batch k is submitted once batch k - 2's results are in)
CHANGED_BATCH = PAIRS * STEP * (PAGE + 8) // BATCH_BYTES
DATA_PAGES = group_aligned((CHANGED_BATCH + 2) * BATCH_BYTES // PAGE + BATCH_BYTES // 4 // PAGE)
# (18 MiB for 8- and 32-page groups: 4608 pages)


def saves(rng: random.Random) -> list[bytes]:
    """Two saves: the second rewrites one page of each of PAIRS page groups near the start and
    writes the same page, among fresh ones, into a group that was free, near the end."""
    pages: dict[int, bytes | None] = {a * PAGE: rng.randbytes(PAGE) for a in range(DATA_PAGES)}
    pages.update({a * PAGE: None for a in range(DATA_PAGES, DATA_PAGES + PAIRS * STEP)})
    second = dict(pages)
    for k in range(PAIRS):
        changed, copy = STEP * k, DATA_PAGES + STEP * k  # group starts, GROUP pages each
        page = rng.randbytes(PAGE)
        second[(changed + 3 % GROUP) * PAGE] = page
        for a in range(copy, copy + GROUP):
            second[a * PAGE] = page if a == copy + 5 % GROUP else rng.randbytes(PAGE)
    return [memory_image(pages), memory_image(second)]


def batch_of(image: bytes, page: int) -> int:
    """The number of the page cutter's batch (as the ingest's pipeline counts them, the libvirt
    header's the first) that holds the record of data page ``page`` of a memory image."""
    at = image.index(struct.pack(">Q", page * PAGE | F_PAGE | F_CONT))
    for n, batch in enumerate(iter_pages(BytesSource(image), stream_start(image))):
        if batch[-1][0] + len(batch[-1][1]) > at:
            return n
    raise AssertionError(f"no record of page {page}")


def test_a_delta_made_before_the_plain_chunk_that_holds_its_new_page_is_made_again_on_it(
        tmp_path, monkeypatch):
    rng = random.Random(4)
    images = saves(rng)
    # what DATA_PAGES is for: the first copy lies two batches past the last changed group
    last_changed = STEP * (PAIRS - 1) + 3 % GROUP
    assert batch_of(images[1], DATA_PAGES) >= batch_of(images[1], last_changed) + 2
    with ChunkStore.open(tmp_path / "s", create=True) as store:
        made = [put(store, images[0], "cdc")]
        made.append(put(store, images[1], "cdc", like=made[0].manifest))
        chunks = {}
        for cid, _ in store.load_manifest(made[1].manifest).entries:
            if cid is not None:
                chunks[cid] = store.lookup(cid)
        named = sum(1 for loc in chunks.values() if any(b in chunks for b in loc.base_ids))
        # every changed group names the fresh group holding its new page among its bases
        assert named >= PAIRS, named
        read_back(store, made[1].manifest, images[1], rng)
        assert store.check(read_data=True).ok
        stored = store.stats()["stored_bytes"]

    monkeypatch.setattr(rework, "redelta", lambda ing, redo: None)
    with ChunkStore.open(tmp_path / "without", create=True) as store:
        first = put(store, images[0], "cdc")
        put(store, images[1], "cdc", like=first.manifest)
        without = store.stats()["stored_bytes"]
    # each pair's page stored once instead of twice (random bytes: about 4 KiB each)
    assert without - stored > PAIRS * PAGE * 0.8, (without, stored)


def no_homes_while_digesting(monkeypatch) -> None:
    """Chunks find no page homes when digested, as when the chunk holding their pages is
    digested at the same moment on the other worker: only the seal can find them."""
    monkeypatch.setattr(Ingest, "_homes_of", lambda self, txn, keys, cid, olders, fixed:
                        (olders, 0))


def new_chunks(store: ChunkStore, manifest: str, before: str) -> dict[bytes, fmt.Location]:
    old = {cid for cid, _ in store.load_manifest(before).entries}
    return {cid: store.lookup(cid) for cid, _ in store.load_manifest(manifest).entries
            if cid is not None and cid not in old}


def test_of_two_plain_chunks_holding_a_page_one_becomes_a_delta_on_the_other(
        tmp_path, monkeypatch):
    """Fresh groups in pairs, each pair sharing one page: one of each pair names the other."""
    rng = random.Random(6)
    data = group_aligned(256)  # 1 MiB of data, then the free groups the pairs are written to
    pages: dict[int, bytes | None] = {a * PAGE: rng.randbytes(PAGE) for a in range(data)}
    pages.update({a * PAGE: None for a in range(data, data + 2 * PAIRS * STEP)})
    second = dict(pages)
    for k in range(PAIRS):
        page = rng.randbytes(PAGE)
        for start in (data + STEP * k, data + PAIRS * STEP + STEP * k):  # group starts
            for a in range(start, start + GROUP):
                second[a * PAGE] = page if a == start + 2 % GROUP else rng.randbytes(PAGE)
    no_homes_while_digesting(monkeypatch)
    with ChunkStore.open(tmp_path / "s", create=True) as store:
        first = put(store, memory_image(pages), "cdc")
        f = put(store, memory_image(second), "cdc", like=first.manifest)
        made = new_chunks(store, f.manifest, first.manifest)
        on_plain = [loc for loc in made.values()
                    if loc.codec in fmt.DELTA_CODECS and
                    any(b in made and made[b].codec not in fmt.DELTA_CODECS
                        for b in loc.base_ids)]
        assert len(on_plain) == PAIRS
        read_back(store, f.manifest, memory_image(second), rng)
        assert store.check(read_data=True).ok


@pytest.mark.parametrize("share", [True, False])
def test_a_page_two_deltas_hold_is_stored_once_in_a_shared_page_chunk(
        tmp_path, monkeypatch, share):
    """Groups that held data each get one new page, the same page for each pair: both are
    deltas on their old versions, so neither is a base for the other; a shared-page chunk that
    no manifest names holds the page, and both are deltas on it too. GC keeps it while they
    live and frees it with them."""
    rng = random.Random(8)
    half = PAIRS * STEP  # the pairs' first groups lie in the first half, their second in the other
    pages: dict[int, bytes | None] = {a * PAGE: rng.randbytes(PAGE) for a in range(2 * half)}
    second = dict(pages)
    for k in range(PAIRS):
        page = rng.randbytes(PAGE)
        second[(STEP * k + 3 % GROUP) * PAGE] = page
        second[(half + STEP * k + 5 % GROUP) * PAGE] = page
    images = [memory_image(pages), memory_image(second)]
    if not share:
        monkeypatch.setattr(rework, "share_pages", lambda ing, redo: {})
    with ChunkStore.open(tmp_path / "s", create=True) as store:
        first = put(store, images[0], "cdc")
        f = put(store, images[1], "cdc", like=first.manifest)
        made = new_chunks(store, f.manifest, first.manifest)
        named = {b for loc in made.values() for b in loc.base_ids}
        shared = [b for b in named if b not in made and store.lookup(b) is not None and
                  b not in {c for c, _ in store.load_manifest(first.manifest).entries}]
        stored = store.stats()["stored_bytes"]
        read_back(store, f.manifest, images[1], rng)
        assert store.check(read_data=True).ok
        if not share:
            assert not shared
            return
        assert shared, "no shared-page chunk"
        users = sum(1 for loc in made.values() if set(loc.base_ids) & set(shared))
        assert users >= 2 * len(shared)
        store.gc([f.manifest], threshold=1.0)  # the first checkpoint goes
        assert all(store.lookup(b) is not None for b in shared)  # live deltas keep it
        read_back(store, f.manifest, images[1], rng)
        assert store.check(read_data=True).ok
        store.gc([], threshold=1.0)
        assert not any(store.lookup(b) for b in shared)
        assert store.check(read_data=True).ok
    monkeypatch.setattr(rework, "share_pages", lambda ing, redo: {})
    with ChunkStore.open(tmp_path / "without", create=True) as store:
        first = put(store, images[0], "cdc")
        put(store, images[1], "cdc", like=first.manifest)
        without = store.stats()["stored_bytes"]
    assert without - stored > PAIRS * PAGE * 0.8, (without, stored)


def test_past_max_bases_the_bases_holding_fewest_pages_give_way(tmp_path):
    """A chunk whose old version already has MAX_BASES bases still takes the page homes that
    hold its pages: the old version's bases holding none of them are left out instead."""
    rng = random.Random(10)
    pages = [rng.randbytes(PAGE) for _ in range(8)]  # the chunk's, as a disk cluster's blocks
    olders = {bytes([i]) * 32: (pages[0] if i == 0 else rng.randbytes(PAGE)) * 2
              for i in range(fmt.MAX_BASES)}
    homes = {bytes([100 + i]) * 32: pages[1 + 2 * i] + pages[2 + 2 * i] for i in range(3)}
    with ChunkStore.open(tmp_path / "s", create=True) as store, store.ingest() as ing:
        for home, plain in homes.items():
            ing._bases[home] = plain
            for k in range(0, len(plain), PAGE):
                ing._homes[hints.page_key(plain[k:k + PAGE])] = home
        with store.env.begin(db=store.db["chunks"]) as txn:
            chosen, _ = ing._homes_of(txn, [hints.page_key(p) for p in pages], b"c" * 32, olders,
                                        True)
    assert len(chosen) == fmt.MAX_BASES
    assert list(chosen)[:3] == list(homes)  # the homes first (each holds two of its pages)
    kept_old = [b for b in chosen if b in olders]
    assert bytes([0]) * 32 in kept_old  # the old base holding one of its pages stays
    assert len(kept_old) == fmt.MAX_BASES - 3
