"""Name lookup in an indexed (htree) ext directory, as the kernel's ``ext4_dx_find_entry``.

A directory with the INDEX flag on a filesystem with ``dir_index`` keeps a tree of (hash, block)
entries in its blocks: the name's hash picks the one leaf block that holds it (or a few, when
hashes collide across blocks), so a lookup in a directory of 150,000 names reads 2-4 blocks
instead of all of them (QA, nineteenth session: the first lookup there read ~40 MB and took
16 s). The hashes are ports of ``fs/ext4/hash.c``: legacy, half-MD4 and TEA, each signed or
unsigned as the superblock's flag says. What this cannot follow (an unknown hash version,
SipHash of casefolded or encrypted names, an index that fails its own checks) raises
``BadIndex``: the caller then scans the directory as before, as the kernel falls back on
``ERR_BAD_DX_DIR``. A name the tree does not lead to is absent, as it is for the kernel.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

M32 = 0xFFFFFFFF
DEFAULT_SEED = (0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476)
LEGACY, HALF_MD4, TEA = 0, 1, 2
UNSIGNED = 3  # added to the three above when the superblock says chars are unsigned
EOF_32BIT = 0x7FFFFFFF


class BadIndex(Exception):
    """The index cannot be followed: scan the directory instead."""


def _rol(x: int, s: int) -> int:
    return ((x << s) | (x >> (32 - s))) & M32


def _str2hashbuf(msg: bytes, num: int, signed: bool) -> list[int]:
    n = len(msg)
    pad = (n | (n << 8)) & M32
    pad = (pad | (pad << 16)) & M32
    out: list[int] = []
    val = pad
    msg = msg[: num * 4]
    for i, c in enumerate(msg):
        if signed and c >= 0x80:
            c -= 0x100
        val = (c + (val << 8)) & M32
        if i % 4 == 3:
            out.append(val)
            val = pad
    if len(out) < num:
        out.append(val)
    out.extend([pad] * (num - len(out)))
    return out


def _half_md4(buf: list[int], x: list[int]) -> None:
    a, b, c, d = buf

    def f(x_: int, y: int, z: int) -> int:
        return z ^ (x_ & (y ^ z))

    def g(x_: int, y: int, z: int) -> int:
        return ((x_ & y) + ((x_ ^ y) & z)) & M32

    def h(x_: int, y: int, z: int) -> int:
        return x_ ^ y ^ z

    k2, k3 = 0o13240474631, 0o15666365641
    for fn, k, order, shifts in ((f, 0, (0, 1, 2, 3, 4, 5, 6, 7), (3, 7, 11, 19)),
                                 (g, k2, (1, 3, 5, 7, 0, 2, 4, 6), (3, 5, 9, 13)),
                                 (h, k3, (3, 7, 2, 6, 1, 5, 0, 4), (3, 9, 11, 15))):
        for j, idx in enumerate(order):
            s = shifts[j % 4]
            xi = (x[idx] + k) & M32
            if j % 4 == 0:
                a = _rol((a + fn(b, c, d) + xi) & M32, s)
            elif j % 4 == 1:
                d = _rol((d + fn(a, b, c) + xi) & M32, s)
            elif j % 4 == 2:
                c = _rol((c + fn(d, a, b) + xi) & M32, s)
            else:
                b = _rol((b + fn(c, d, a) + xi) & M32, s)
    buf[0], buf[1] = (buf[0] + a) & M32, (buf[1] + b) & M32
    buf[2], buf[3] = (buf[2] + c) & M32, (buf[3] + d) & M32


def _tea(buf: list[int], x: list[int]) -> None:
    total, b0, b1 = 0, buf[0], buf[1]
    a, b, c, d = x
    for _ in range(16):
        total = (total + 0x9E3779B9) & M32
        b0 = (b0 + ((((b1 << 4) + a) & M32) ^ ((b1 + total) & M32) ^ (((b1 >> 5) + b) & M32))
              ) & M32
        b1 = (b1 + ((((b0 << 4) + c) & M32) ^ ((b0 + total) & M32) ^ (((b0 >> 5) + d) & M32))
              ) & M32
    buf[0], buf[1] = (buf[0] + b0) & M32, (buf[1] + b1) & M32


def _legacy(name: bytes, signed: bool) -> int:
    h0, h1 = 0x12A3FE2D, 0x37ABE8F9
    for c in name:
        if signed and c >= 0x80:
            c -= 0x100
        h = (h1 + (h0 ^ ((c * 7152373) & M32))) & M32
        if h & 0x80000000:
            h = (h - 0x7FFFFFFF) & M32
        h1, h0 = h0, h
    return (h0 << 1) & M32


def dirhash(name: bytes, version: int, seed: tuple[int, ...] | None) -> int | None:
    """The major hash ext4 files ``name`` under (low bit clear), or None for a version this
    does not compute (SipHash, unknown)."""
    pair = dirhash_pair(name, version, seed)
    return None if pair is None else pair[0]


def dirhash_pair(name: bytes, version: int, seed: tuple[int, ...] | None
                 ) -> tuple[int, int] | None:
    """(hash, minor hash) as the kernel's ``ext4fs_dirhash`` gives them (the minor hash is 0
    for the legacy hash), or None for a version this does not compute."""
    signed = version < UNSIGNED
    base = version - (0 if signed else UNSIGNED)
    buf = list(seed) if seed and any(seed) else list(DEFAULT_SEED)
    minor = 0
    if base == LEGACY:
        h = _legacy(name, signed)
    elif base == HALF_MD4:
        for p in range(0, max(len(name), 1), 32):
            _half_md4(buf, _str2hashbuf(name[p:], 8, signed))
        h, minor = buf[1], buf[2]
    elif base == TEA:
        for p in range(0, max(len(name), 1), 16):
            _tea(buf, _str2hashbuf(name[p:], 4, signed))
        h, minor = buf[0], buf[1]
    else:
        return None
    h &= ~1 & M32
    if h == EOF_32BIT << 1:
        h = (EOF_32BIT - 1) << 1
    return h, minor


def root_hash_version(root: bytes, levels_max: int) -> int | None:
    """The hash version the index root (block 0 of an indexed directory) names, signed as
    stored, or None when the root fails the checks ``leaf_blocks`` makes of it."""
    if len(root) < 40:
        return None
    _, version, info_len, levels, flags = struct.unpack_from("<IBBBB", root, 24)
    if flags & 1 or levels >= levels_max or info_len != 8:
        return None
    return version


def leaf_blocks(read_block: Callable[[int], bytes], block_size: int, name: bytes,
                unsigned: bool, seed: tuple[int, ...], levels_max: int, csum: bool
                ) -> Iterator[int]:
    """The logical blocks of the directory that may hold ``name``, in the kernel's order (the
    leaf its hash leads to, then the next ones while their first hash continues it).
    ``read_block(lblk)`` gives a directory block, its checksum verified. BadIndex (raised as
    it is iterated) when the index cannot be followed."""
    root = read_block(0)
    if len(root) < 40:
        raise BadIndex("short root block")
    _, version, info_len, levels, flags = struct.unpack_from("<IBBBB", root, 24)
    if flags & 1 or levels >= levels_max or info_len != 8:
        raise BadIndex(f"root info: flags {flags}, {levels} levels, length {info_len}")
    if version < UNSIGNED and unsigned:
        version += UNSIGNED
    target = dirhash(name, version, seed)
    if target is None:
        raise BadIndex(f"hash version {version}")
    tail = 8 if csum else 0
    root_limit = (block_size - 24 - info_len - tail) // 8
    node_limit = (block_size - 8 - tail) // 8
    # the path: one (entries block, its offset, count, index chosen) per level
    path: list[tuple[bytes, int, int, int]] = []
    raw, off, limit = root, 24 + info_len, root_limit
    for depth in range(levels + 1):
        entry = _pick(raw, off, limit, target)
        path.append((raw, off, entry[0], entry[1]))
        if depth < levels:
            raw, off, limit = read_block(_block(raw, off, entry[1])), 8, node_limit
    return _walk(read_block, path, target, levels, node_limit)


def _pick(raw: bytes, off: int, limit: int, target: int) -> tuple[int, int]:
    """(count, index of the last entry whose hash <= target) of the entries at ``off``."""
    got_limit, count = struct.unpack_from("<HH", raw, off) if off + 4 <= len(raw) else (0, 0)
    if got_limit != limit or not 0 < count <= limit or off + count * 8 > len(raw):
        raise BadIndex(f"entries: limit {got_limit} (want {limit}), count {count}")
    lo, hi = 1, count - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if struct.unpack_from("<I", raw, off + mid * 8)[0] > target:
            hi = mid - 1
        else:
            lo = mid + 1
    return count, lo - 1


def _block(raw: bytes, off: int, i: int) -> int:
    return struct.unpack_from("<I", raw, off + i * 8 + 4)[0] & 0x0FFFFFFF


def _hash(raw: bytes, off: int, i: int) -> int:
    return struct.unpack_from("<I", raw, off + i * 8)[0]


def _walk(read_block: Callable[[int], bytes], path: list[tuple[bytes, int, int, int]],
          target: int, levels: int, node_limit: int) -> Iterator[int]:
    while True:
        raw, off, _, i = path[-1]
        yield _block(raw, off, i)
        # ext4_htree_next_block: the next entry at the deepest level that has one
        depth = len(path) - 1
        while depth >= 0 and path[depth][3] + 1 >= path[depth][2]:
            depth -= 1
        if depth < 0:
            return
        raw, off, count, i = path[depth]
        if _hash(raw, off, i + 1) & ~1 & M32 != target:
            return  # the next block starts another hash: the name is not further on
        path[depth:] = [(raw, off, count, i + 1)]
        while len(path) <= levels:
            raw, off, _, i = path[-1]
            node = read_block(_block(raw, off, i))
            path.append((node, 8, _pick(node, 8, node_limit, 0)[0], 0))
