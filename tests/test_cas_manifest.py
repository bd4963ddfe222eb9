"""Manifests as the store encodes them: the builder an ingest uses gives the very bytes
``encode_manifest`` gives for the same entries (so a file's manifest id and digest do not
depend on how it was built), and ``ManifestEntries`` reads them back as the entries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ksfs.cas import format as fmt

ids = st.binary(min_size=32, max_size=32)
lengths = st.integers(min_value=0, max_value=1 << 40)
entries = st.lists(st.tuples(st.one_of(st.none(), ids), lengths), max_size=60)


@settings(max_examples=300, deadline=None)
@given(entries, st.sampled_from(["fixed", "cdc"]))
def test_the_builder_encodes_as_encode_manifest(items, chunking) -> None:
    built = fmt.ManifestBuilder()
    for cid, length in items:
        built.add(cid, length)
    raw = built.encode(chunking)
    assert raw == fmt.encode_manifest(items, chunking)
    info = fmt.decode_manifest(raw)
    canonical = fmt.normalize(items)
    assert info.entries == canonical and list(info.entries) == canonical
    assert len(info.entries) == len(canonical)
    assert [info.entries[i] for i in range(-len(canonical), 0)] == canonical
    assert info.entries[1:3] == canonical[1:3]
    assert info.size == sum(n for _, n in canonical) == built.size


def test_entries_out_of_range_and_equality() -> None:
    raw = fmt.encode_manifest([(b"a" * 32, 5), (None, 7)], "cdc")
    e = fmt.decode_manifest(raw).entries
    assert e[0] == (b"a" * 32, 5) and e[1] == (None, 7) and e[-1] == (None, 7)
    for bad in (2, -3):
        try:
            e[bad]
        except IndexError:
            pass
        else:
            raise AssertionError(f"index {bad} did not raise")
    assert e == fmt.decode_manifest(raw).entries
    assert e != fmt.decode_manifest(fmt.encode_manifest([(b"a" * 32, 5)], "cdc")).entries
