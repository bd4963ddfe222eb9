"""What the chunk store's tests share: an in-memory source, a one-file ingest, bit rot, and the
page records of QEMU's migration stream."""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

K64 = 64 * 1024
F_ZERO, F_PAGE, F_CONT = 0x02, 0x08, 0x20  # page record flags of QEMU's RAM section


class BytesSource:
    """An in-memory source with .size and .pread, as the vm layer hands over frozen layers."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def pread(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]


def put(store: Any, source: Any, chunking: str = "fixed", **kw: Any) -> Any:
    """Ingest one file (bytes, a path or a source) and commit it; returns its IngestedFile."""
    if isinstance(source, bytes | bytearray):
        source = BytesSource(bytes(source))
    with store.ingest() as ing:
        f = ing.add_file(source, chunking=chunking, **kw)
        ing.seal()
        with store.env.begin(write=True) as txn:
            ing.commit(txn)
    # what it stored as the seal left it (which may store chunks again), as the keeper records
    return dataclasses.replace(f, stored=ing.stored(f))


def flip(store: Any, cid: bytes, where: int = 10) -> None:
    """Flip one bit of a chunk's stored payload (``where`` from its start, or from its end when
    negative, so inside the record header), as disk rot would."""
    loc = store.lookup(cid)
    path = os.path.join(store.packs_dir, f"{loc.pack:08d}.pack")
    where = where % loc.stored_len if where >= 0 else where  # stay inside this record
    with open(path, "r+b") as f:
        f.seek(loc.offset + 52 + where)
        b = f.read(1)
        f.seek(loc.offset + 52 + where)
        f.write(bytes([b[0] ^ 0x40]))


def record(addr: int, data: bytes | None, first: bool = False, fill: int = 0,
           block: bytes = b"pc.ram") -> bytes:
    """One page record: data None is a zero page (with this fill byte), else the 4 KiB page."""
    flags = (F_ZERO if data is None else F_PAGE) | (0 if first else F_CONT)
    out = struct.pack(">Q", addr % 2**64 | flags) + (bytes([len(block)]) + block if first else b"")
    return out + (bytes([fill]) if data is None else data)
