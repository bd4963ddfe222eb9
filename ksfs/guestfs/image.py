"""Disk images as random-access readers: a plain-file adapter and the partition-table probe.

A *reader* is any object with ``.size`` (bytes) and a thread-safe ``.read(offset, n) -> bytes``
that returns fewer bytes only at the end (the chunk store's FileReader is one). This module finds
where the guest's filesystem starts inside one: the whole disk, or the first Linux partition of
an MBR or GPT table. It never guesses: a table it cannot make sense of is an error.
"""

from __future__ import annotations

import os
import struct
import uuid
from typing import Protocol

from ksfs.errors import GuestFSUnreadable, translate

SECTOR = 512
EXT_MAGIC = 0xEF53
MBR_LINUX = 0x83
MBR_EXTENDED = (0x05, 0x0F, 0x85)
MBR_PROTECTIVE = 0xEE
GPT_LINUX_FS = uuid.UUID("0FC63DAF-8483-4772-8E79-3D69D8477DE4").bytes_le


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


def has_ext_magic(reader: Reader, offset: int) -> bool:
    if offset + 2048 > reader.size:
        return False
    return struct.unpack("<H", reader.read(offset + 1024 + 0x38, 2))[0] == EXT_MAGIC


def find_filesystem(reader: Reader) -> tuple[int, int, str]:
    """(byte offset, byte length, description) of the filesystem to read inside ``reader``."""
    if has_ext_magic(reader, 0):
        return 0, reader.size, "whole disk"
    if reader.size < SECTOR:
        raise GuestFSUnreadable(why=f"the disk is only {reader.size} bytes")
    mbr = reader.read(0, SECTOR)
    if mbr[510:512] != b"\x55\xaa":
        raise GuestFSUnreadable(
            why="no ext2/3/4 superblock magic at byte 1080 and no partition table"
        )
    entries = [_mbr_entry(mbr, i) for i in range(4)]
    if any(kind == MBR_PROTECTIVE for kind, _, _ in entries):
        return _find_gpt(reader)
    for kind, start, count in entries:
        if kind == MBR_LINUX:
            return _partition(reader, start, count, "MBR partition")
    for kind, start, _ in entries:
        if kind in MBR_EXTENDED:
            found = _find_logical(reader, start)
            if found is not None:
                return found
    raise GuestFSUnreadable(why="the MBR partition table has no Linux (0x83) partition")


def _mbr_entry(sector: bytes, i: int) -> tuple[int, int, int]:
    base = 446 + 16 * i
    kind = sector[base + 4]
    start, count = struct.unpack_from("<II", sector, base + 8)
    return kind, start, count


def _find_logical(reader: Reader, ext_start: int) -> tuple[int, int, str] | None:
    """Walk the chain of extended boot records for the first Linux logical partition."""
    ebr_lba = ext_start
    for _ in range(128):  # a chain longer than this is a loop in a damaged table
        ebr = read_exact(reader, ebr_lba * SECTOR, SECTOR, "extended boot record")
        if ebr[510:512] != b"\x55\xaa":
            raise GuestFSUnreadable(why=f"extended boot record at sector {ebr_lba} is damaged")
        kind, start, count = _mbr_entry(ebr, 0)
        if kind == MBR_LINUX:
            return _partition(reader, ebr_lba + start, count, "logical partition")
        nkind, nstart, _ = _mbr_entry(ebr, 1)
        if nkind not in MBR_EXTENDED or nstart == 0:
            return None
        ebr_lba = ext_start + nstart
    raise GuestFSUnreadable(why="the chain of extended boot records does not end")


def _find_gpt(reader: Reader) -> tuple[int, int, str]:
    header = read_exact(reader, SECTOR, 92, "GPT header")
    if header[:8] != b"EFI PART":
        raise GuestFSUnreadable(why="protective MBR but no GPT header at sector 1")
    table_lba, count, entry_size = struct.unpack_from("<QII", header, 0x48)
    if not 128 <= entry_size <= 4096 or count > 4096:
        raise GuestFSUnreadable(
            why=f"GPT header is damaged ({count} entries of {entry_size} bytes)"
        )
    table = read_exact(reader, table_lba * SECTOR, count * entry_size, "GPT partition table")
    for i in range(count):
        entry = table[i * entry_size : (i + 1) * entry_size]
        if entry[:16] == GPT_LINUX_FS:
            first, last = struct.unpack_from("<QQ", entry, 32)
            if last < first:
                raise GuestFSUnreadable(why=f"GPT partition {i + 1} ends before it starts")
            return _partition(reader, first, last - first + 1, f"GPT partition {i + 1}")
    raise GuestFSUnreadable(why="the GPT has no Linux filesystem partition")


def _partition(reader: Reader, lba: int, sectors: int, what: str) -> tuple[int, int, str]:
    offset, length = lba * SECTOR, sectors * SECTOR
    if lba == 0 or offset + length > reader.size:
        raise GuestFSUnreadable(
            why=f"{what} (sectors {lba}+{sectors}) does not fit in the {reader.size}-byte disk"
        )
    return offset, length, f"{what} at byte {offset}"
