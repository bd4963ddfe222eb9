"""Page hints: which plain chunks of a file's last version hold which 4 KiB pages.

An ingest finds a new chunk's pages in other chunks only among those whose bytes it holds: the
chunks it stores itself, and the old versions it reads as delta bases (``Ingest._homes_of``). A
guest's memory keeps many pages it wrote before the last save, moved since (a buffer freed and
its pages reused, a file's page cache and the tmpfs buffer it was copied from): their copies lie
in the chunks the last checkpoint brought, which the next ingest does not read. Hashing every
stored chunk's pages again at each save would cost more time than the save may take.

So each ingest of a later version keeps, beside the manifest it made, the CRC-32 of every data
page of the plain chunks it stored (4 bytes a page, about 0.2% of what those chunks hold), under
``page_hints/<manifest id>`` in ``cas_meta``. The next ingest of that file reads them and reads a
hinted chunk only when a new chunk's pages vote for it. Hints are advice: a wrong or damaged one
proposes a useless base at worst, since a base is read and checked by its id like every chunk.
Only the newest version's hints are kept (an ingest drops those of the version it was like), and
GC drops those of manifests it deletes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Sequence

from ksfs.cas import format as fmt

PREFIX = b"page_hints/"
KEPT = 4 << 20  # page keys one ingest keeps: the pages of 4 GiB of plain chunks it stores
CHUNK = struct.Struct("<IH")  # the chunk's entry number in the manifest, its page count
PAGE_KEY = struct.Struct("<I")


def page_key(page: bytes) -> int:
    """The key pages are matched by (a collision only proposes a useless base)."""
    return zlib.crc32(page)


def key(manifest_id: bytes) -> bytes:
    return PREFIX + manifest_id


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(keys)}I", *keys[:0xFFFF])


def encode(chunks: Iterable[tuple[int, bytes]]) -> bytes:
    """(entry number, its page keys packed) of each chunk, as stored."""
    out = bytearray()
    for entry, keys in chunks:
        out += CHUNK.pack(entry, len(keys) // PAGE_KEY.size)
        out += keys
    return bytes(out)


def homes(raw: bytes, entries: Sequence[fmt.Entry]) -> dict[int, bytes]:
    """page key -> id of the chunk of ``entries`` (the hinted manifest's) holding that page. A
    value cut short or naming an entry that is no chunk ends the list there: hints are advice."""
    out: dict[int, bytes] = {}
    pos = 0
    while pos + CHUNK.size <= len(raw):
        entry, count = CHUNK.unpack_from(raw, pos)
        pos += CHUNK.size
        end = pos + count * PAGE_KEY.size
        if end > len(raw) or entry >= len(entries) or entries[entry][0] is None:
            break
        cid = entries[entry][0]
        for (page,) in PAGE_KEY.iter_unpack(raw[pos:end]):
            out.setdefault(page, cid)
        pos = end
    return out
