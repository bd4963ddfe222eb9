"""Deltas made again at the seal: a page that a delta holds and a plain chunk stored after it
holds too (a file's page cache and the buffer it was copied from, the lower address first).

The delta was made before the plain chunk existed, so it holds that page itself; at the seal it
is made again with the plain chunk among its bases, and the page costs nothing the second time.
"""

from __future__ import annotations

import random

from ksfs.cas import ChunkStore
from ksfs.cas.ingest import Ingest
from tests.cas_helpers import put
from tests.test_cas_delta import memory_image, read_back

PAGE = 4096
PAIRS = 24


DATA_PAGES = 4608  # 18 MiB: the copies lie two 8 MiB batches on, so they are cut and stored
# after the workers are done with the changed groups (chunking.BATCH_BYTES, Ingest._pipeline)


def saves(rng: random.Random) -> list[bytes]:
    """Two saves: the second rewrites one page of each of PAIRS page groups near the start and
    writes the same page, among fresh ones, into a group that was free, near the end."""
    pages: dict[int, bytes | None] = {a * PAGE: rng.randbytes(PAGE) for a in range(DATA_PAGES)}
    pages.update({a * PAGE: None for a in range(DATA_PAGES, DATA_PAGES + 512)})
    second = dict(pages)
    for k in range(PAIRS):
        changed, copy = 16 * k, DATA_PAGES + 16 * k  # group starts, 8 pages each
        page = rng.randbytes(PAGE)
        second[(changed + 3) * PAGE] = page
        for a in range(copy, copy + 8):
            second[a * PAGE] = page if a == copy + 5 else rng.randbytes(PAGE)
    return [memory_image(pages), memory_image(second)]


def test_a_delta_made_before_the_plain_chunk_that_holds_its_new_page_is_made_again_on_it(
        tmp_path, monkeypatch):
    rng = random.Random(4)
    images = saves(rng)
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

    monkeypatch.setattr(Ingest, "_redelta", lambda self: None)
    with ChunkStore.open(tmp_path / "without", create=True) as store:
        first = put(store, images[0], "cdc")
        put(store, images[1], "cdc", like=first.manifest)
        without = store.stats()["stored_bytes"]
    # each pair's page stored once instead of twice (random bytes: about 4 KiB each)
    assert without - stored > PAIRS * PAGE * 0.8, (without, stored)
