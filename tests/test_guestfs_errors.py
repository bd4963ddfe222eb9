"""What GuestFS cannot read it refuses with a reason, never with wrong bytes: a zeroed
superblock magic, an unknown incompat feature, a truncated image, a damaged extent node or
directory block. Damage confined to one file leaves the rest readable."""

from __future__ import annotations

import errno
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from test_guestfs_helpers import make_tree

from ksfs.errors import GuestFSUnreadable, IntegrityError
from ksfs.guestfs import FileImageReader, GuestFS
from ksfs.guestfs.layout import RO_COMPAT_METADATA_CSUM, crc32c
from ksfs.guestfs.mkimage import build_ext4


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("guestfs-err")
    make_tree(base / "tree")
    img = base / "fs.img"
    build_ext4(base / "tree", img, 64, ["-b", "4096", "-T", "default"])
    return img


def damaged(image: Path, tmp_path: Path, offset: int, data: bytes,
            sb_checksum: bool = False) -> Path:
    """A copy of ``image`` with ``data`` at ``offset``; ``sb_checksum``: the superblock's
    metadata_csum made to match again, so only what the change says is wrong."""
    copy = tmp_path / "damaged.img"
    shutil.copyfile(image, copy)
    with open(copy, "r+b") as f:
        f.seek(offset)
        f.write(data)
        if sb_checksum:
            f.seek(1024)
            sb = f.read(0x3FC)
            f.write(struct.pack("<I", crc32c(0xFFFFFFFF, sb)))
    return copy


def open_error(path: Path) -> GuestFSUnreadable:
    with FileImageReader(path) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    return err.value


def test_zeroed_superblock_magic(image: Path, tmp_path: Path) -> None:
    err = open_error(damaged(image, tmp_path, 1024 + 0x38, b"\0\0"))
    assert "superblock magic" in str(err)
    assert isinstance(err, IntegrityError) and err.errno == errno.EIO and err.exit_code == 6


def test_superblock_that_fails_its_checksum(image: Path, tmp_path: Path) -> None:
    with open(image, "rb") as f:
        f.seek(1024 + 0x64)
        assert struct.unpack("<I", f.read(4))[0] & RO_COMPAT_METADATA_CSUM  # mkfs's default
    # The volume name: nothing but the checksum can tell this byte changed.
    err = open_error(damaged(image, tmp_path, 1024 + 0x78, b"X"))
    assert "the superblock fails its checksum (metadata_csum)" in str(err)
    assert err.errno == errno.EIO
    with FileImageReader(damaged(image, tmp_path, 1024 + 0x78, b"X", sb_checksum=True)) as r:
        assert GuestFS.open(r).read("small.txt", 0, 6) == b"hello\n"


def test_open_or_reason(image: Path, tmp_path: Path) -> None:
    with FileImageReader(damaged(image, tmp_path, 1024 + 0x38, b"\0\0")) as reader:
        fs, why = GuestFS.open_or_reason(reader)
    assert fs is None and "guest filesystem cannot be read" in why and "magic" in why
    with FileImageReader(image) as reader:
        fs, why = GuestFS.open_or_reason(reader)
        assert why is None and fs.read("small.txt", 0, 6) == b"hello\n"


def test_unknown_incompat_feature(image: Path, tmp_path: Path) -> None:
    with open(image, "rb") as f:
        f.seek(1024 + 0x60)
        incompat = struct.unpack("<I", f.read(4))[0]
    err = open_error(damaged(image, tmp_path, 1024 + 0x60,
                             struct.pack("<I", incompat | 0x1000 | 0x80000000),
                             sb_checksum=True))
    assert "unsupported ext4 incompat feature(s): dirdata, 0x80000000" in str(err)


def test_truncated_image(image: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.img"
    with open(image, "rb") as src, open(short, "wb") as dst:
        dst.write(src.read(image.stat().st_size // 2))
    assert "holds only" in str(open_error(short))


def test_damaged_extent_node_fails_that_file_only(image: Path, tmp_path: Path) -> None:
    # debugfs keeps the inode's metadata_csum right: only the extent header is wrong (a byte
    # written over the inode is refused by its checksum first: test_guestfs_csum)
    copy = tmp_path / "damaged.img"
    shutil.copyfile(image, copy)
    subprocess.run(["debugfs", "-w", "-R", "set_inode_field random.bin block[0] 0", str(copy)],
                   capture_output=True, check=True)
    with FileImageReader(copy) as reader:
        fs = GuestFS.open(reader)
        assert fs.stat("random.bin").size == 3 * 1024 * 1024 + 123
        with pytest.raises(GuestFSUnreadable, match="extent node of inode .* bad magic"):
            fs.read("random.bin", 0, 10)
        assert fs.read("small.txt", 0, 100) == b"hello\n"


def test_damaged_directory_block(image: Path, tmp_path: Path) -> None:
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        vol = fs.volume
        a = vol.inode(fs.resolve("a"))
        (_, _, phys), = vol.runs(a, 0, 1)
        block = bytearray(vol.read_blocks(phys, 1, "test"))
    # rec_len of the first entry: 5 is not a multiple of 4 and cannot hold a name; the
    # block's metadata_csum tail made to match, so that only the entry is wrong
    block[4:6] = b"\x05\x00"
    block[-4:] = struct.pack("<I", crc32c(a.csum_seed, bytes(block[:-12])))
    copy = damaged(image, tmp_path, vol.offset + phys * vol.bs, bytes(block))
    with FileImageReader(copy) as reader:
        fs = GuestFS.open(reader)
        with pytest.raises(GuestFSUnreadable, match="directory entry .* is damaged"):
            list(fs.listdir("a"))
        assert fs.read("many/entry-00007-xxxxxxx", 0, 10) == b"7"


def test_inode_number_out_of_range(image: Path) -> None:
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        with pytest.raises(GuestFSUnreadable, match="outside"):
            fs.stat(10**9)


@pytest.mark.parametrize("request_", ["ssv feature_incompat 0", "ssv inodes_count 5"])
def test_a_superblock_damaged_into_other_valid_values_is_refused_at_open(
        image: Path, tmp_path: Path, request_: str) -> None:
    # QA (eighth session): these parsed (debugfs keeps the checksum right), and then every
    # listing failed with EIO instead of fs/ being empty with the reason.
    copy = tmp_path / "ssv.img"
    shutil.copyfile(image, copy)
    subprocess.run(["debugfs", "-w", "-R", request_, str(copy)], capture_output=True,
                   check=True)
    err = open_error(copy)
    assert err.errno == errno.EIO
