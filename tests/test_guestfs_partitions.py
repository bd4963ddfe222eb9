"""The filesystem is found inside partitioned disks (MBR primary, MBR logical, GPT), after a
partition of another type, and reads exactly as the same filesystem on its own."""

from __future__ import annotations

import re
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


def _entry(kind: int, start: int, count: int) -> bytes:
    return bytes([0, 0, 0, 0, kind, 0, 0, 0]) + start.to_bytes(4, "little") \
        + count.to_bytes(4, "little")


@pytest.mark.parametrize("first_ebr,number", [
    ("link only", 5),  # a boot record with no data entry takes no number (as Linux counts)
    ("swap", 6),  # one with a data entry of another type does
])
def test_logical_partitions_are_numbered_as_linux_numbers_them(
        plain: tuple[Path, Path], tmp_path: Path, first_ebr: str, number: int) -> None:
    """Review (seventeenth session): the numbering of logical partitions (vdaN for root=) had
    no test of a boot record without a data entry. A chain of two extended boot records, the
    filesystem in the second."""
    from ksfs.guestfs.image import find_filesystems

    _, img = plain
    fs_bytes = img.read_bytes()
    fs_sectors = (len(fs_bytes) + 511) // 512
    ext, second = 2048, 4096  # the extended partition's start; the second record's offset
    data_at = ext + second + 2048
    ext_sectors = second + 2048 + fs_sectors
    disk = bytearray((data_at + fs_sectors + 2048) * 512)
    mbr = _entry(0x05, ext, ext_sectors)
    disk[446:462], disk[510:512] = mbr, b"\x55\xaa"
    first = ext * 512
    if first_ebr == "swap":
        disk[first + 446:first + 462] = _entry(0x82, 2048, 1024)
    disk[first + 462:first + 478] = _entry(0x05, second, 2048 + fs_sectors)
    disk[first + 510:first + 512] = b"\x55\xaa"
    at = (ext + second) * 512
    disk[at + 446:at + 462] = _entry(0x83, 2048, fs_sectors)
    disk[at + 510:at + 512] = b"\x55\xaa"
    disk[data_at * 512:data_at * 512 + len(fs_bytes)] = fs_bytes
    path = tmp_path / "chain.img"
    path.write_bytes(bytes(disk))
    listed = subprocess.run(["sfdisk", "-d", str(path)], capture_output=True, text=True,
                            check=True).stdout
    # util-linux (libfdisk) agrees: the same number at the same start
    assert re.search(rf"{re.escape(str(path))}{number} : start=\s*{data_at},", listed), listed
    with FileImageReader(path) as reader:
        linux = [p for p in find_filesystems(reader) if p.role == "linux"]
    assert [(p.number, p.offset) for p in linux] == [(number, data_at * 512)], linux
