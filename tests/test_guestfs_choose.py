"""Which partition is "the" guest filesystem when a disk has several: chosen by content (an ext
superblock), then by type (a Discoverable Partitions root type, a generic Linux filesystem, a
type mounted below the root such as /home or XBOOTLDR /boot), then by what the filesystem holds
(the caller's path, else a top-level etc/), then by size. Images are built with sfdisk and
mkfs.ext4 -d, as real cloud images are laid out (Debian genericcloud: a root-typed ext4; Ubuntu:
a generic root plus an XBOOTLDR /boot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs import FileImageReader, GuestFS, find_filesystem, read_transcript
from ksfs.guestfs.mkimage import build_disk, build_ext4, have_tools

pytestmark = pytest.mark.skipif(not have_tools("sfdisk", "mkfs.ext4"),
                                reason="sfdisk (Debian package fdisk) is not installed")

ROOT_X86_64 = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"
ROOT_ARM64 = "B921B045-1DF0-41C3-AF44-4C6F280D3FAE"
HOME = "933AC7E1-2EB4-4F13-B844-0E14E2AEF915"
SRV = "3B8F8425-20E0-4F3B-907F-1A25A76F98E8"
XBOOTLDR = "BC13C2FF-59E6-4262-A352-B275FD6F7172"
LINUX = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
ESP = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
BIOS_BOOT = "21686148-6449-6E6F-744E-656564454649"
MS_DATA = "EBD0A0A2-B9E5-4433-87C0-68B6B72699C7"


def _fs(base: Path, name: str, files: dict[str, str], mib: int) -> Path:
    src = base / f"{name}-tree"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    img = base / f"{name}.img"
    build_ext4(src, img, mib, index_dirs=False)
    return img


def _line(seq: int) -> str:
    return json.dumps({"seq": seq, "lineage": "L"}) + "\n"


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("guestfs-choose")
    return {
        "root": _fs(base, "root", {"etc/hostname": "guest\n", "which": "root\n",
                                   "agent/transcript.jsonl": _line(1) + _line(2)}, 24),
        "home": _fs(base, "home", {"user/notes": "mine\n", "which": "home\n",
                                   "agent/transcript.jsonl": _line(9)}, 40),
        "boot": _fs(base, "boot", {"vmlinuz": "kernel\n", "which": "boot\n"}, 8),
        "srv": _fs(base, "srv", {"which": "srv\n"}, 48),
    }


def _which(fs: GuestFS) -> str:
    return fs.read("which", 0, 100).decode().strip()


def _open(disk: Path, holding: str | None = None) -> tuple[GuestFS, str]:
    with FileImageReader(disk) as reader:
        fs = GuestFS.open(reader, holding)
        return fs, _which(fs)


@pytest.mark.parametrize("name,layout,where", [
    # Debian genericcloud: root x86-64 typed ext4 after BIOS boot and an ESP
    ("root-typed", [(BIOS_BOOT, 1), (ESP, 2), (ROOT_X86_64, "root")],
     "GPT partition 3 (Linux root x86-64)"),
    ("root-arm64", [(ROOT_ARM64, "root")], "GPT partition 1 (Linux root ARM-64)"),
    # a bigger /home before the root: the root type wins over size and table order
    ("home+root", [(HOME, "home"), (ROOT_X86_64, "root")], "GPT partition 2 (Linux root"),
    # a small ext /boot (XBOOTLDR) before the root
    ("boot+root", [(XBOOTLDR, "boot"), (ROOT_X86_64, "root")], "GPT partition 2 (Linux root"),
    # Ubuntu: a generic Linux root, BIOS boot, ESP, then an XBOOTLDR /boot
    ("ubuntu", [(LINUX, "root"), (BIOS_BOOT, 1), (ESP, 2), (XBOOTLDR, "boot")],
     "GPT partition 1 at"),
    # no Linux type at all: the content decides
    ("ms-typed", [(ESP, 2), (MS_DATA, "root")], "GPT partition 2 at"),
    # only mounted-below-root types: the largest
    ("home+srv", [(HOME, "home"), (SRV, "srv")], "GPT partition 2 (Linux /srv)"),
])
def test_gpt_choice(images: dict[str, Path], tmp_path: Path, name: str, layout: list,
                    where: str) -> None:
    disk = tmp_path / "disk.img"
    offsets = build_disk(disk, [(t, c if isinstance(c, int) else images[c]) for t, c in layout])
    want = next(c for t, c in layout if not isinstance(c, int)
                and where.startswith(f"GPT partition {layout.index((t, c)) + 1} "))
    fs, which = _open(disk)
    assert which == want
    assert fs.where.startswith(where)
    with FileImageReader(disk) as reader:
        offset, _, desc = find_filesystem(reader)
    assert desc.startswith(where) and offset in offsets


def test_transcript_from_the_chosen_root(images: dict[str, Path], tmp_path: Path) -> None:
    """The transcript and fs/ come from the same partition: the root, not the bigger /home
    that also has a file at that path."""
    disk = tmp_path / "disk.img"
    build_disk(disk, [(HOME, images["home"]), (ROOT_X86_64, images["root"])])
    with FileImageReader(disk) as reader:
        info = read_transcript(reader, "agent/transcript.jsonl")
        assert (info.last_seq, info.count) == (2, 2)
        assert read_transcript(GuestFS.open(reader)).last_seq == 2


def test_holding_picks_the_partition_with_the_path(images: dict[str, Path],
                                                   tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    build_disk(disk, [(XBOOTLDR, images["boot"]), (ROOT_X86_64, images["root"]),
                      (HOME, images["home"])])
    assert _open(disk)[1] == "root"
    assert _open(disk, "user/notes")[1] == "home"
    assert _open(disk, "vmlinuz")[1] == "boot"
    assert _open(disk, "etc/hostname")[1] == "root"
    assert _open(disk, "nowhere/at/all")[1] == "root"  # in none: the usual choice
    with FileImageReader(disk) as reader:  # both have agent/, only /home has user/
        assert read_transcript(reader, "agent/transcript.jsonl").last_seq == 2
        assert read_transcript(reader, "user/../agent/transcript.jsonl").last_seq == 9


@pytest.mark.parametrize("layout,want", [
    ([("83", "boot"), ("83", "root")], "root"),   # /boot first, then the root
    ([("83", "root"), ("83", "home")], "root"),   # the root first, then a bigger /home
    ([("83", "home"), ("83", "root")], "root"),   # the bigger /home first
    ([("82", 4), ("7", "root")], "root"),         # ext4 in a partition typed NTFS
    ([("83", "boot"), ("83", "home")], "home"),   # no etc/ anywhere: the largest
])
def test_mbr_choice(images: dict[str, Path], tmp_path: Path, layout: list, want: str) -> None:
    """MBR types do not tell a root from a /home: a top-level etc/ does, then size."""
    disk = tmp_path / "disk.img"
    build_disk(disk, [(t, c if isinstance(c, int) else images[c]) for t, c in layout],
               table="dos")
    fs, which = _open(disk)
    assert which == want and fs.where.startswith("MBR partition")


def test_root_of_another_filesystem_is_the_error(images: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """A root-typed partition holding XFS is the guest's root: its fs/ is not the ext /boot
    next to it, and the error says why."""
    disk = tmp_path / "disk.img"
    offsets = build_disk(disk, [(XBOOTLDR, images["boot"]), (ROOT_X86_64, 16)])
    with open(disk, "r+b") as f:
        f.seek(offsets[1])
        f.write(b"XFSB")
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert "GPT partition 2 (Linux root x86-64)" in str(err.value)
    assert "xfs" in str(err.value)
    with FileImageReader(disk) as reader:  # a caller that names a path on /boot still gets it
        assert _which(GuestFS.open(reader, "vmlinuz")) == "boot"


@pytest.mark.parametrize("second, words", [
    (ROOT_X86_64, ("GPT partition 2 (Linux root x86-64)", "magic")),  # empty root: named
    (MS_DATA, ("the GPT has no Linux filesystem partition",)),  # no ext, no Linux type
])
def test_no_readable_partition_says_why(tmp_path: Path, second: str, words: tuple) -> None:
    disk = tmp_path / "disk.img"
    build_disk(disk, [(ESP, 2), (second, 4)])
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    for w in words:
        assert w in str(err.value)


LVM = "E6D6D379-F507-44C2-A23C-238F2A3DF928"
LUKS = "CA7D7CCB-63ED-4C53-861C-1742536059CC"
CONTAINERS = {  # what each holds at its start, as pvcreate, cryptsetup and mdadm write it
    "lvm": (512, b"LABELONE" + bytes(16) + b"LVM2 001", "an LVM physical volume"),
    "luks": (0, b"LUKS\xba\xbe\x00\x02", "a LUKS encrypted volume"),
    "md": (4096, (0xA92B4EFC).to_bytes(4, "little"), "a Linux RAID (md) member"),
}


def _put(disk: Path, offset: int, data: bytes) -> None:
    with open(disk, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("layout, table, kind", [
    ([(LINUX, "boot"), (LVM, 16)], "gpt", "lvm"),      # Ubuntu server with LVM
    ([("83", "boot"), ("8e", 16)], "dos", "lvm"),
    ([(LINUX, "boot"), (LUKS, 16)], "gpt", "luks"),
    ([("83", "boot"), ("83", 16)], "dos", "luks"),     # Debian's encrypted layout: 0x83 too
    ([("83", "boot"), ("fd", 16)], "dos", "md"),
])
def test_a_boot_beside_a_root_not_read_is_the_error(images: dict[str, Path], tmp_path: Path,
                                                    layout: list, table: str,
                                                    kind: str) -> None:
    """QA (nineteenth session): the ext /boot beside a root on LVM or LUKS was shown as the
    guest's files, and `ksfs diff` of two such disks said nothing changed."""
    disk = tmp_path / "disk.img"
    offsets = build_disk(disk, [(t, c if isinstance(c, int) else images[c]) for t, c in layout],
                         table=table)
    at, magic, said = CONTAINERS[kind]
    _put(disk, offsets[1] + at, magic)
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    part = "GPT partition" if table == "gpt" else "MBR partition"
    assert f"{part} 2 at byte" in str(err.value) and said in str(err.value), err.value
    with FileImageReader(disk) as reader:  # a caller that names a path on /boot still gets it
        assert _which(GuestFS.open(reader, "vmlinuz")) == "boot"


def test_a_root_beside_a_volume_not_read_is_still_the_root(images: dict[str, Path],
                                                          tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    offsets = build_disk(disk, [(LINUX, images["root"]), (LVM, 16)])
    _put(disk, offsets[1] + 512, CONTAINERS["lvm"][1])
    with FileImageReader(disk) as reader:
        assert _which(GuestFS.open(reader)) == "root"


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_a_volume_not_read_alone_is_named(tmp_path: Path, kind: str) -> None:
    """QA (nineteenth session): an LVM-only disk was "no Linux (0x83) partition"."""
    at, magic, said = CONTAINERS[kind]
    disk = tmp_path / "disk.img"
    offsets = build_disk(disk, [("8e", 16)], table="dos")
    _put(disk, offsets[0] + at, magic)
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert f"MBR partition 1 at byte 1048576 holds {said}" in str(err.value), err.value
    whole = tmp_path / "whole.img"
    whole.write_bytes(bytes(16 << 20))
    _put(whole, at, magic)
    with FileImageReader(whole) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert f"the whole disk holds {said}" in str(err.value), err.value


def test_a_gpt_for_4k_sectors_is_named(tmp_path: Path) -> None:
    """QA (nineteenth session): "no GPT header at sector 1" of a 4096-byte-sector disk."""
    disk = tmp_path / "disk.img"
    mbr = bytearray(512)
    mbr[446 + 4] = 0xEE  # protective
    mbr[446 + 8:446 + 16] = (1).to_bytes(4, "little") + (0xFFFFFFFF).to_bytes(4, "little")
    mbr[510:512] = b"\x55\xaa"
    disk.write_bytes(bytes(mbr) + bytes(4096 - 512) + b"EFI PART" + bytes((8 << 20) - 4104))
    with FileImageReader(disk) as reader, pytest.raises(GuestFSUnreadable) as err:
        GuestFS.open(reader)
    assert "4096-byte sectors" in str(err.value), err.value
