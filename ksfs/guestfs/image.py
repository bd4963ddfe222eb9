"""Disk images as random-access readers: a plain-file adapter and the partition-table probe.

A *reader* is any object with ``.size`` (bytes) and a thread-safe ``.read(offset, n) -> bytes``
that returns fewer bytes only at the end (the chunk store's FileReader is one). This module finds
where the guest's filesystem starts inside one: the whole disk, or one partition of an MBR or GPT
table, chosen by what the partitions hold (ext superblocks), then by their types and sizes (see
``find_filesystems``). A table it cannot make sense of is an error.
"""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from typing import Protocol

from ksfs.errors import GuestFSUnreadable, translate
from ksfs.guestfs import layout

SECTOR = 512
EXT_MAGIC = 0xEF53
MBR_LINUX = 0x83
MBR_EXTENDED = (0x05, 0x0F, 0x85)
MBR_PROTECTIVE = 0xEE


def _guids(**named: str) -> dict[bytes, str]:
    return {uuid.UUID(g).bytes_le: name for name, g in named.items()}


GPT_LINUX_FS = uuid.UUID("0FC63DAF-8483-4772-8E79-3D69D8477DE4").bytes_le
# The Discoverable Partitions Specification's root types, one per architecture (as util-linux
# lists them: sfdisk --list-types --label gpt).
GPT_ROOT = _guids(**{
    "x86-64": "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709", "x86": "44479540-F297-41B2-9AF7-D131D5F0458A",
    "ARM-64": "B921B045-1DF0-41C3-AF44-4C6F280D3FAE", "ARM": "69DAD710-2CE4-4E3C-B16C-21A1D49ABED3",
    "Alpha": "6523F8AE-3EB1-4E2A-A05A-18B695AE656F", "ARC": "D27F46ED-2919-4CB8-BD25-9531F3C16534",
    "IA-64": "993D8D3D-F80E-4225-855A-9DAF8ED7EA97",
    "LoongArch-64": "77055800-792C-4F94-B39A-98C91B762BB6",
    "MIPS-32 LE": "37C58C8A-D913-4156-A25F-48B1B64E07F0",
    "MIPS-64 LE": "700BDA43-7A34-4507-B179-EEB93D7A7CA3",
    "PPC": "1DE3F1EF-FA98-47B5-8DCD-4A860A654D78", "PPC64": "912ADE1D-A839-4913-8964-A10EEE08FBD2",
    "PPC64LE": "C31C45E6-3F39-412E-80FB-4809C4980599",
    "RISC-V-32": "60D5A7FE-8E7D-435C-B714-3DD8162144E1",
    "RISC-V-64": "72EC70A6-CF74-40E6-BD49-4BDA08E8F224",
    "S390": "08A7ACEA-624C-4A20-91E8-6E0FA67D23F9", "S390X": "5EEAD9A9-FE09-4A1E-A1D7-520D00531306",
    "TILE-Gx": "C50CDD70-3862-4CC3-90E1-809A8C93EE2C",
})
# Other Linux types of the same specification: filesystems mounted below the root.
GPT_MOUNTED = _guids(**{
    "/home": "933AC7E1-2EB4-4F13-B844-0E14E2AEF915", "/srv": "3B8F8425-20E0-4F3B-907F-1A25A76F98E8",
    "/var": "4D21B016-B534-45C2-A9FB-5C16E091FD2D",
    "/var/tmp": "7EC6F557-3BC5-4ACA-B293-16EF5DF639D1",
    "/boot": "BC13C2FF-59E6-4262-A352-B275FD6F7172",  # XBOOTLDR
    "/home/user": "773F91EF-66D4-49B5-BD83-D683BF40AD16",
    "/usr x86-64": "8484680C-9521-48C6-9C11-B0720656F69E",
    "/usr ARM-64": "B0E01050-EE5F-4390-949A-9101B17104E9",
})
# The preference between partitions by type: the root, a generic Linux filesystem (GPT
# 0FC63DAF..., MBR 0x83), one mounted below the root (/home, /boot, ...), anything else.
ROLE_RANK = {"root": 0, "linux": 1, "mounted": 2, "other": 3}
# What is recognised but not read, as said in errors: the guest's root may be on one (Ubuntu's
# LVM and Debian's encrypted layouts put an ext /boot beside it), so it is never replaced by
# that /boot (QA, nineteenth session).
NOT_READ = {"btrfs": "a btrfs filesystem; only ext2/3/4 are read",
            "xfs": "a xfs filesystem; only ext2/3/4 are read",
            "lvm": "an LVM physical volume; LVM volumes are not read",
            "luks": "a LUKS encrypted volume; encrypted volumes are not read",
            "md": "a Linux RAID (md) member; RAID volumes are not read"}
# The preference by content: a filesystem (ext, or one this does not read, which is then the
# error), an ext superblock that does not parse, nothing recognised.
CONTENT_RANK = {"ext": 0, **dict.fromkeys(NOT_READ, 0), "ext-damaged": 1, "": 2}
MD_MAGIC = struct.pack("<I", 0xA92B4EFC)


class Reader(Protocol):
    size: int

    def read(self, offset: int, n: int) -> bytes: ...


class FileImageReader:
    """A reader over a plain file (pread), for tests and for images outside the store."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with translate("open disk image", self.path):
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, n: int) -> bytes:
        end = min(self.size, offset + n)
        parts = []
        pos = offset
        with translate("read disk image", self.path):
            while pos < end:
                got = os.pread(self._fd, end - pos, pos)
                if not got:  # the file shrank under us: say so rather than invent bytes
                    raise GuestFSUnreadable(why=f"{self.path} ended early at byte {pos}")
                parts.append(got)
                pos += len(got)
        return b"".join(parts)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileImageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_exact(reader: Reader, offset: int, n: int, what: str) -> bytes:
    """``n`` bytes at ``offset`` or GuestFSUnreadable naming ``what`` (never a short answer)."""
    if offset < 0 or offset + n > reader.size:
        raise GuestFSUnreadable(
            why=f"{what} at byte {offset} (+{n}) lies past the end of the {reader.size}-byte disk"
        )
    data = reader.read(offset, n)
    if len(data) != n:
        raise GuestFSUnreadable(why=f"short read of {what} at byte {offset}")
    return data


@dataclass(frozen=True)
class Partition:
    """A place a guest filesystem may be: ``where`` names it in messages, ``role`` is what its
    type says (see ROLE_RANK), ``content`` what its first bytes hold (see CONTENT_RANK)."""

    offset: int
    length: int
    where: str
    role: str
    content: str
    index: int = 0  # its place in the table, the last tie-break
    why: str = ""  # why it cannot be read whatever it holds (it does not fit in the disk)
    number: int = 0  # the kernel's number for it (vdaN; logical ones from 5); 0: whole disk

    @property
    def tier(self) -> tuple[int, int]:
        """Partitions of one tier are told apart by size, or by what their files say."""
        return ROLE_RANK[self.role], CONTENT_RANK[self.content]

    def check(self) -> None:
        """GuestFSUnreadable when this partition cannot be read as ext: it does not fit in the
        disk, or it holds another filesystem."""
        if self.why:
            raise GuestFSUnreadable(why=self.why)
        if self.content in NOT_READ:
            raise GuestFSUnreadable(why=f"{self.where} holds {NOT_READ[self.content]}")


def has_ext_magic(reader: Reader, offset: int) -> bool:
    if offset + 2048 > reader.size:
        return False
    return struct.unpack("<H", reader.read(offset + 1024 + 0x38, 2))[0] == EXT_MAGIC


def probe(reader: Reader, offset: int, length: int) -> str:
    """What the partition at ``offset`` holds: "ext" (a superblock that parses), "ext-damaged"
    (the magic only), one of NOT_READ, or "" (nothing recognised)."""
    if has_ext_magic(reader, offset):
        try:
            layout.parse_superblock(read_exact(reader, offset + 1024, 1024, "superblock"), length)
            return "ext"
        except GuestFSUnreadable:
            return "ext-damaged"
    head = reader.read(offset, min(length, 2048, max(0, reader.size - offset)))
    if head[:4] == b"XFSB":
        return "xfs"
    if head[:6] == b"LUKS\xba\xbe":  # LUKS1 and LUKS2 alike
        return "luks"
    for sector in range(4):  # an LVM2 label is in one of the first four sectors
        label = head[sector * SECTOR: sector * SECTOR + 32]
        if label[:8] == b"LABELONE" and label[24:32] == b"LVM2 001":
            return "lvm"
    if length >= 0x10048 and reader.read(offset + 0x10040, 8) == b"_BHRfS_M":
        return "btrfs"
    # md superblocks 1.1 (at the start) and 1.2 (4 KiB in); 0.90 and 1.0 sit at the end, and
    # a RAID1 member of those holds its filesystem at byte 0, which reads as itself.
    if head[:4] == MD_MAGIC or length >= 4096 + 4 and reader.read(offset + 4096, 4) == MD_MAGIC:
        return "md"
    return ""


def _boot_sector_fs(sector: bytes) -> str:
    """The filesystem a DOS-style boot sector at the start of the disk says it holds, if any."""
    if sector[3:11] == b"NTFS    ":
        return "ntfs"
    if sector[3:11] == b"EXFAT   ":
        return "exfat"
    if sector[0x36:0x39] == b"FAT" or sector[0x52:0x57] == b"FAT32":
        return "vfat"
    return ""


# The magic of disk image formats that wrap a disk instead of being one (a cloud image is often
# a qcow2 file named .img): imported, they are stored byte for byte, but hold no filesystem at 0.
IMAGE_MAGIC = ((b"QFI\xfb", "qcow2"), (b"KDMV", "VMDK"), (b"vhdxfile", "VHDX"),
               (b"conectix", "VHD"), (b"QED\x00", "QED"))


def _image_format(head: bytes) -> str:
    for magic, name in IMAGE_MAGIC:
        if head.startswith(magic):
            return name
    if head[64:68] == b"\x7f\x10\xda\xbe":  # VDI: its signature follows a 64-byte text header
        return "VDI"
    return ""


def find_filesystem(reader: Reader) -> tuple[int, int, str]:
    """(byte offset, byte length, description) of the filesystem to read inside ``reader``: the
    first of ``find_filesystems`` (``GuestFS.open`` may prefer another of the same tier by
    what it holds)."""
    first = find_filesystems(reader)[0]
    first.check()
    return first.offset, first.length, first.where


def find_filesystems(reader: Reader) -> list[Partition]:
    """The places the guest filesystem may be, best first; never empty.

    A whole-disk ext filesystem is the only one. Otherwise every partition of the MBR (primary,
    then logical ones in extended partitions) or GPT is probed, and those that hold a
    filesystem or whose type says Linux are ordered by type (a GPT root type of any
    architecture; a generic Linux filesystem or MBR 0x83; a type mounted below the root such as
    /home, /srv, /var or XBOOTLDR /boot; any other type), then by content (a filesystem, then a
    damaged ext superblock, then nothing), then by size (largest first), then table order. When
    no partition holds a filesystem and none is typed Linux, the error says the table has no
    Linux partition.
    """
    if has_ext_magic(reader, 0):
        return [Partition(0, reader.size, "whole disk", "linux", "ext")]
    if reader.size < SECTOR:
        raise GuestFSUnreadable(why=f"the disk is only {reader.size} bytes")
    other = probe(reader, 0, reader.size)
    if other:
        raise GuestFSUnreadable(why=f"the whole disk holds {NOT_READ[other]}")
    other = _boot_sector_fs(reader.read(0, SECTOR))
    if other:  # (a FAT boot sector ends in 0x55AA too: not taken for a partition table)
        raise GuestFSUnreadable(
            why=f"the whole disk holds a {other} filesystem; only ext2/3/4 are read")
    mbr = reader.read(0, SECTOR)
    container = _image_format(mbr)
    if container:
        raise GuestFSUnreadable(
            why=f"the file is a {container} image, not a raw disk: guest files are read from "
                f"raw images (`qemu-img convert -O raw` it, then import that)")
    if mbr[510:512] != b"\x55\xaa":
        raise GuestFSUnreadable(
            why="no ext2/3/4 superblock magic at byte 1080 and no partition table"
        )
    entries = [_mbr_entry(mbr, i) for i in range(4)]
    if any(kind == MBR_PROTECTIVE for kind, _, _ in entries):
        found = _gpt_partitions(reader)
        none = "the GPT has no Linux filesystem partition"
    else:
        found = _mbr_partitions(reader, entries)
        none = "the MBR partition table has no Linux (0x83) partition"
    found = [p for p in found if p.content or p.role != "other"]
    if not found:
        raise GuestFSUnreadable(why=f"{none} (and none holds an ext2/3/4 filesystem)")
    return sorted(found, key=lambda p: (p.tier, -p.length, p.index))


def _mbr_entry(sector: bytes, i: int) -> tuple[int, int, int]:
    base = 446 + 16 * i
    kind = sector[base + 4]
    start, count = struct.unpack_from("<II", sector, base + 8)
    return kind, start, count


def _mbr_partitions(reader: Reader, entries: list[tuple[int, int, int]]) -> list[Partition]:
    found: list[Partition] = []
    for i, (kind, start, count) in enumerate(entries):
        if kind and kind not in MBR_EXTENDED and count:
            _add(found, reader, start, count, f"MBR partition {i + 1}",
                 "linux" if kind == MBR_LINUX else "other", i + 1)
    damaged: GuestFSUnreadable | None = None
    for kind, start, _ in entries:
        if kind in MBR_EXTENDED:
            try:
                _logical(reader, start, found)
            except GuestFSUnreadable as exc:
                damaged = exc
    if damaged is not None and not any(p.content or p.role == "linux" for p in found):
        raise damaged  # the chain is all there might have been: say what is wrong with it
    return found


def _logical(reader: Reader, ext_start: int, found: list[Partition]) -> None:
    """Walk the chain of extended boot records, adding each logical partition to ``found``."""
    ebr_lba = ext_start
    number = 5  # as Linux numbers them: only boot records with a data entry count
    for _ in range(128):  # a chain longer than this is a loop in a damaged table
        ebr = read_exact(reader, ebr_lba * SECTOR, SECTOR, "extended boot record")
        if ebr[510:512] != b"\x55\xaa":
            raise GuestFSUnreadable(why=f"extended boot record at sector {ebr_lba} is damaged")
        kind, start, count = _mbr_entry(ebr, 0)
        if kind and count:
            _add(found, reader, ebr_lba + start, count, f"logical partition {number}",
                 "linux" if kind == MBR_LINUX else "other", number)
            number += 1
        nkind, nstart, _ = _mbr_entry(ebr, 1)
        if nkind not in MBR_EXTENDED or nstart == 0:
            return
        ebr_lba = ext_start + nstart
    raise GuestFSUnreadable(why="the chain of extended boot records does not end")


def _gpt_table(reader: Reader, lba: int) -> tuple[bytes, int, int] | None:
    """(entries, count, entry size) of the GPT header at ``lba`` when it and its entries pass
    their CRC32s, else None."""
    if lba < 1 or (lba + 1) * SECTOR > reader.size:
        return None
    header = read_exact(reader, lba * SECTOR, SECTOR, "GPT header")
    size = struct.unpack_from("<I", header, 0x0C)[0]
    if header[:8] != b"EFI PART" or not 92 <= size <= SECTOR:
        return None
    if zlib.crc32(header[:0x10] + bytes(4) + header[0x14:size]) != \
            struct.unpack_from("<I", header, 0x10)[0]:
        return None
    table_lba, count, entry_size, table_crc = struct.unpack_from("<QIII", header, 0x48)
    if not 128 <= entry_size <= 4096 or count > 4096 or \
            (table_lba + (count * entry_size + SECTOR - 1) // SECTOR) * SECTOR > reader.size:
        return None
    table = read_exact(reader, table_lba * SECTOR, count * entry_size, "GPT partition table")
    return (table, count, entry_size) if zlib.crc32(table) == table_crc else None


def _gpt_partitions(reader: Reader) -> list[Partition]:
    # The primary header at sector 1, else (damaged) the backup at the last sector, as the
    # kernel reads a GPT; a primary that only fails its checksums is still taken when there
    # is no good backup.
    got = _gpt_table(reader, 1) or _gpt_table(reader, reader.size // SECTOR - 1)
    if got is None:
        header = read_exact(reader, SECTOR, 92, "GPT header")
        if header[:8] != b"EFI PART":
            if reader.size >= 4096 + 8 and reader.read(4096, 8) == b"EFI PART":
                raise GuestFSUnreadable(why="the GPT is laid out for 4096-byte sectors (its "
                                            "header at byte 4096); only disks of 512-byte "
                                            "sectors are read")
            raise GuestFSUnreadable(why="protective MBR but no GPT header at sector 1, nor a "
                                        "valid backup at the last sector")
        table_lba, count, entry_size = struct.unpack_from("<QII", header, 0x48)
        if not 128 <= entry_size <= 4096 or count > 4096:
            raise GuestFSUnreadable(
                why=f"GPT header is damaged ({count} entries of {entry_size} bytes)"
            )
        got = (read_exact(reader, table_lba * SECTOR, count * entry_size,
                          "GPT partition table"), count, entry_size)
    table, count, entry_size = got
    found: list[Partition] = []
    for i in range(count):
        entry = table[i * entry_size : (i + 1) * entry_size]
        kind = entry[:16]
        if kind == bytes(16):
            continue  # an unused entry
        if kind in GPT_ROOT:
            role, what = "root", f"GPT partition {i + 1} (Linux root {GPT_ROOT[kind]})"
        elif kind in GPT_MOUNTED:
            role, what = "mounted", f"GPT partition {i + 1} (Linux {GPT_MOUNTED[kind]})"
        elif kind == GPT_LINUX_FS:
            role, what = "linux", f"GPT partition {i + 1}"
        else:
            role, what = "other", f"GPT partition {i + 1}"
        first, last = struct.unpack_from("<QQ", entry, 32)
        if last < first:
            if role != "other":
                found.append(Partition(0, 0, what, role, "", len(found),
                                       why=f"GPT partition {i + 1} ends before it starts",
                                       number=i + 1))
            continue
        _add(found, reader, first, last - first + 1, what, role, i + 1)
    return found


def _add(found: list[Partition], reader: Reader, lba: int, sectors: int, what: str,
         role: str, number: int) -> None:
    """Probe one partition and add it to ``found``. One that does not fit in the disk is kept
    (as one that cannot be read) when its type says Linux and passed over otherwise."""
    offset, length = lba * SECTOR, sectors * SECTOR
    if lba == 0 or offset + length > reader.size:
        if role != "other":
            found.append(Partition(offset, length, what, role, "", len(found), why=(
                f"{what} (sectors {lba}+{sectors}) does not fit in the {reader.size}-byte disk"),
                number=number))
        return
    found.append(Partition(offset, length, f"{what} at byte {offset}", role,
                           probe(reader, offset, length), len(found), number=number))
