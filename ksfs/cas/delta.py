"""Delta chunks: a new version of a chunk compressed against the old version as zstd dictionary.

A memory image saved again differs from the last one in a few pages per 32 KiB group, and a disk
cluster rewritten by the guest often in a few 4 KiB blocks; stored alone, each such chunk costs
its whole compressed size again. Compressed with the previous version's plain bytes as a raw
zstd dictionary, the unchanged pages become back-references costing a few bytes.

The previous version is found through a reference manifest (the same file in the checkpoint
before): for fixed chunking the chunk at the same offset; for content-defined or page-cut files
the chunk as far from the nearest unchanged chunk (an "anchor", found in the reference by id) in
the old file as the new chunk is in the new one, since both list their pieces in the same order.
Bases are always plain chunks (if the old version is itself a delta, its base is used), so a
read never follows more than one hop, and a delta is kept only when it saves a tenth of the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import zstandard

from ksfs.cas import format as fmt
from ksfs.errors import ChunkCorrupt

KEEP_RATIO = 0.9  # a delta must be under this share of the chunk stored alone to be worth a hop
# A compressor is made per delta (each has its own dictionary), and level 3's tables take longer
# to set up than a 32 KiB chunk takes to compress. These small ones (zstd's "fast" strategy, 4K
# hash entries) halve a delta's time for 0.6% more bytes than level 3 (measured on the 3,774
# deltas of a tools/bench-store --guest corpus). The window holds a 64 KiB base and chunk.
_PARAMS = zstandard.ZstdCompressionParameters(window_log=17, hash_log=12, chain_log=12,
                                              search_log=1, min_match=6,
                                              strategy=zstandard.STRATEGY_FAST)


def _dict(base: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def compress(data: bytes, base: bytes) -> bytes:
    cctx = zstandard.ZstdCompressor(compression_params=_PARAMS, dict_data=_dict(base))
    return cctx.compress(data)


def decompress(cid: bytes, frame: bytes | memoryview, base: bytes, plain_len: int) -> bytes:
    try:
        return zstandard.ZstdDecompressor(dict_data=_dict(base)).decompress(
            frame, max_output_size=plain_len)
    except zstandard.ZstdError as exc:
        raise ChunkCorrupt(chunk=cid.hex(), why=f"zstd cannot decode the delta: {exc}") from None


def worth_it(stored_len: int, alone_len: int) -> bool:
    """A delta (``stored_len`` with its base id) beats the chunk stored alone by enough."""
    return stored_len < alone_len * KEEP_RATIO


def clearly_small(stored_len: int, plain_len: int) -> bool:
    """A delta this small wins without compressing the chunk alone to compare (saves the time):
    zstd alone rarely gets a memory or disk chunk under a quarter of its size."""
    return stored_len * 4 < plain_len


class Reference:
    """The chunk ids of an earlier version of a file, to find each new chunk's old version."""

    def __init__(self, entries: Sequence[fmt.Entry], fixed: bool) -> None:
        self.fixed = fixed
        self.ids = [cid for cid, _ in entries]
        self.index: dict[bytes, int] = {}
        for k, cid in enumerate(self.ids):
            if cid is not None:
                self.index.setdefault(cid, k)

    def candidates(self, offsets: Sequence[int], ids: Sequence[bytes | None],
                   fixed_size: int) -> list[bytes | None]:
        """For a run of consecutive chunks of the new file, the old version of each (or None).

        ``offsets`` and ``ids`` are the run's chunks in file order (None for a hole).
        """
        n = len(ids)
        if self.fixed:  # the reference's ids are one per fixed-size slot
            out = []
            for off in offsets:
                k = off // fixed_size
                out.append(self.ids[k] if k < len(self.ids) else None)
            return out
        old_at = [None if cid is None else self.index.get(cid) for cid in ids]
        out = [None] * n
        last = None  # (position in the run, index in the reference) of the nearest anchor before
        for k in range(n):
            if old_at[k] is not None:
                last = (k, old_at[k])
            elif last is not None:
                out[k] = self._at(last[1] + k - last[0])
        nxt = None  # chunks before the run's first anchor map back from the anchor after them
        for k in range(n - 1, -1, -1):
            if old_at[k] is not None:
                nxt = (k, old_at[k])
            elif out[k] is None and nxt is not None:
                out[k] = self._at(nxt[1] - (nxt[0] - k))
        return out

    def _at(self, k: int) -> bytes | None:
        return self.ids[k] if 0 <= k < len(self.ids) else None
