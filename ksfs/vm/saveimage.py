"""The header of a libvirt QEMU save image: read it, and rewrite the domain XML inside it.

Layout (libvirt 9.0, qemu_saveimage.c): 16-byte magic ``LibvirtQemudSave``; little-endian u32
version, data length, was_running, compressed, cookie offset, 14 unused u32 (92 bytes in all);
then the data area of ``data length`` bytes: domain XML, NUL, cookie XML, NUL, zero padding;
then QEMU's migration stream. A fork replaces the domain XML in place (libvirt refuses a restore
whose XML changes the UUID): the new XML and the cookie must fit the data area, so the migration
stream never moves. Pure file I/O on the header only; never touches the migration stream.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ksfs.errors import VMError

MAGIC = b"LibvirtQemudSave"
PARTIAL_MAGIC = b"LibvirtQemudPart"  # written first by libvirt; renamed to MAGIC when complete
HEADER = struct.Struct("<16s19I")
HEADER_SIZE = HEADER.size  # 92
MAX_DATA = 64 << 20


@dataclass(frozen=True)
class SaveHeader:
    version: int
    data_len: int
    was_running: int
    compressed: int
    cookie_offset: int
    unused: tuple[int, ...]
    xml: str
    cookie: str  # "" when the image has none (version 1, or cookie offset 0)

    @property
    def free(self) -> int:
        """Bytes of padding left in the data area."""
        return self.data_len - self._used(self.xml, self.cookie)

    @staticmethod
    def _used(xml: str, cookie: str) -> int:
        n = len(xml.encode()) + 1
        if cookie:
            n += len(cookie.encode()) + 1
        return n


def read_header(path: Path) -> SaveHeader:
    """Parse the header and data area of a save image; VMError when it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                raise VMError(f"{path} is too short to be a libvirt save image")
            magic, version, data_len, was_running, compressed, cookie_off, *unused = \
                HEADER.unpack(head)
            if magic == PARTIAL_MAGIC:
                raise VMError(f"{path} is an incomplete libvirt save image")
            if magic != MAGIC:
                raise VMError(f"{path} is not a libvirt save image (bad magic)")
            if not 0 < data_len <= MAX_DATA:
                raise VMError(f"{path} has an implausible save image data length {data_len}")
            data = f.read(data_len)
    except OSError as exc:
        raise VMError(f"reading save image {path} failed: {exc.strerror or exc}") from exc
    if len(data) < data_len:
        raise VMError(f"{path} ends inside its save image header")
    end = data.find(b"\0")
    if end < 0:
        raise VMError(f"{path}: the domain XML in the save image is not NUL-terminated")
    xml = data[:end].decode()
    cookie = ""
    if version >= 2 and cookie_off:
        if cookie_off > data_len:
            raise VMError(f"{path}: save image cookie offset {cookie_off} is past its data")
        cend = data.find(b"\0", cookie_off)
        if cend < 0:
            raise VMError(f"{path}: the cookie in the save image is not NUL-terminated")
        cookie = data[cookie_off:cend].decode()
    return SaveHeader(version, data_len, was_running, compressed, cookie_off, tuple(unused),
                      xml, cookie)


def rewrite_xml(path: Path, new_xml: str) -> SaveHeader:
    """Replace the domain XML held in a save image's header, in place; return the new header.

    The data area keeps its length, so QEMU's stream after it is untouched. Raises VMError
    (and leaves the file as it was) when the new XML and cookie do not fit.
    """
    old = read_header(path)
    xml_b = new_xml.encode()
    if b"\0" in xml_b:
        raise VMError("the new domain XML contains a NUL byte")
    cookie_b = old.cookie.encode()
    data = xml_b + b"\0"
    cookie_off = 0
    if old.cookie:
        cookie_off = len(data)
        data += cookie_b + b"\0"
    if len(data) > old.data_len:
        raise VMError(
            f"the new domain XML ({len(xml_b)} bytes) does not fit the save image {path.name}: "
            f"its data area holds {old.data_len} bytes with the cookie"
        )
    data += bytes(old.data_len - len(data))
    head = HEADER.pack(MAGIC, old.version, old.data_len, old.was_running, old.compressed,
                       cookie_off, *old.unused)
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, head + data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise VMError(f"rewriting save image {path} failed: {exc.strerror or exc}") from exc
    return read_header(path)


def set_was_running(path: Path, running: bool) -> None:
    """Set the header's was_running flag (restore with neither flag follows it)."""
    old = read_header(path)
    head = HEADER.pack(MAGIC, old.version, old.data_len, int(running), old.compressed,
                       old.cookie_offset, *old.unused)
    with open(path, "r+b") as f:
        f.write(head)
        f.flush()
        os.fsync(f.fileno())
