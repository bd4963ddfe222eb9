"""On-disk encodings of the chunk store: pack records, index values, pack stats and manifests.

Pure functions over bytes: this module never touches a file or the LMDB environment, so every
layout decision of the store is in one place and can be tested on its own.

A pack record is a 52-byte header followed by the stored payload::

    magic "KSC1" | chunk id (32) | plain len u32 | stored len u32 | codec u8 | pad 3 | crc32 u32

The header's crc32 covers the 48 bytes before it, so a check can walk and judge a pack without
the index. The payload is zstd (codec 1), raw bytes (codec 0, when zstd does not shrink it), or a
delta (codec 2): the 32-byte id of a base chunk, then zstd compressed with the base's plain bytes
as its dictionary, so the pages a new version of a memory group or disk cluster shares with the
old one cost almost nothing; or a delta on several bases (codec 3): a count u8 (2 to
MAX_BASES), that many base ids, then zstd with the bases' plain bytes one after another as its
dictionary, for a chunk whose pages repeat those of several others. A base is never itself a
delta: a read needs at most the bases' records besides its own. Index values of deltas carry
the base ids after the fixed fields, so GC marks bases without reading packs.

A manifest is ``"KSM1" | chunking u8 | pad 3 | size u64 | count u64`` then ``count`` 40-byte
entries ``length u64 | id (32)``; the top bit of length marks a hole (id all zero). Adjacent
holes are always merged, so equal content chunked the same way gives byte-equal manifests.

A manifest is stored either as those bytes or, where that is less than half their size, as a
delta on an earlier manifest stored plain (its base, usually the same file in the first
checkpoint of a run): ``"KSD1" | base manifest id (32) | plain len u64`` then a zstd frame with
the base's bytes as its dictionary. A manifest's id is always the BLAKE3 of its plain bytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from ksfs.errors import ChunkCorrupt, IntegrityError, ManifestCorrupt

CHUNK_MAGIC = b"KSC1"
RECORD_HEADER = struct.Struct("<4s32sIIB3xI")
HEADER_SIZE = RECORD_HEADER.size  # 52
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_DELTA = 2
CODEC_DELTAS = 3
CODECS = (CODEC_RAW, CODEC_ZSTD, CODEC_DELTA, CODEC_DELTAS)
DELTA_CODECS = (CODEC_DELTA, CODEC_DELTAS)
BASE_ID_SIZE = 32
MAX_BASES = 8  # a delta's dictionary is at most this many chunks (8 x 64 KiB for disk clusters)

INDEX_VALUE = struct.Struct("<IQIIB")  # pack, record offset, stored len, plain len, codec[, bases]
# any other length is damage
INDEX_VALUE_SIZES = tuple(INDEX_VALUE.size + BASE_ID_SIZE * k for k in range(MAX_BASES + 1))
PACK_VALUE = struct.Struct("<QQ")  # committed size of the pack file, live record bytes
# Bounds no real index value comes near (packs close at 32 MiB, chunks are at most 1 MiB: the
# page cutter's cap, pagecut.CHUNK_MAX): past them an entry is damage, not something to pread
# (an offset past 2**63 is an OverflowError, a 4 GiB length a 4 GiB allocation).
MAX_PACK_OFFSET = 1 << 40
MAX_STORED_LEN = 1 << 26

MANIFEST_MAGIC = b"KSM1"
MANIFEST_HEADER = struct.Struct("<4sB3xQQ")
MANIFEST_DELTA_MAGIC = b"KSD1"
MANIFEST_DELTA_HEADER = struct.Struct("<4s32sQ")  # magic, base manifest id, plain length
MANIFEST_ENTRY = struct.Struct("<Q32s")
HOLE_BIT = 1 << 63
NO_ID = bytes(32)
CHUNKINGS = {"fixed": 0, "cdc": 1}
CHUNKING_NAMES = {v: k for k, v in CHUNKINGS.items()}


def delta_payload(base_ids: Sequence[bytes], frame: bytes) -> tuple[int, bytes]:
    """(codec, payload) of a delta on these bases."""
    if len(base_ids) == 1:
        return CODEC_DELTA, base_ids[0] + frame
    return CODEC_DELTAS, bytes([len(base_ids)]) + b"".join(base_ids) + frame


def split_base_ids(named: bytes) -> tuple[bytes, ...]:
    """The base ids a delta's index value or record names one after another (a piece shorter
    than an id at the end is none)."""
    return tuple(named[i : i + BASE_ID_SIZE]
                 for i in range(0, len(named) - BASE_ID_SIZE + 1, BASE_ID_SIZE))


def delta_bases(payload: bytes | memoryview, codec: int) -> tuple[bytes, int] | None:
    """(the base ids one after another, where the zstd frame starts) of a delta record's
    payload; None when it cannot hold them."""
    if codec == CODEC_DELTA:
        n, start = 1, 0
    elif len(payload) < 1 or not 2 <= payload[0] <= MAX_BASES:
        return None
    else:
        n, start = payload[0], 1
    end = start + n * BASE_ID_SIZE
    if len(payload) < end:
        return None
    return bytes(payload[start:end]), end


def chunk_id(data: bytes | memoryview) -> bytes:
    """The id of a chunk: BLAKE3 of its plain bytes (the GIL is released for large inputs)."""
    return blake3.blake3(data).digest()


def encode_record_header(cid: bytes, plain_len: int, stored_len: int, codec: int) -> bytes:
    body = RECORD_HEADER.pack(CHUNK_MAGIC, cid, plain_len, stored_len, codec, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def decode_record_header(raw: bytes) -> tuple[bytes, int, int, int] | str:
    """Return (id, plain len, stored len, codec) or a sentence saying what is wrong."""
    if len(raw) < HEADER_SIZE:
        return "record header cut short"
    magic, cid, plain_len, stored_len, codec, crc = RECORD_HEADER.unpack_from(raw)
    if magic != CHUNK_MAGIC:
        return "bad record magic"
    if zlib.crc32(memoryview(raw)[: HEADER_SIZE - 4]) != crc:
        return "record header checksum mismatch"
    if codec not in CODECS:
        return f"unknown codec {codec}"
    return cid, plain_len, stored_len, codec


@dataclass(frozen=True, slots=True)  # an ingest holds one per new chunk until its commit
class Location:
    """Where a chunk lives: its record starts at ``offset`` in pack ``pack``. ``base``: the id
    of the chunk a delta (codec 2) is decoded against, or the ids one after another of the
    chunks a delta on several bases (codec 3) is; None for any other codec."""

    pack: int
    offset: int
    stored_len: int
    plain_len: int
    codec: int
    base: bytes | None = None

    @property
    def base_ids(self) -> tuple[bytes, ...]:
        return split_base_ids(self.base or b"")

    def bases_disagree(self) -> bool:
        """Whether the codec and the number of bases the entry names disagree (none but for a
        delta, one for codec 2, two or more for codec 3): damage, since GC keeps the bases the
        index names and an entry that lost one would let its base go."""
        n = len(self.base_ids)
        if self.codec not in DELTA_CODECS:
            return n != 0
        return n != 1 if self.codec == CODEC_DELTA else n < 2

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.stored_len

    def encode(self) -> bytes:
        fixed = INDEX_VALUE.pack(self.pack, self.offset, self.stored_len, self.plain_len,
                                 self.codec)
        return fixed if self.base is None else fixed + self.base

    @classmethod
    def decode(cls, raw: bytes, cid: bytes | None = None) -> Location:
        """The location an index value gives chunk ``cid``. ChunkCorrupt (exit 6) when the
        value has no index value's length: damage in place can leave any bytes there, and a
        struct.error would be a traceback (QA)."""
        if len(raw) not in INDEX_VALUE_SIZES:
            short, long = INDEX_VALUE_SIZES[0], INDEX_VALUE_SIZES[-1]
            sizes = (f"{len(raw)} bytes, where an entry has {short} or {short} plus 32 for each "
                     f"base, up to {long}")
            if cid is None:
                raise IntegrityError(f"a chunk's index entry no longer decodes ({sizes})")
            raise ChunkCorrupt(chunk=cid.hex(), why=f"its index entry no longer decodes ({sizes})")
        base = bytes(raw[INDEX_VALUE.size :]) or None
        return cls(*INDEX_VALUE.unpack_from(raw), base=base)

    def problem(self) -> str | None:
        """What makes this location impossible (a damaged index value), or None. Decoding
        stays lenient so check can list such entries; readers ask this before they read."""
        if self.offset > MAX_PACK_OFFSET:
            return f"its index entry is damaged: offset {self.offset} lies past any pack"
        longest = max(self.stored_len, self.plain_len)
        if longest > MAX_STORED_LEN:
            return f"its index entry is damaged: a length of {longest} bytes, more than any chunk"
        if self.codec not in CODECS:
            return f"its index entry is damaged: unknown codec {self.codec}"
        return None


# In cas_meta: moved by every GC transaction that changes what holds what (a flattened delta
# no longer holds its base; a sweep), for readers that keep counts derived from the records
# (keeper.holdings).
GC_GENERATION = b"gc_generation"
# In cas_meta: the lowest number a new pack may take, moved past every pack a commit lists.
NEXT_PACK = b"next_pack"
# In cas_meta: how many ingests committed (a seal looks its chunks up again only when it moved).
INGEST_COMMITS = b"ingest_commits"
# An index value and a pack's key hold a pack number in 32 bits (INDEX_VALUE, pack_key).
MAX_PACK_NO = (1 << 32) - 1


def gc_generation(txn: Any, meta_db: Any) -> int:
    return meta_int(txn.get(GC_GENERATION, b"0", db=meta_db), "gc_generation")


def meta_int(raw: bytes | None, name: str, default: int = 0) -> int:
    """A count kept in cas_meta as decimal text; IntegrityError (exit 6) when it is not one."""
    if raw is None:
        return default
    try:
        return int(bytes(raw))
    except ValueError:
        raise IntegrityError(f"the index's {name} entry is damaged: {bytes(raw)[:40]!r} is no "
                             "number") from None


def decode_pack_value(key: bytes, raw: bytes) -> tuple[int, int]:
    """(committed size, live bytes) of the pack whose entry this is; IntegrityError (exit 6)
    when the value does not decode."""
    if len(raw) != PACK_VALUE.size:
        raise IntegrityError(f"the index entry of pack {int.from_bytes(key, 'big')} is damaged: "
                             f"it no longer decodes ({len(raw)} bytes, not {PACK_VALUE.size})")
    return PACK_VALUE.unpack(raw)


def next_pack(txn: Any, meta_db: Any) -> int:
    """The lowest number a new pack may take (new packs are also numbered past every pack
    listed or on disk). IntegrityError (exit 6) for a value that is no number, or past the
    last number a pack can have: a pack numbered so cannot be indexed (it was a struct.error
    traceback at commit). One below 1 is read as 1: no pack is numbered 0 or less."""
    no = meta_int(txn.get(NEXT_PACK, db=meta_db), "next_pack", 1)
    if no > MAX_PACK_NO:
        raise IntegrityError(f"the index's next_pack entry is damaged: {str(no)[:40]} is past "
                             f"the last pack number ({MAX_PACK_NO})")
    return max(no, 1)


def bump_gc_generation(txn: Any, meta_db: Any) -> None:
    txn.put(GC_GENERATION, str(gc_generation(txn, meta_db) + 1).encode(), db=meta_db)


def pack_key(no: int) -> bytes:
    return struct.pack(">I", no)  # big-endian so LMDB iterates packs in number order


def pack_name(no: int) -> str:
    return f"{no:08d}.pack"


def pack_number(name: str) -> int | None:
    """The number of the pack whose file is named ``name``, or None when no pack has that
    name: only ``pack_name``'s own spelling counts. "1.pack" beside "00000001.pack" is no second
    file of pack 1 (check took its size for pack 1's), and "².pack" passes ``str.isdigit`` but
    not ``int`` (it was a ValueError traceback from check and gc)."""
    stem = name[:-5] if name.endswith(".pack") else ""
    if not (stem.isascii() and stem.isdigit()):
        return None
    no = int(stem)
    return no if no <= MAX_PACK_NO and pack_name(no) == name else None


Entry = tuple[bytes | None, int]  # (chunk id, or None for a hole; plain length)


class ManifestBuilder:
    """A manifest's entries encoded as they come (40 bytes each, adjacent holes merged, empty
    entries dropped: ``normalize``'s canonical form), for an ingest of a large file: a list of
    (id, length) tuples held ~150 bytes an entry until the file's end."""

    def __init__(self) -> None:
        self._body = bytearray()
        self._count = 0
        self._hole = 0  # length of a run of holes not yet written
        self.size = 0

    def add(self, cid: bytes | None, length: int) -> None:
        if length <= 0:
            return
        self.size += length
        if cid is None:
            self._hole += length
            return
        self._flush_hole()
        self._body += MANIFEST_ENTRY.pack(length, cid)
        self._count += 1

    def _flush_hole(self) -> None:
        if self._hole:
            self._body += MANIFEST_ENTRY.pack(self._hole | HOLE_BIT, NO_ID)
            self._count += 1
            self._hole = 0

    def encode(self, chunking: str) -> bytes:
        self._flush_hole()
        head = MANIFEST_HEADER.pack(MANIFEST_MAGIC, CHUNKINGS[chunking], self.size, self._count)
        return head + bytes(self._body)


def normalize(entries: list[Entry]) -> list[Entry]:
    """Merge adjacent holes and drop empty entries, the one canonical form of a manifest."""
    out: list[Entry] = []
    for cid, length in entries:
        if length <= 0:
            continue
        if cid is None and out and out[-1][0] is None:
            out[-1] = (None, out[-1][1] + length)
        else:
            out.append((cid, length))
    return out


def encode_manifest(entries: list[Entry], chunking: str) -> bytes:
    entries = normalize(entries)
    size = sum(length for _, length in entries)
    parts = [MANIFEST_HEADER.pack(MANIFEST_MAGIC, CHUNKINGS[chunking], size, len(entries))]
    pack = MANIFEST_ENTRY.pack
    for cid, length in entries:
        parts.append(pack(length | HOLE_BIT, NO_ID) if cid is None else pack(length, cid))
    return b"".join(parts)


def manifest_id(raw: bytes) -> bytes:
    return blake3.blake3(raw).digest()


def manifest_base(value: bytes) -> bytes | None:
    """The id of the manifest a stored manifest value is a delta on; None for a plain one (or
    one too short to say, which decoding then calls damaged)."""
    if len(value) < MANIFEST_DELTA_HEADER.size or value[:4] != MANIFEST_DELTA_MAGIC:
        return None
    return bytes(value[4:36])


def content_digest(raw_manifest: bytes) -> str:
    """The file digest ksfs records: BLAKE3 (derive-key mode) over the manifest's entries.

    It is fixed by the file's bytes and its chunking, costs nothing on an incremental ingest,
    and is not the b3sum of the file.
    """
    h = blake3.blake3(derive_key_context="ksfs 2026 file content digest v1")
    h.update(raw_manifest[MANIFEST_HEADER.size :])
    return h.hexdigest()


class ManifestEntries(Sequence[Entry]):
    """A manifest's entries read in place from its encoded bytes (40 per entry), as
    (chunk id or None, length) tuples made when asked for. A list of tuples costs ~190 bytes an
    entry: a reader of a 64 GiB memory image would hold over a GiB for it (QA, tenth session)."""

    __slots__ = ("_raw", "_n")

    def __init__(self, raw: bytes, count: int) -> None:
        self._raw = raw
        self._n = count

    def __len__(self) -> int:
        return self._n

    def _at(self, i: int) -> Entry:
        length, cid = MANIFEST_ENTRY.unpack_from(self._raw,
                                                 MANIFEST_HEADER.size + i * MANIFEST_ENTRY.size)
        return (None, length & ~HOLE_BIT) if length & HOLE_BIT else (cid, length)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("manifest entry index out of range")
        return self._at(i)

    def __iter__(self) -> Iterator[Entry]:
        for length, cid in MANIFEST_ENTRY.iter_unpack(memoryview(self._raw)[MANIFEST_HEADER.size:]):
            yield (None, length & ~HOLE_BIT) if length & HOLE_BIT else (cid, length)

    def lengths(self) -> Iterator[int]:
        for length, _ in MANIFEST_ENTRY.iter_unpack(memoryview(self._raw)[MANIFEST_HEADER.size:]):
            yield length & ~HOLE_BIT

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ManifestEntries):
            return self._raw[MANIFEST_HEADER.size:] == other._raw[MANIFEST_HEADER.size:]
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ManifestEntries({self._n} entries)"


@dataclass(frozen=True)
class ManifestInfo:
    chunking: str
    size: int
    entries: ManifestEntries


def decode_manifest(raw: bytes, name: str = "?") -> ManifestInfo:
    if len(raw) < MANIFEST_HEADER.size:
        raise ManifestCorrupt(manifest=name, why="shorter than its header")
    magic, chunking, size, count = MANIFEST_HEADER.unpack_from(raw)
    if magic != MANIFEST_MAGIC or chunking not in CHUNKING_NAMES:
        raise ManifestCorrupt(manifest=name, why="bad header")
    if len(raw) != MANIFEST_HEADER.size + count * MANIFEST_ENTRY.size:
        raise ManifestCorrupt(manifest=name, why="length does not match its entry count")
    entries = ManifestEntries(bytes(raw), count)
    if sum(entries.lengths()) != size:
        raise ManifestCorrupt(manifest=name, why="entry lengths do not add up to its size")
    return ManifestInfo(CHUNKING_NAMES[chunking], size, entries)
