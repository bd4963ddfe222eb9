"""Delta chunks: a new version of a chunk compressed against the old version as zstd dictionary.

A memory image saved again differs from the last one in a few pages per 128 KiB group, and a disk
cluster rewritten by the guest often in a few 4 KiB blocks; stored alone, each such chunk costs
its whole compressed size again. Compressed with the previous version's plain bytes as a raw
zstd dictionary, the unchanged pages become back-references costing a few bytes.

The previous version is found through a reference manifest (the same file in the checkpoint
before): for fixed chunking the chunk at the same offset; for content-defined or page-cut files
the chunk as many bytes from the nearest unchanged chunk (an "anchor", found in the reference by
id) in the old file as the new chunk is in the new one, since both hold their pieces in order.
Bases are always plain chunks (if the old version is itself a delta, its bases are used), so a
read never follows more than one hop, and a delta is kept only when it saves a tenth of the bytes.

A delta may have several bases (codec 3, up to format.MAX_BASES), their plain bytes one after
another as the dictionary: besides its old version, the chunks that hold its other 4 KiB pages
(``Ingest._homes_of``), new in the same ingest or read as another chunk's old version. The same
bytes are often in two places of one machine at once: a file's page cache and the buffer it was
written from, a disk block and the page cache that wrote it back.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import zstandard

from ksfs.cas import format as fmt
from ksfs.errors import ChunkCorrupt, ManifestCorrupt

KEEP_RATIO = 0.9  # a delta must be under this share of the chunk stored alone to be worth a hop
# A compressor is made per delta (each has its own bases), so its tables must be cheap to set
# up: zstd's "dfast" strategy (level 3's) with small tables. On the 499 deltas of one import of
# a tools/bench-store --guest corpus this gave 0.6% fewer bytes than the "fast" settings kept
# before (window 17, hash 12, chain 12, min match 6), in half their time (docs/performance.md,
# twenty-ninth session). The window holds a 64 KiB base and chunk.
_MIN_MATCH = 5
_CHAIN_LOG = 14
_PREFIX_MIN = 8  # the shortest dictionary content zstd's ZstdDict takes
_HASH_LOG_MAX = 24  # a 64 MiB table, for the largest manifest bases (MANIFEST_DELTA_MAX)


def _dict(base: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def _zstd() -> Any:
    """compression.zstd (Python 3.14's standard library), or its backport (backports.zstd)."""
    global _ZSTD
    if _ZSTD is None:
        try:
            from compression import zstd  # type: ignore[import-not-found]
        except ImportError:
            from backports import zstd  # type: ignore[no-redef]
        _ZSTD = zstd
    return _ZSTD


_ZSTD: Any = None
_OPTIONS: dict[tuple[int, int], dict[Any, int]] = {}


def _options(dict_len: int, data_len: int) -> dict[Any, int]:
    """Compression parameters with a window and hash table as wide as the bases ask. zstd
    hashes only the last 2 ** (hash_log + 3) bytes of a prefix into its tables
    (ZSTD_loadDictionaryContent): a table sized to less would leave a 64 KiB disk cluster's
    first half, or every base of several but the last, out of reach; two steps more halve
    and quarter the collisions, which found 0.9% fewer bytes. Nor is a match further back
    than the window found."""
    window_log = max(17, (dict_len + data_len - 1).bit_length())
    hash_log = min(max(12, (dict_len - 1).bit_length() - 3) + 2, _HASH_LOG_MAX)
    key = (window_log, hash_log)
    if key not in _OPTIONS:
        zstd = _zstd()
        param = zstd.CompressionParameter
        _OPTIONS[key] = {
            param.window_log: window_log, param.hash_log: hash_log,
            param.chain_log: _CHAIN_LOG, param.search_log: 1, param.min_match: _MIN_MATCH,
            param.strategy: zstd.Strategy.dfast}
    return _OPTIONS[key]


def compress(data: bytes, base: bytes) -> bytes:
    """A zstd frame of data with ``base`` (one base's plain bytes, or several one after
    another) as its dictionary.

    The bases go in as a prefix (ZSTD_CCtx_refPrefix), which zstd hashes straight into the
    compressor's own tables; python-zstandard offers only a dictionary, and zstd first builds
    a digested dictionary from it (every position hashed, tables allocated) and copies that
    in: three times the time, with the same parameters, on the deltas of one import
    (docs/performance.md, twenty-ninth session). A frame made on a prefix decodes with the
    same bytes as a raw-content dictionary, which ``decompress`` gives it.
    """
    zstd = _zstd()
    if len(base) < _PREFIX_MIN:
        # zstd takes no prefix this short (a disk image of a few bytes grown by one: QA,
        # thirtieth session), and it could save nothing: a plain frame, which decodes the same
        return zstd.compress(data, options=_options(len(base), len(data)))
    prefix = zstd.ZstdDict(base, is_raw=True).as_prefix
    return zstd.ZstdCompressor(options=_options(len(base), len(data)),
                               zstd_dict=prefix).compress(data, zstd.ZstdCompressor.FLUSH_FRAME)


def decompress(cid: bytes, frame: bytes | memoryview, base: bytes, plain_len: int) -> bytes:
    try:
        return zstandard.ZstdDecompressor(dict_data=_dict(base)).decompress(
            frame, max_output_size=plain_len)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(chunk=cid.hex(), why=f"zstd cannot decode the delta: {exc}") from None


def worth_it(stored_len: int, alone_len: int) -> bool:
    """A delta (``stored_len`` with its base id) beats the chunk stored alone by enough."""
    return stored_len < alone_len * KEEP_RATIO


class Reference:
    """The chunk ids of an earlier version of a file, to find each new chunk's old version.

    ``by_offset`` (fixed chunking): the old version is the chunk at the same offset, found in
    the manifest's entries by bisection (a hole run is one entry, however long): a file's
    manifest costs its entries here, not one slot per 64 KiB of its size. Otherwise the old
    version is the old chunk at the same distance from the nearest anchor (a chunk both
    versions hold, found by id) in bytes, not in entries: a run of zero chunks is one hole
    entry in the old manifest but many chunks in the new file.
    """

    def __init__(self, entries: Sequence[fmt.Entry], by_offset: bool = False) -> None:
        self.by_offset = by_offset
        self.ids = [cid for cid, _ in entries]
        self.starts: list[int] = []
        self.size = 0
        self.offset_of: dict[bytes, int] = {}  # anchor id -> old offset, ids seen once only
        pos = 0
        seen_twice: set[bytes] = set()
        for cid, length in entries:
            self.starts.append(pos)
            if by_offset:
                pos += length
                continue
            if cid is not None:
                if cid in self.offset_of:
                    seen_twice.add(cid)
                self.offset_of[cid] = pos
            pos += length
        self.size = pos
        for cid in seen_twice:  # an id in two places says nothing about where a chunk was
            del self.offset_of[cid]

    def candidates(self, offsets: Sequence[int], ids: Sequence[bytes | None]
                   ) -> list[bytes | None]:
        """For a run of consecutive chunks of the new file, the old version of each (or None).

        ``offsets`` and ``ids`` are the run's chunks in file order (None for a hole).
        """
        if self.by_offset:
            return [self._covering(off) for off in offsets]
        n = len(ids)
        anchor = [None if cid is None else self.offset_of.get(cid) for cid in ids]
        before: list[int | None] = [None] * n  # position of the nearest anchor at or before k
        last = None
        for k in range(n):
            if anchor[k] is not None:
                last = k
            before[k] = last
        out: list[bytes | None] = [None] * n
        after = None
        for k in range(n - 1, -1, -1):
            if anchor[k] is not None:
                after = k
                continue
            b = before[k]
            if b is not None and (after is None or
                                  offsets[k] - offsets[b] <= offsets[after] - offsets[k]):
                out[k] = self._covering(anchor[b] + offsets[k] - offsets[b])
            elif after is not None:
                # Measured back from the anchor after it, what lines up is the chunk's end, not
                # its start: a chunk that grew (zero pages that took data) would otherwise start
                # inside the old chunk before its own and find none of its pages there.
                out[k] = self._covering(anchor[after] - (offsets[after] - offsets[k + 1]) - 1)
        return out

    def _covering(self, old_offset: int) -> bytes | None:
        """The id of the old chunk holding byte old_offset (None: a hole, or outside)."""
        if old_offset < 0 or old_offset >= self.size:
            return None
        return self.ids[bisect.bisect_right(self.starts, old_offset) - 1]


# A manifest saved again names mostly the chunks the one before named, in the same order: stored
# as a delta on an earlier plain manifest it takes a tenth to a fifth of its 40 bytes an entry
# (the memory manifests of tools/bench-store --guest: 665 KB in 136 KB). One hop here too: the
# base is always plain. Base and manifest together stay within zstd's default window limit
# (128 MiB, some 3 million entries), so any reader decodes them; larger ones are kept plain.
MANIFEST_KEEP_RATIO = 0.5
MANIFEST_DELTA_MAX = 1 << 27


def manifest_delta(raw: bytes, base_id: bytes, base_raw: bytes) -> bytes | None:
    """The stored value of manifest ``raw`` as a delta on the plain manifest ``base_raw``, or
    None where that does not save enough to be worth a hop."""
    if len(raw) + len(base_raw) > MANIFEST_DELTA_MAX:
        return None
    value = fmt.MANIFEST_DELTA_HEADER.pack(fmt.MANIFEST_DELTA_MAGIC, base_id, len(raw)) + \
        compress(raw, base_raw)
    return value if len(value) < len(raw) * MANIFEST_KEEP_RATIO else None


def expand_manifest(mid: bytes, value: bytes, base_of: Callable[[bytes], bytes | None]
                    ) -> bytes:
    """The plain bytes of manifest ``mid`` from its stored value (the value itself when it is
    plain), checked against its id; ``base_of`` gives a base's stored value, or None.
    ManifestCorrupt where they do not hash to the id, or naming the base where that is missing,
    damaged or itself a delta."""
    name = mid.hex()
    base_id = fmt.manifest_base(value)
    if base_id is None:
        if fmt.manifest_id(value) != mid:
            raise ManifestCorrupt(manifest=name, why="its bytes do not hash to its id")
        return value
    _, _, plain_len = fmt.MANIFEST_DELTA_HEADER.unpack_from(value)
    if plain_len > MANIFEST_DELTA_MAX:
        raise ManifestCorrupt(manifest=name, why=f"its delta claims {plain_len} plain bytes, "
                              "more than any delta holds")
    base = base_of(base_id)
    why = None
    if base is None:
        why = "is not in the store"
    elif fmt.manifest_base(base) is not None:
        why = "is itself a delta"
    elif fmt.manifest_id(base) != base_id:
        why = "is damaged: its bytes do not hash to its id"
    if why is not None:
        raise ManifestCorrupt(manifest=name, why=f"the manifest it is a delta on, "
                              f"{base_id.hex()}, {why}")
    try:
        plain = zstandard.ZstdDecompressor(dict_data=_dict(bytes(base))).decompress(
            value[fmt.MANIFEST_DELTA_HEADER.size:], max_output_size=plain_len)
    except zstandard.ZstdError as exc:
        raise ManifestCorrupt(manifest=name, why=f"zstd cannot decode its delta: {exc}") from None
    if len(plain) != plain_len:
        raise ManifestCorrupt(manifest=name, why=f"its delta gives {len(plain)} bytes, not "
                              f"{plain_len}")
    if fmt.manifest_id(plain) != mid:
        raise ManifestCorrupt(manifest=name, why="its bytes do not hash to its id")
    return plain
