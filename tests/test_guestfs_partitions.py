"""The filesystem is found inside partitioned disks (MBR primary, MBR logical, GPT), after a
partition of another type, and reads exactly as the same filesystem on its own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_guestfs_helpers import compare_with_dir, digest, make_tree, read_all, walk

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs import FileImageReader, GuestFS, find_filesystem
from ksfs.guestfs.mkimage import build_ext4, build_partitioned, have_tools

pytestmark = pytest.mark.skipif(not have_tools("sfdisk", "mkfs.ext4"),
                                reason="sfdisk (Debian package fdisk) is not installed")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("guestfs-part")
    src = base / "tree"
    make_tree(src)
    img = base / "fs.img"
    build_ext4(src, img, 64, ["-b", "4096", "-T", "default"])
    return src, img


@pytest.mark.parametrize("table,logical,what", [
    ("gpt", False, "GPT partition 2"),
    ("dos", False, "MBR partition"),
    ("dos", True, "logical partition"),
])
def test_first_linux_partition(plain: tuple[Path, Path], tmp_path: Path, table: str,
                               logical: bool, what: str) -> None:
    src, img = plain
    disk = tmp_path / "disk.img"
    offset = build_partitioned(img, disk, table=table, logical=logical)
    with FileImageReader(disk) as reader, FileImageReader(img) as alone:
        found = find_filesystem(reader)
        assert found[0] == offset and found[2].startswith(what)
        fs, ref = GuestFS.open(reader), GuestFS.open(alone)
        assert compare_with_dir(fs, src, exact=False, skip=("lost+found",)) > 3000
        ours = list(walk(fs))
        assert ours == list(walk(ref))
        for rel, ino, _ in ours[:200]:
            if fs.stat(ino).is_file:
                assert digest(read_all(fs, ino, fs.stat(ino).size)) == digest(
                    read_all(ref, ino, ref.stat(ino).size)), rel


def test_damaged_partition_says_where(plain: tuple[Path, Path], tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    offset = build_partitioned(plain[1], disk, table="gpt")
    with open(disk, "r+b") as f:
        f.seek(offset + 1024 + 0x38)
        f.write(b"\0\0")
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert "GPT partition 2" in str(err.value) and "magic" in str(err.value)


def test_no_linux_partition(tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    with open(disk, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["sfdisk", "-q", str(disk)], input="label: dos\nstart=2048, type=7\n",
                   text=True, check=True, capture_output=True)
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert "no Linux (0x83) partition" in str(err.value)


@pytest.mark.parametrize("kind,at,magic", [
    ("vfat", 0x36, b"FAT16   "), ("vfat", 0x52, b"FAT32   "), ("ntfs", 3, b"NTFS    "),
    ("exfat", 3, b"EXFAT   "), ("xfs", 0, b"XFSB")])
def test_a_whole_disk_of_another_filesystem_is_named(tmp_path: Path, kind: str, at: int,
                                                     magic: bytes) -> None:
    """QA: a whole-disk vfat was "the MBR partition table has no Linux (0x83) partition" (its
    boot sector ends in 0x55AA), a whole-disk xfs "no ext2/3/4 superblock magic"."""
    image = bytearray(4 << 20)
    image[at:at + len(magic)] = magic
    if kind != "xfs":
        image[510:512] = b"\x55\xaa"
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(image))
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert f"the whole disk holds a {kind} filesystem; only ext2/3/4 are read" in str(err.value)


@pytest.mark.parametrize("fmt,name", [("qcow2", "qcow2"), ("vmdk", "VMDK"), ("vhdx", "VHDX"),
                                      ("vpc", "VHD"), ("vdi", "VDI"), ("qed", "QED")])
def test_a_disk_image_format_that_wraps_a_disk_is_named(plain: tuple[Path, Path],
                                                        tmp_path: Path, fmt: str,
                                                        name: str) -> None:
    """QA: a qcow2 cloud image named .img, imported as it is, said "no ext2/3/4 superblock
    magic at byte 1080 and no partition table"; it now says what it is and what to do."""
    _, img = plain
    wrapped = tmp_path / f"cloud.{fmt}"
    subprocess.run(["qemu-img", "convert", "-O", fmt, str(img), str(wrapped)], check=True,
                   capture_output=True)
    with FileImageReader(wrapped) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert f"the file is a {name} image, not a raw disk" in str(err.value)
    assert "qemu-img convert -O raw" in str(err.value)


@pytest.mark.parametrize("damage", ["header", "entries"])
def test_a_damaged_primary_gpt_is_read_from_its_backup(plain: tuple[Path, Path],
                                                       tmp_path: Path, damage: str) -> None:
    """QA (eighth session): sfdisk and the kernel read a GPT whose primary header (or entry
    array) is damaged from the backup at the disk's end; ksfs gave an empty fs/."""
    src, img = plain
    disk = tmp_path / "disk.img"
    offset = build_partitioned(img, disk, table="gpt")
    with open(disk, "r+b") as f:
        f.seek(512 if damage == "header" else 1024)  # sector 1, or the first entries
        f.write(bytes(512))
    with FileImageReader(disk) as reader:
        found = find_filesystem(reader)
        assert found[0] == offset and found[2].startswith("GPT partition 2")
        assert compare_with_dir(GuestFS.open(reader), src, exact=False,
                                skip=("lost+found",)) > 3000
