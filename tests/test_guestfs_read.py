"""GuestFS against real ext4 images made by mkfs.ext4 -d: every file, directory and symlink
equals both the source tree and a read-only loop mount of the same image, for several sets of
filesystem features (extents or block maps, inline data, 1 KiB blocks, 128-byte inodes, no
64bit/metadata_csum/flex_bg, meta_bg)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_guestfs_helpers import NON_UTF8, compare_with_dir, loop_mount, make_tree, walk

from ksfs.errors import BadInput, NoSuchFile
from ksfs.guestfs import FileImageReader, GuestFS, layout
from ksfs.guestfs.mkimage import build_ext4

B4K = ["-b", "4096", "-T", "default"]  # mke2fs would pick 1 KiB blocks for a small disk
VARIANTS = {
    "default": B4K,
    "inline": [*B4K, "-O", "inline_data"],
    "ext3-blockmap": [*B4K, "-t", "ext3"],
    "1k-blocks": ["-b", "1024"],
    "small-inodes": [*B4K, "-I", "128"],
    "plain": [*B4K, "-O", "^64bit,^metadata_csum,^flex_bg,^huge_file"],
    "meta-bg": [*B4K, "-O", "meta_bg,^resize_inode"],
    "bigalloc": [*B4K, "-O", "bigalloc", "-C", "16384"],
    # 1 KiB bigalloc: first_data_block is 0, yet the descriptors follow the superblock's own
    # block 1 (QA, eighth session: read from block 1 they were the superblock).
    "bigalloc-1k": ["-b", "1024", "-O", "bigalloc", "-C", "16384"],
    # 17 groups of 8 MiB: the second meta group starts at group 16, which holds a superblock
    # backup only under sparse_super2's rule (its last group), not sparse_super's; 184 inodes
    # a group, so the tree's last files are in group 16.
    "meta-bg-sparse-super2": ["-b", "1024", "-N", "3100",
                              "-O", "meta_bg,sparse_super2,^resize_inode"],
    "largedir": [*B4K, "-O", "large_dir"],
    "casefold": [*B4K, "-O", "casefold"],
    "64k-blocks": ["-b", "65536", "-T", "default"],
    # Without filetype an entry's name length is read as 16 bits; the metadata_csum tail that
    # ends each directory block (file type byte 0xDE) is still recognised as the tail (QA: the
    # root was "damaged at 1012", a 1 KiB block's tail).
    "no-filetype": [*B4K, "-O", "^filetype"],
    "no-filetype-1k": ["-b", "1024", "-O", "^filetype"],
}
UNMOUNTABLE = {"64k-blocks": "the kernel cannot mount blocks larger than its 4 KiB pages"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guestfs-src") / "tree"
    make_tree(root)
    return root


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def image(request: pytest.FixtureRequest, source: Path,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("guestfs-img") / f"{request.param}.img"
    # 3000 small files of 64 KiB each; 17 block groups of 1 KiB blocks
    mib = {"64k-blocks": 320, "meta-bg-sparse-super2": 136}.get(request.param, 96)
    build_ext4(source, out, mib, VARIANTS[request.param])
    yield request.param, out
    out.unlink()


@pytest.fixture(scope="module")
def mounted(image: tuple[str, Path]):
    if image[0] in UNMOUNTABLE:  # still compared with its source tree
        pytest.skip(UNMOUNTABLE[image[0]])
    try:
        with loop_mount(image[1]) as mnt:
            if mnt is None:
                pytest.skip("this machine cannot set up loop devices")
            yield mnt
    except AssertionError as exc:
        if image[0] == "casefold" and "mount failed" in str(exc):
            pytest.skip("this host kernel cannot mount casefold (no CONFIG_UNICODE)")
        raise


@pytest.fixture(scope="module")
def fs(image: tuple[str, Path]) -> GuestFS:
    reader = FileImageReader(image[1])
    yield GuestFS.open(reader)
    reader.close()


def test_tree_equals_source(fs: GuestFS, source: Path) -> None:
    assert compare_with_dir(fs, source, exact=False, skip=("lost+found",)) > 3000


def test_tree_equals_loop_mount(fs: GuestFS, mounted: Path) -> None:
    assert compare_with_dir(fs, mounted, exact=True) > 3000


def test_features_are_the_ones_asked_for(fs: GuestFS, image: tuple[str, Path]) -> None:
    name = image[0]
    vol = fs.volume
    many = vol.inode(fs.resolve("many"))
    assert many.flags & layout.FL_INDEX, "3000 entries must make an htree directory"
    big = vol.inode(fs.resolve("random.bin"))
    assert bool(big.flags & layout.FL_EXTENTS) == (name != "ext3-blockmap")
    small = vol.inode(fs.resolve("inline-100"))
    assert bool(small.flags & layout.FL_INLINE_DATA) == (name == "inline")
    assert vol.bs == {"1k-blocks": 1024, "64k-blocks": 65536, "bigalloc-1k": 1024,
                      "meta-bg-sparse-super2": 1024, "no-filetype-1k": 1024}.get(name, 4096)
    assert vol.sb.has_filetype == (not name.startswith("no-filetype"))
    if name.startswith("no-filetype"):  # mkfs's default: directory blocks end in a csum tail
        assert vol.sb.ro_compat & layout.RO_COMPAT_METADATA_CSUM
    assert bool(vol.sb.incompat & layout.INCOMPAT_META_BG) == name.startswith("meta-bg")
    if name == "meta-bg-sparse-super2":
        assert vol.sb.group_count == 17 and vol.sb.backup_bgs == (1, 16)
        dirs, highest = [2], 0
        while dirs:
            for _, ino, is_dir in fs.listdir_ino(dirs.pop()):
                highest = max(highest, ino)
                dirs += [ino] if is_dir else []
        assert highest > 16 * vol.sb.inodes_per_group  # group 16's descriptors were read
    if name == "bigalloc-1k":
        assert vol.sb.first_data_block == 0
    if name == "default":
        assert vol.sb.incompat & layout.INCOMPAT_64BIT and vol.sb.incompat & 0x200
        islands = vol.inode(fs.resolve("islands.bin"))
        assert islands.block[6:8] != b"\0\0", "400 extents need an extent tree of depth >= 1"


def test_listdir_is_lazy_and_complete(fs: GuestFS, source: Path) -> None:
    it = fs.listdir("many")
    first = next(it)
    assert first[0].startswith("entry-") and not first[2]
    names = {first[0]} | {name for name, _, _ in it}
    assert names == set(os.listdir(source / "many"))
    assert {n for n, _, d in fs.listdir("/") if d} >= {"a", "many", "sticky", "日本語"}


def test_lookup_by_inode_numbers(fs: GuestFS) -> None:
    a = fs.lookup(2, "a")
    b = fs.lookup(a, "b")
    assert fs.lookup(b, "..") == a and fs.lookup(a, ".") == a
    assert fs.stat(b).is_dir
    deep = fs.lookup(fs.lookup(fs.lookup(b, "c"), "d"), "deep.txt")
    assert fs.read(deep, 0, 100) == b"deep down\n" == fs.read("/a/b/c/d/deep.txt", 0, 100)
    assert fs.read(deep, 5, 3) == b"dow" and fs.read(deep, 10, 5) == b""
    assert fs.stat(fs.lookup(2, NON_UTF8)).size == len("name that is not UTF-8\n")
    with pytest.raises(NoSuchFile):
        fs.lookup(2, "not-there")
    with pytest.raises(NoSuchFile):
        fs.stat("a/top.txt/below")
    with pytest.raises(BadInput):
        fs.read("a", 0, 1)
    with pytest.raises(BadInput):
        fs.readlink("small.txt")


def test_special_cases(fs: GuestFS, source: Path) -> None:
    assert fs.readlink("link-long") == os.readlink(source / "link-long")
    assert len(fs.readlink("link-long")) > 60 and fs.readlink("link-59") == "x" * 59
    assert fs.stat("hardlink").ino == fs.stat("small.txt").ino and fs.stat("small.txt").nlink == 2
    assert stat.S_IMODE(fs.stat("setuid").mode) == 0o4755
    assert stat.S_IMODE(fs.stat("sticky").mode) == 0o1777
    assert (fs.stat("owned-high").uid, fs.stat("owned-high").gid) == (100000, 200000)
    sparse = fs.stat("sparse.bin")
    assert sparse.size == 40 << 20 and sparse.blocks < 1000, "holes must not be allocated"
    assert fs.read("sparse.bin", (20 << 20) - 6, 11) == b"\0\0\0DATA!\0\0\0"
    assert fs.read("sparse.bin", (40 << 20) - 7, 100) == b"\0\0DATA!"
    assert fs.read("empty", 0, 10) == b""


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_reads_equal_the_mount(fs: GuestFS, mounted: Path, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(
        ["random.bin", "sparse.bin", "islands.bin", "inline-100", "a/top.txt", "fifty-nine"]))
    size = os.path.getsize(mounted / name)
    offset = data.draw(st.integers(0, size + 10))
    n = data.draw(st.integers(0, 300_000))
    with open(mounted / name, "rb") as f:
        assert fs.read(name, offset, n) == os.pread(f.fileno(), n, offset)


def test_walk_reads_no_inode_for_listing(image: tuple[str, Path]) -> None:
    """A listing with file types reads directory blocks only, never the entries' inodes."""
    if image[0].startswith("no-filetype"):
        pytest.skip("without the filetype feature a listing reads each entry's inode")
    with FileImageReader(image[1]) as reader:
        fresh = GuestFS.open(reader)
        ino = fresh.resolve("many")
        assert fresh.stat(ino).is_dir
        before = len(fresh.volume._inodes._d)
        assert sum(1 for _ in fresh.listdir(ino)) == 3000
        assert len(fresh.volume._inodes._d) == before
        assert sum(1 for _ in walk(fresh, "a")) == 5


def test_listdir_resumes_from_a_cookie(fs: GuestFS, image: tuple[str, Path]) -> None:
    for path in ("many", "a", "日本語", "/"):
        ino = fs.resolve(path)
        full = list(fs.listdir_from(ino))
        cookies = [c for _, _, _, c in full]
        assert cookies == sorted(set(cookies)) and cookies[0] > 0
        assert [e[:3] for e in full] == list(fs.listdir(ino))
        for k in sorted({0, 1, len(full) // 2, len(full) - 1} & set(range(len(full)))):
            assert list(fs.listdir_from(ino, cookies[k])) == full[k + 1 :], (path, k)
    if image[0] == "inline":
        assert fs.volume.inode(fs.resolve("a")).flags & layout.FL_INLINE_DATA
