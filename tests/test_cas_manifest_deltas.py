"""Delta manifests: a later version of a file's manifest stored against an earlier plain one.

A manifest names its file's chunks in order, 40 bytes each; a memory image saved again names
mostly the same chunks, so its manifest is stored as a zstd delta on the plain manifest of the
same file's earlier version. The tests show such manifests read back exactly, never lean on a
delta (one hop), that GC stores them again on a live base before it deletes theirs, and that
damage to a base is named and repaired by importing its file again.
"""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from ksfs.cas import ChunkStore, delta
from ksfs.cas import format as fmt
from ksfs.cas.pagecut import GROUP_PAGES
from ksfs.errors import ManifestCorrupt
from tests.cas_helpers import put
from tests.cli_helpers import KSFS, ksfs
from tests.test_cas_delta import evolve, guest_pages, memory_image, read_back


def stored_value(store: ChunkStore, manifest: str) -> bytes | None:
    with store.env.begin(db=store.db["manifests"]) as txn:
        value = txn.get(bytes.fromhex(manifest))
        return None if value is None else bytes(value)


PAGES = 4096  # 16 MiB of guest RAM per save
# Pages each save changes, at random places: 60, but no more than 60 per 512 page groups (15
# for 32-page groups). Each change makes its group's chunk, and so its manifest entry, new; with
# this share a save names mostly the chunks the one before named, as a guest's saves do, and
# its manifest is a delta that pays for its hop (delta.MANIFEST_KEEP_RATIO) even three versions
# on. 60 changes on fewer, larger groups change most entries: with 32-page groups the third
# save's manifest named 103 chunks of its 129 that the first did not, and was kept plain.
CHANGES = min(60, 60 * (PAGES // GROUP_PAGES) // 512)


@pytest.fixture
def chain(tmp_path):
    """A store holding four saves of one guest's memory, each imported like the one before."""
    rng = random.Random(5)
    pages = [guest_pages(rng, PAGES)]
    for _ in range(3):
        pages.append(evolve(rng, pages[-1], changes=CHANGES))
    images = [memory_image(p) for p in pages]
    with ChunkStore.open(tmp_path / "s", create=True) as store:
        made, prev = [], None
        for image in images:
            made.append(put(store, image, "cdc", like=prev))
            prev = made[-1].manifest
        yield store, made, images, rng


def test_later_versions_are_stored_as_deltas_on_the_first_plain_manifest(chain):
    store, made, images, rng = chain
    first = stored_value(store, made[0].manifest)
    assert first[:4] == fmt.MANIFEST_MAGIC
    for f in made[1:]:
        value = stored_value(store, f.manifest)
        # one hop: every later version names the first, not the one before it
        assert fmt.manifest_base(value) == bytes.fromhex(made[0].manifest)
        entries = len(store.load_manifest(f.manifest).entries)
        plain_len = fmt.MANIFEST_HEADER.size + entries * fmt.MANIFEST_ENTRY.size
        assert len(value) < plain_len * delta.MANIFEST_KEEP_RATIO
    for f, image in zip(made, images, strict=True):
        read_back(store, f.manifest, image, rng)
        assert store.load_manifest(f.manifest).size == len(image)
    assert store.check(read_data=True).ok


def test_gc_stores_deltas_again_on_a_live_base_before_it_deletes_theirs(chain):
    store, made, images, rng = chain
    live = [f.manifest for f in made[1:]]
    res = store.gc(live, threshold=1.0)
    assert res.manifests_rebased == 3 and res.manifests_removed == 1
    assert stored_value(store, made[0].manifest) is None
    values = {m: stored_value(store, m) for m in live}
    new_base = min(live)
    assert fmt.manifest_base(values[new_base]) is None
    assert all(fmt.manifest_base(v) == bytes.fromhex(new_base)
               for m, v in values.items() if m != new_base)
    for f, image in zip(made[1:], images[1:], strict=True):
        read_back(store, f.manifest, image, rng)
    assert store.check(read_data=True).ok
    assert store.gc(live, threshold=1.0).manifests_rebased == 0


def test_a_file_imported_again_leaves_its_stored_manifest_as_it_is(chain):
    """The first version imported again, like the last: its manifest exists intact and plain,
    and stays so; stored as a delta, it would leave the others deltas on a delta."""
    store, made, images, rng = chain
    before = {f.manifest: stored_value(store, f.manifest) for f in made}
    again = put(store, images[0], "cdc", like=made[-1].manifest)
    assert again.manifest == made[0].manifest
    assert {f.manifest: stored_value(store, f.manifest) for f in made} == before
    read_back(store, made[2].manifest, images[2], rng)


def test_a_damaged_base_is_named_with_its_deltas_and_importing_its_file_repairs_it(chain):
    store, made, images, rng = chain
    key = bytes.fromhex(made[0].manifest)
    value = bytearray(stored_value(store, made[0].manifest))
    value[100] ^= 0x40
    with store.env.begin(write=True, db=store.db["manifests"]) as txn:
        txn.put(key, bytes(value))
    with pytest.raises(ManifestCorrupt, match=f"a delta on, {made[0].manifest}, is damaged"):
        store.load_manifest(made[1].manifest)
    rep = store.check()
    assert set(rep.damaged_manifests) == {f.manifest for f in made}
    put(store, images[0], "cdc")  # the same file again: its manifest is written plain anew
    for f, image in zip(made, images, strict=True):
        read_back(store, f.manifest, image, rng)
    assert store.check(read_data=True).ok


def test_a_delta_on_a_missing_base_or_on_a_delta_is_refused():
    a = fmt.encode_manifest([(b"a" * 32, 100), (None, 50), (b"b" * 32, 7)], "cdc")
    b = fmt.encode_manifest([(b"a" * 32, 100), (None, 50), (b"c" * 32, 7)] * 20, "cdc")
    c = fmt.encode_manifest([(b"a" * 32, 100), (None, 50), (b"d" * 32, 7)] * 20, "cdc")
    ids = {name: fmt.manifest_id(raw) for name, raw in (("a", a), ("b", b), ("c", c))}
    b_on_a = delta.manifest_delta(b, ids["a"], a)
    c_on_b = delta.manifest_delta(c, ids["b"], b)
    assert b_on_a is not None and c_on_b is not None
    assert delta.expand_manifest(ids["b"], b_on_a, {ids["a"]: a}.get) == b
    assert delta.expand_manifest(ids["a"], a, {}.get) == a  # a plain value is its own bytes
    with pytest.raises(ManifestCorrupt, match="is not in the store"):
        delta.expand_manifest(ids["b"], b_on_a, {}.get)
    with pytest.raises(ManifestCorrupt, match="is itself a delta"):
        delta.expand_manifest(ids["c"], c_on_b, {ids["b"]: b_on_a}.get)
    with pytest.raises(ManifestCorrupt, match="zstd cannot decode"):
        delta.expand_manifest(ids["b"], b_on_a[:-5], {ids["a"]: a}.get)
    # a manifest that shares too little with the base is kept plain
    rng = random.Random(1)
    other = fmt.encode_manifest([(rng.randbytes(32), 9) for _ in range(60)], "fixed")
    assert delta.manifest_delta(other, ids["a"], a) is None


def test_ksfs_gc_says_it_stored_manifests_again_when_their_base_went(tmp_path):
    rng = random.Random(9)
    pages = [guest_pages(rng, PAGES)]
    pages += [evolve(rng, pages[0], changes=CHANGES)]
    pages += [evolve(rng, pages[1], changes=CHANGES)]
    store = tmp_path / "store"
    for i, p in enumerate(pages):
        path = tmp_path / f"c{i}" / "memory"
        path.parent.mkdir()
        path.write_bytes(memory_image(p))
        assert ksfs(store, None, "import", "s", f"c{i}", str(path)).returncode == 0
    assert ksfs(store, None, "rm", "s", "c0").returncode == 0
    out = ksfs(store, None, "gc").stdout
    assert "gc: 2 manifests stored again on a live base" in out, out
    again = json.loads(ksfs(store, None, "gc", "--json").stdout)
    assert again["manifests_rebased"] == 0
    for i in (1, 2):
        cat = subprocess.run([*KSFS, "--store", str(store), "cat", "s", f"c{i}", "memory"],
                             capture_output=True, check=True).stdout
        assert cat == memory_image(pages[i])
    assert ksfs(store, None, "check", "--read-data").returncode == 0
