"""Page hints: the next version of a file finds pages the last one brought, wherever they moved.

A guest writes pages in one save (a buffer, a file's page cache) and has them at other
addresses by the next (the buffer freed and its pages reused, the file copied): the next ingest
does not read the chunks the last one stored, so without hints those pages are stored again.
The tests show hinted pages stored as deltas on the last checkpoint's chunks, read back
exactly, and hints that are kept for the newest version only, dropped by GC with their manifest,
and harmless when damaged.
"""

from __future__ import annotations

import random

from ksfs.cas import ChunkStore, hints
from tests.cas_helpers import put
from tests.test_cas_delta import guest_pages, memory_image, read_back

PAGE = 4096


def saves(seed: int = 3) -> list[bytes]:
    """Three saves of 16 MiB of guest memory: the second writes 128 new pages into a free
    region; by the third those pages have moved to another free region (the first freed), and
    64 new ones were written."""
    rng = random.Random(seed)
    pages = guest_pages(rng, 4096)
    for a in range(1024, 1536):  # two regions kept free in the first save
        pages[a * PAGE] = None
    for a in range(2048, 2560):
        pages[a * PAGE] = None
    second = dict(pages)
    moved = {a: rng.randbytes(PAGE) for a in range(1100, 1228)}
    for a, page in moved.items():
        second[a * PAGE] = page
    third = dict(pages)
    for a, page in moved.items():
        third[(a + 1000) * PAGE] = page
    for a in range(2400, 2464):  # and pages new in the third
        third[a * PAGE] = rng.randbytes(PAGE)
    return [memory_image(p) for p in (pages, second, third)]


def hint_keys(store: ChunkStore) -> set[str]:
    with store.env.begin(db=store.db["cas_meta"]) as txn:
        cur = txn.cursor()
        if not cur.set_range(hints.PREFIX):
            return set()
        return {bytes(k)[len(hints.PREFIX):].hex() for k in cur.iternext(values=False)
                if bytes(k).startswith(hints.PREFIX)}


def drop_hints(store: ChunkStore) -> None:
    with store.env.begin(write=True, db=store.db["cas_meta"]) as txn:
        for k in hint_keys(store):
            txn.delete(hints.key(bytes.fromhex(k)))


def ingest_all(store: ChunkStore, images: list[bytes], forget: bool = False) -> list:
    made, prev = [], None
    for image in images:
        if forget:
            drop_hints(store)
        made.append(put(store, image, "cdc", like=prev))
        prev = made[-1].manifest
    return made


def test_pages_moved_since_the_last_save_are_deltas_on_its_chunks(tmp_path):
    images = saves()
    rng = random.Random(1)
    with ChunkStore.open(tmp_path / "hinted", create=True) as store, \
            ChunkStore.open(tmp_path / "blind", create=True) as blind:
        made = ingest_all(store, images)
        without = ingest_all(blind, images, forget=True)
        # 128 moved pages: 512 KiB of random bytes stored again without hints
        assert without[2].stored > (128 + 64) * PAGE
        assert made[2].stored < 0.55 * without[2].stored, (made[2].stored, without[2].stored)
        assert made[2].base_bytes_read > 0  # the hinted chunks were read as bases
        for f, image in zip(made, images, strict=True):
            read_back(store, f.manifest, image, rng)
        assert store.check(read_data=True).ok


def test_only_the_newest_version_keeps_hints_and_gc_drops_those_of_dead_manifests(tmp_path):
    images = saves()
    with ChunkStore.open(tmp_path / "s", create=True) as store:
        made = ingest_all(store, images[:2])
        assert hint_keys(store) == {made[1].manifest}
        third = put(store, images[2], "cdc", like=made[1].manifest)
        assert hint_keys(store) == {third.manifest}
        store.gc([made[0].manifest, made[1].manifest], threshold=0.0)
        assert hint_keys(store) == set()
        assert store.check(read_data=True).ok


def test_damaged_hints_only_cost_their_help(tmp_path):
    images = saves()
    rng = random.Random(2)
    with ChunkStore.open(tmp_path / "s", create=True) as store:
        made = ingest_all(store, images[:2])
        key = hints.key(bytes.fromhex(made[1].manifest))
        with store.env.begin(write=True, db=store.db["cas_meta"]) as txn:
            raw = bytes(txn.get(key))
            # an entry number past the manifest's end, then keys of pages that are nowhere
            txn.put(key, hints.CHUNK.pack(10**6, 2) + raw[:8] + raw[hints.CHUNK.size:])
        third = put(store, images[2], "cdc", like=made[1].manifest)
        read_back(store, third.manifest, images[2], rng)
        assert store.check(read_data=True).ok
        with store.env.begin(write=True, db=store.db["cas_meta"]) as txn:
            txn.put(hints.key(bytes.fromhex(third.manifest)), b"\xff" * 7)
        again = put(store, images[1], "cdc", like=third.manifest)
        read_back(store, again.manifest, images[1], rng)
        assert store.check(read_data=True).ok
