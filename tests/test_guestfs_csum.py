"""metadata_csum: inodes, directory blocks (leaves and htree index blocks) and extent blocks are
verified as the kernel verifies them, so a damaged record that still looks sane (a block number
pointing at another file's blocks, a changed byte of a name) is refused, never read as some other
file's bytes. Each damage is also shown to the host kernel (a read-only loop mount of the same
image), which refuses the same thing."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from test_guestfs_helpers import compare_with_dir, loop_mount, make_tree

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs import FileImageReader, GuestFS, diff_trees
from ksfs.guestfs.layout import RO_COMPAT_METADATA_CSUM, crc32c

B4K = ["-b", "4096", "-T", "default"]


def _table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


TABLE = _table()


def crc32c_reference(crc: int, data: bytes) -> int:
    """The kernel's crc32c(seed, data) as the reader computed it in pure Python before it used
    the C library: the reference its conversion (inverting in and out) must match."""
    for b in data:
        crc = TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


@settings(max_examples=300, deadline=None)
@given(seed=hs.integers(0, 0xFFFFFFFF), data=hs.binary(max_size=5000))
def test_crc32c_is_the_kernels_raw_crc(seed: int, data: bytes) -> None:
    assert crc32c(seed, data) == crc32c_reference(seed, data)
    assert crc32c(seed, bytearray(data)) == crc32c(seed, memoryview(data)) == crc32c(seed, data)
    # chained as the inode checksum chains it (seed, then number, then generation, then body)
    cut = len(data) // 3
    assert crc32c(crc32c(seed, data[:cut]), data[cut:]) == crc32c(seed, data)


def test_crc32c_known_values() -> None:
    # the standard check value of CRC32C ("123456789"), which inverts in and out
    assert crc32c(0xFFFFFFFF, b"123456789") ^ 0xFFFFFFFF == 0xE3069283
    assert crc32c(0, b"") == 0 and crc32c(0x1234, b"") == 0x1234  # no inversion of its own
    assert crc32c(0, bytes(32)) == 0  # zeros from a zero register stay zero (no inversion)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("guestfs-csum") / "tree"
    make_tree(src)
    return src


def build(source: Path, out: Path, options: list[str]) -> Path:
    from ksfs.guestfs.mkimage import build_ext4

    build_ext4(source, out, 64, options)
    return out


@pytest.fixture(scope="module")
def image(source: Path) -> Path:
    img = build(source, source.parent / "csum.img", B4K)
    with open(img, "rb") as f:
        f.seek(1024 + 0x64)
        assert struct.unpack("<I", f.read(4))[0] & RO_COMPAT_METADATA_CSUM  # mkfs's default
    return img


def inode_offset(image: Path, path: str) -> int:
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        vol = fs.volume
        ino = fs.resolve(path)
        group, index = divmod(ino - 1, vol.sb.inodes_per_group)
        return vol.offset + vol._inode_table(group) * vol.bs + index * vol.sb.inode_size


def block_of(image: Path, path: str, lblk: int = 0) -> tuple[int, int]:
    """(byte offset, block size) of logical block ``lblk`` of ``path``."""
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        vol = fs.volume
        (_, _, phys), = vol.runs(vol.inode(fs.resolve(path)), lblk, lblk + 1)
        return vol.offset + phys * vol.bs, vol.bs


def patched(image: Path, out: Path, offset: int, data: bytes) -> Path:
    shutil.copyfile(image, out)
    with open(out, "r+b") as f:
        f.seek(offset)
        assert f.read(len(data)) != data
        f.seek(offset)
        f.write(data)
    return out


def kernel_error(image: Path, path: str, how: str) -> int | None:
    """The errno the host kernel gives for ``how`` ("stat", "list", "read") of ``path`` in a
    read-only loop mount of ``image`` (None: it succeeds); skips without loop devices."""
    with loop_mount(image) as mnt:
        if mnt is None:
            pytest.skip("this machine cannot set up loop devices")
        target = mnt / path
        try:
            if how == "stat":
                os.lstat(target)
            elif how == "list":
                os.listdir(target)
            else:
                target.read_bytes()
        except OSError as exc:
            return exc.errno
        return None


def test_an_extent_pointing_at_another_files_blocks_is_refused(image: Path,
                                                              tmp_path: Path) -> None:
    # QA: small.txt's extent moved onto random.bin's first block read random.bin's bytes.
    at = inode_offset(image, "small.txt")
    theirs, _ = block_of(image, "random.bin")
    with open(image, "rb") as f:
        f.seek(at + 0x28 + 12)  # i_block: the extent header, then the first extent
        lblk, length, hi, lo = struct.unpack("<IHHI", f.read(12))
    assert (lblk, length) == (0, 1)
    bad = patched(image, tmp_path / "moved.img", at + 0x28 + 12 + 8,
                  struct.pack("<I", theirs // 4096))
    with FileImageReader(bad) as reader:
        fs = GuestFS.open(reader)
        with pytest.raises(GuestFSUnreadable, match=r"inode \d+ fails its checksum") as err:
            fs.read("small.txt", 0, 100)
        assert err.value.errno == errno.EIO
        with pytest.raises(GuestFSUnreadable, match="fails its checksum"):
            fs.stat("hardlink")  # the same inode
        assert fs.read("fifty-nine", 0, 100) == b"5" * 59  # the rest still reads
        assert "small.txt" not in {name for name, _ in fs.listdir_stats(2)}
    assert kernel_error(bad, "small.txt", "stat") == errno.EBADMSG


def test_a_changed_byte_of_a_name_is_refused(image: Path, tmp_path: Path) -> None:
    at, bs = block_of(image, "a")
    with open(image, "rb") as f:
        f.seek(at)
        block = f.read(bs)
    name = block.index(b"top.txt")
    bad = patched(image, tmp_path / "name.img", at + name + 1, b"i")  # "tip.txt": sane
    with FileImageReader(bad) as reader:
        fs = GuestFS.open(reader)
        with pytest.raises(GuestFSUnreadable,
                           match=r"directory inode \d+ block 0 fails its checksum"):
            list(fs.listdir("a"))
        with pytest.raises(GuestFSUnreadable):
            fs.resolve("a/top.txt")
        assert fs.read("small.txt", 0, 100) == b"hello\n"  # other directories read
    assert kernel_error(bad, "a", "list") == errno.EBADMSG


def test_htree_index_and_leaf_blocks_are_verified(image: Path, tmp_path: Path) -> None:
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        assert fs.volume.inode(fs.resolve("many")).flags & 0x1000  # an htree (e2fsck -D)
    root, bs = block_of(image, "many", 0)
    # the hash of the root's second index entry: the index block still looks sane
    bad_root = patched(image, tmp_path / "dx.img", root + 0x28, b"\x01\x02\x03\x04")
    with FileImageReader(bad_root) as reader:
        with pytest.raises(GuestFSUnreadable, match="fails its htree index checksum"):
            list(GuestFS.open(reader).listdir("many"))
    assert kernel_error(bad_root, "many/entry-00001-x", "stat") == errno.EBADMSG
    leaf, _ = block_of(image, "many", 1)
    with open(image, "rb") as f:
        f.seek(leaf)
        block = f.read(bs)
    name = block.index(b"entry-")
    bad_leaf = patched(image, tmp_path / "leaf.img", leaf + name, b"E")
    with FileImageReader(bad_leaf) as reader:
        with pytest.raises(GuestFSUnreadable, match="block 1 fails its checksum"):
            list(GuestFS.open(reader).listdir("many"))
    assert kernel_error(bad_leaf, "many", "list") == errno.EBADMSG


def test_an_extent_block_is_verified(image: Path, tmp_path: Path) -> None:
    at = inode_offset(image, "islands.bin")
    with open(image, "rb") as f:
        f.seek(at + 0x28)
        _, count, _, depth = struct.unpack("<HHHH", f.read(8))
        f.seek(at + 0x28 + 12 + 4)
        leaf = struct.unpack("<I", f.read(4))[0]  # the first index entry's ei_leaf_lo
    assert depth >= 1 and count >= 1  # 400 extents: a tree with blocks of its own
    # the first extent's physical block (ee_start_lo), moved by one: sane, but not its bytes
    where = leaf * 4096 + 12 + 8
    with open(image, "rb") as f:
        f.seek(where)
        start = struct.unpack("<I", f.read(4))[0]
    bad = patched(image, tmp_path / "extent.img", where, struct.pack("<I", start + 1))
    with FileImageReader(bad) as reader:
        fs = GuestFS.open(reader)
        assert fs.stat("islands.bin").size > 0  # the inode itself is fine
        with pytest.raises(GuestFSUnreadable,
                           match=r"extent node of inode \d+ in block \d+ fails its checksum"):
            fs.read("islands.bin", 0, 10)
    assert kernel_error(bad, "islands.bin", "read") in (errno.EBADMSG, errno.EIO)


@pytest.mark.parametrize("options", [
    [*B4K, "-O", "^metadata_csum"],  # no checksums at all: nothing to verify, all reads
    [*B4K, "-I", "128"],  # 128-byte inodes: only the low 16 bits of each inode's checksum
    ["-b", "1024"],
], ids=["no-metadata-csum", "128-byte-inodes", "1k-blocks"])
def test_undamaged_images_read_whole(source: Path, tmp_path: Path, options: list[str]) -> None:
    img = build(source, tmp_path / "ok.img", options)
    with FileImageReader(img) as reader:
        assert compare_with_dir(GuestFS.open(reader), source, exact=False,
                                skip=("lost+found",)) > 3000


def test_128_byte_inode_damage_is_refused(source: Path, tmp_path: Path) -> None:
    img = build(source, tmp_path / "small-inodes.img", [*B4K, "-I", "128"])
    at = inode_offset(img, "owned")
    bad = patched(img, tmp_path / "owner.img", at + 2, b"\x00\x00")  # i_uid: 1234 -> 0
    with FileImageReader(bad) as reader:
        with pytest.raises(GuestFSUnreadable, match="fails its checksum"):
            GuestFS.open(reader).stat("owned")
    assert kernel_error(bad, "owned", "stat") == errno.EBADMSG


def test_checksum_seed_survives_a_new_uuid(source: Path, tmp_path: Path) -> None:
    # metadata_csum_seed keeps the seed in the superblock, so a UUID change rewrites nothing:
    # checksums seeded from the new UUID would all fail.
    img = build(source, tmp_path / "seed.img", [*B4K, "-O", "metadata_csum_seed"])
    subprocess.run(["tune2fs", "-U", "random", str(img)], check=True, capture_output=True)
    with FileImageReader(img) as reader:
        fs = GuestFS.open(reader)
        assert fs.read("a/top.txt", 0, 9) == b"top of a\n"
        assert len(list(fs.listdir("many"))) == 3000


def test_diff_names_a_damaged_inode_as_a_change(image: Path, tmp_path: Path) -> None:
    # It was left out of its directory's listing, so `ksfs diff` called it removed.
    at = inode_offset(image, "owned")
    bad = patched(image, tmp_path / "owned.img", at + 2, b"\x00\x00")  # i_uid: 1234 -> 0
    with FileImageReader(image) as ra, FileImageReader(bad) as rb:
        changes = diff_trees(GuestFS.open(ra), GuestFS.open(rb), attrs=True)
        back = diff_trees(GuestFS.open(rb), GuestFS.open(ra))
    assert [c.to_dict() for c in changes] == [{
        "kind": "changed", "path": "owned", "type_a": "file", "type_b": "damaged",
        "size_a": 15, "size_b": None, "attrs": {}, "type": "damaged"}]
    assert [(c.kind, c.path, c.type_a, c.type_b) for c in back] == [
        ("changed", "owned", "damaged", "file")]
