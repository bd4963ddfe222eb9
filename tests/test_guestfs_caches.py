"""What a big directory costs: its listing with stats reads the inode tables a piece at a time
(not one read per entry, which through a store reader decoded a 64 KiB chunk per entry once
the tables outgrew its cache), a lookup of ``..`` reads only the first block, and the lookup
name tables of directories without an index are bounded by the names they hold."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ksfs.guestfs import ROOT_INO, FileImageReader, GuestFS
from ksfs.guestfs import fs as fs_module
from ksfs.guestfs import volume as volume_module
from ksfs.guestfs.mkimage import build_ext4

ENTRIES = 2000


class CountingReader:
    """A reader that counts its reads (and the bytes they asked for)."""

    def __init__(self, inner: FileImageReader) -> None:
        self.inner, self.size = inner, inner.size
        self.reads = self.bytes = 0

    def read(self, offset: int, n: int) -> bytes:
        self.reads += 1
        self.bytes += n
        return self.inner.read(offset, n)


def make_source(root: Path) -> Path:
    for d in ("big", "other"):
        (root / d).mkdir(parents=True)
    for i in range(ENTRIES):  # sizes tell the entries apart, so a wrong inode shows
        (root / "big" / f"file-{i:05d}").write_bytes(b"x" * (i % 97))
    for i in range(300):
        (root / "other" / f"o-{i:04d}").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_source(tmp_path_factory.mktemp("guestfs-caches") / "tree")


@pytest.fixture(scope="module")
def indexed(source: Path) -> Path:
    img = source.parent / "indexed.img"
    build_ext4(source, img, 64)  # e2fsck -D: htree, so entries come in hash order
    return img


@pytest.fixture(scope="module")
def linear(source: Path) -> Path:
    img = source.parent / "linear.img"
    build_ext4(source, img, 64, index_dirs=False)
    return img


def test_a_listing_reads_the_inode_tables_by_the_piece(indexed: Path, source: Path) -> None:
    with FileImageReader(indexed) as inner:
        reader = CountingReader(inner)
        fs = GuestFS.open(reader)
        big = fs.resolve("big")
        reader.reads = 0
        got = {name: st.size for name, st in fs.listdir_stats(big)}
    assert got == {p.name: p.stat().st_size for p in (source / "big").iterdir()}
    # 2,000 inodes of 256 bytes are 500 KiB of table: a few 64 KiB pieces plus the
    # directory's own blocks, where reading one inode at a time took 2,000 reads
    assert reader.reads < ENTRIES // 20, reader.reads
    assert reader.bytes < 4 << 20


def test_the_inode_table_cache_is_bounded_and_shared(indexed: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    small = volume_module.LRU(256 << 10, weight=len)  # four 64 KiB pieces
    monkeypatch.setattr(volume_module, "_tables", small)
    with FileImageReader(indexed) as reader:
        fs = GuestFS.open(reader)
        sizes = [st.size for _, st in fs.listdir_stats(fs.resolve("big"))]
        assert small.held <= 256 << 10
        # evicted pieces are read again, the same
        assert [st.size for _, st in fs.listdir_stats(fs.resolve("big"))] == sizes


def test_dotdot_reads_only_the_first_block(indexed: Path, linear: Path) -> None:
    for image in (indexed, linear):
        with FileImageReader(image) as inner:
            reader = CountingReader(inner)
            fs = GuestFS.open(reader)
            big = fs.resolve("big")
            fs.stat_ino(big)  # its inode read
            reader.reads = 0
            assert fs.lookup(big, "..") == ROOT_INO
            assert fs.resolve("big/../other") == fs.resolve("other")
            assert reader.reads <= 4, (image.name, reader.reads)
            assert big not in fs._names  # no name table built for it


def test_name_tables_are_bounded_by_names(linear: Path, source: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs_module, "NAMES_KEPT", ENTRIES + 100)
    with FileImageReader(linear) as reader:
        fs = GuestFS.open(reader)
        big, other = fs.resolve("big"), fs.resolve("other")
        for name in sorted(os.listdir(source / "big"))[::97]:
            assert fs.stat_ino(fs.lookup(big, name)).size == (source / "big" / name).stat().st_size
        assert big in fs._names and fs._names.held <= ENTRIES + 100
        fs.lookup(other, "o-0007")
        # both would hold 2,300 names: the older table went, the newest is always kept
        assert big not in fs._names and other in fs._names
        assert fs._names.held <= ENTRIES + 100
        assert fs.lookup(big, "file-00042") == fs.resolve("big/file-00042")
