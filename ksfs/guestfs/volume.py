"""One ext2/3/4 filesystem inside a reader: blocks, group descriptors, inodes and the mapping of
a file's logical blocks to disk blocks (extent trees and the old indirect block maps).

Blocks the journal still holds are read from the journal (an ``overlay`` computed by
ksfs.guestfs.journal), as the kernel would see them after recovery. Every physical block number
is checked against the filesystem's size before it is read; anything out of place raises
GuestFSUnreadable. This module never writes and never returns bytes it could not account for.
"""

from __future__ import annotations

import bisect
import itertools
import struct

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs import layout
from ksfs.guestfs.image import Reader, read_exact
from ksfs.guestfs.journal import JournalCopy
from ksfs.guestfs.layout import Inode, Superblock
from ksfs.lru import LRU

# A run of a file: (first logical block, block count, first physical block or None for a hole)
Run = tuple[int, int, int | None]

# Raw inode-table bytes kept for every open volume together, by weight: listing a directory
# stats each entry, and its entries' inodes lie at random places in the tables (an htree
# leaf holds names by hash). Read one inode at a time through a store reader, whose 8 MiB of
# chunks a 150,000-entry directory's 38 MB of inodes overran, nearly every entry decoded and
# verified a 64 KiB chunk again (116,764 chunk loads and 6.0 s for its listing with stats;
# 1,147 and 1.7 s with this). So the tables are read INODE_TABLE_READ bytes at a time and
# those pieces kept here, for all volumes at once so that the filesystems a mount keeps open
# (FS_KEPT) share one bound.
INODE_TABLE_CACHE = 64 << 20
INODE_TABLE_READ = 64 << 10  # the store's disk chunk: one decode fills one piece
EXTENTS_KEPT = 131_072  # extents of the mapped files (~100 bytes each), per volume
POINTERS_KEPT = 262_144  # block numbers of the cached indirect blocks (tuples), per volume
_tables = LRU(INODE_TABLE_CACHE, weight=len)  # (volume token, first block) -> bytes
_tokens = itertools.count()


class Volume:
    """Block-level access to one filesystem. Invariant: ``sb`` describes the filesystem as seen
    through ``overlay`` (the superblock is re-read once the journal has been replayed)."""

    def __init__(self, reader: Reader, offset: int, length: int, sb: Superblock) -> None:
        self.reader = reader
        self.offset = offset
        self.length = length
        self.sb = sb
        self.bs = sb.block_size
        # fs block -> its newest committed copy in the journal (ksfs.guestfs.journal)
        self.overlay: dict[int, JournalCopy] = {}
        self._overlay_keys: list[int] = []
        self._inodes = LRU(4096)
        self._descs = LRU(1024)
        # bounded by what they hold, not by count: one fragmented file's extents, or one
        # 64 KiB block's 16,384 pointers, may be large
        self._maps = LRU(EXTENTS_KEPT, weight=lambda m: len(m[0]) + 1)
        self._indirect = LRU(POINTERS_KEPT, weight=len)
        # directory blocks (by fs block) whose metadata_csum was verified: a listing then a
        # lookup read the same blocks, and the check is then a dict hit
        self._dir_ok = LRU(4096)
        self._token = next(_tokens)  # this volume's pieces in _tables (new with an overlay)

    def set_overlay(self, overlay: dict[int, JournalCopy], sb: Superblock) -> None:
        self.overlay = overlay
        self._overlay_keys = sorted(overlay)
        self.sb = sb
        self.bs = sb.block_size
        for cache in (self._inodes, self._descs, self._maps, self._indirect, self._dir_ok):
            cache.clear()
        self._token = next(_tokens)  # the pieces read before are left to age out of _tables

    # --- blocks ------------------------------------------------------------------------------

    def read_blocks(self, block: int, count: int, what: str) -> bytes:
        """``count`` whole blocks from ``block`` on, journal copies taking precedence."""
        if block < 0 or count < 0 or block + count > self.sb.blocks_count:
            raise GuestFSUnreadable(
                why=f"{what} points at block {block}+{count}, outside the "
                f"{self.sb.blocks_count}-block filesystem"
            )
        i = bisect.bisect_left(self._overlay_keys, block)
        if i == len(self._overlay_keys) or self._overlay_keys[i] >= block + count:
            return read_exact(self.reader, self.offset + block * self.bs, count * self.bs, what)
        parts = []
        for b in range(block, block + count):
            copy = self.overlay.get(b)
            if copy is not None:
                data = read_exact(self.reader, self.offset + copy.block * self.bs, self.bs, what)
                parts.append(copy.restore(data))
            else:
                parts.append(read_exact(self.reader, self.offset + b * self.bs, self.bs, what))
        return b"".join(parts)

    def read_within(self, block: int, start: int, n: int, what: str) -> bytes:
        """``n`` bytes at ``start`` inside one block (an inode, a descriptor), not the block."""
        if block in self.overlay or not 0 <= block < self.sb.blocks_count:
            return self.read_blocks(block, 1, what)[start : start + n]
        return read_exact(self.reader, self.offset + block * self.bs + start, n, what)

    def overlaps_overlay(self, block: int, count: int) -> bool:
        i = bisect.bisect_left(self._overlay_keys, block)
        return i < len(self._overlay_keys) and self._overlay_keys[i] < block + count

    # --- inodes ------------------------------------------------------------------------------

    def _inode_table(self, group: int) -> int:
        table = self._descs.get(group)
        if table is not None:
            return table
        sb = self.sb
        per_block = self.bs // sb.desc_size
        gdt_index, slot = divmod(group, per_block)
        if sb.incompat & layout.INCOMPAT_META_BG and gdt_index >= sb.first_meta_bg:
            first = gdt_index * per_block
            block = sb.first_data_block + first * sb.blocks_per_group
            block += 1 if self._has_super(first) else 0
            if self.bs == 1024 and gdt_index == 0 and sb.first_data_block == 0:
                block += 1  # 1 KiB bigalloc: group 0 starts at block 0, its super in block 1
        else:
            # Right after the superblock's own block (the kernel's descriptor_loc): block 2
            # with 1 KiB blocks even when first_data_block is 0 (bigalloc), else block 1.
            block = 1024 // self.bs + 1 + gdt_index
        desc = self.read_within(block, slot * sb.desc_size, sb.desc_size,
                                f"group descriptor {group}")
        table = struct.unpack_from("<I", desc, 0x08)[0]
        if sb.desc_size >= 64:
            table |= struct.unpack_from("<I", desc, 0x28)[0] << 32
        self._descs.put(group, table)
        return table

    def _has_super(self, group: int) -> bool:
        """Whether ``group`` keeps a superblock copy (the kernel's ext4_bg_has_super)."""
        if group == 0:
            return True
        if self.sb.backup_bgs is not None:  # sparse_super2: two backups at most, by number
            return group in self.sb.backup_bgs
        if group <= 1 or not self.sb.ro_compat & 0x1:  # sparse_super
            return True
        for base in (3, 5, 7):
            n = base
            while n < group:
                n *= base
            if n == group:
                return True
        return False

    def inode(self, ino: int) -> Inode:
        cached = self._inodes.get(ino)
        if cached is not None:
            return cached
        sb = self.sb
        if ino < 1 or ino > sb.inodes_count:
            raise GuestFSUnreadable(why=f"inode number {ino} is outside 1..{sb.inodes_count}")
        group, index = divmod(ino - 1, sb.inodes_per_group)
        raw = self._inode_bytes(group, index * sb.inode_size, ino)
        inode = layout.parse_inode(raw, ino, sb)
        self._inodes.put(ino, inode)
        return inode

    def _inode_bytes(self, group: int, byte: int, ino: int) -> bytes:
        """The ``inode_size`` bytes at ``byte`` of ``group``'s inode table, from the piece of
        the table (INODE_TABLE_READ bytes, never past the table's end) that holds them."""
        sb, bs = self.sb, self.bs
        per_piece = max(1, INODE_TABLE_READ // bs)
        table_blocks = -(-sb.inodes_per_group * sb.inode_size // bs)
        first = byte // bs // per_piece * per_piece
        start = self._inode_table(group)
        key = (self._token, start + first)
        piece = _tables.get(key)
        if piece is None:
            count = min(per_piece, table_blocks - first)
            if start + first + count > sb.blocks_count:  # not the table: read just the inode
                block = start + byte // bs
                return self.read_within(block, byte % bs, sb.inode_size, f"inode {ino}")
            piece = self.read_blocks(start + first, count, f"inode table of group {group}")
            _tables.put(key, piece)
        at = byte - first * bs
        return piece[at : at + sb.inode_size]

    def read_dir_block(self, inode: Inode, lblk: int, phys: int, where: str) -> bytes:
        """Block ``lblk`` (at ``phys``) of a directory, its metadata_csum verified as the
        kernel's ``__ext4_read_dirblock`` does: a block of another directory or file (a
        damaged block number) or a damaged entry fails it, whatever its entries look like."""
        raw = self.read_blocks(phys, 1, where)
        if self.sb.csum_seed is None or self._dir_ok.get(phys) == inode.ino:
            return raw
        index = bool(inode.flags & layout.FL_INDEX and self.sb.compat & layout.COMPAT_DIR_INDEX)
        why = layout.dirblock_csum_error(raw, inode.csum_seed, index, lblk == 0)
        if why:
            raise GuestFSUnreadable(why=f"{where} {why}")
        self._dir_ok.put(phys, inode.ino)
        return raw

    # --- mapping logical blocks to disk blocks ----------------------------------------------

    def runs(self, inode: Inode, first: int, end: int) -> list[Run]:
        """Runs covering logical blocks [first, end) of ``inode``, holes included."""
        if inode.flags & layout.FL_EXTENTS:
            return self._extent_runs(inode, first, end)
        return self._indirect_runs(inode, first, end)

    def _extent_runs(self, inode: Inode, first: int, end: int) -> list[Run]:
        cached = self._maps.get(inode.ino)
        if cached is None:
            extents: list = []
            self._walk_extents(inode, inode.block, extents, 0)
            cached = (extents, [e[0] for e in extents])
            self._maps.put(inode.ino, cached)
        extents, starts = cached
        out: list[Run] = []
        pos = first
        i = max(0, bisect.bisect_right(starts, first) - 1)
        while pos < end:
            if i < len(extents) and extents[i][0] + extents[i][1] <= pos:
                i += 1
                continue
            if i >= len(extents) or extents[i][0] >= end:
                out.append((pos, end - pos, None))
                break
            lblk, length, phys, unwritten = extents[i]
            if lblk > pos:
                out.append((pos, lblk - pos, None))
                pos = lblk
            stop = min(end, lblk + length)
            out.append((pos, stop - pos, None if unwritten else phys + (pos - lblk)))
            pos = stop
            i += 1
        return out

    def _walk_extents(self, inode: Inode, raw: bytes, out: list, level: int) -> None:
        node = layout.parse_extent_node(raw, f"inode {inode.ino}")
        if level > 5:
            raise GuestFSUnreadable(why=f"extent tree of inode {inode.ino} is too deep")
        for lblk, length, phys, unwritten in node.entries:
            if node.depth == 0:
                if out and lblk < out[-1][0] + out[-1][1]:
                    raise GuestFSUnreadable(
                        why=f"extents of inode {inode.ino} overlap or are out of order"
                    )
                if length and phys + length > self.sb.blocks_count:
                    raise GuestFSUnreadable(
                        why=f"extent of inode {inode.ino} points past the filesystem"
                    )
                if length:
                    out.append((lblk, length, phys, unwritten))
            else:
                child = self.read_blocks(phys, 1, f"extent node of inode {inode.ino}")
                if self.sb.csum_seed is not None and not layout.extent_block_csum_ok(
                        child, inode.csum_seed):
                    # as the kernel's ext4_ext_check ("extent tree corrupted"): a node that
                    # is not this inode's (a block number damaged in its parent) maps another
                    # file's blocks, and its own sanity checks may all pass
                    raise GuestFSUnreadable(why=f"extent node of inode {inode.ino} in block "
                                                f"{phys} fails its checksum (metadata_csum)")
                self._walk_extents(inode, child, out, level + 1)

    def _indirect_runs(self, inode: Inode, first: int, end: int) -> list[Run]:
        out: list[Run] = []
        for lblk in range(first, end):
            phys = self._bmap(inode, lblk)
            last = out[-1] if out else None
            if last and (
                (phys is None and last[2] is None)
                or (phys is not None and last[2] is not None and last[2] + last[1] == phys)
            ):
                out[-1] = (last[0], last[1] + 1, last[2])
            else:
                out.append((lblk, 1, phys))
        return out

    def _bmap(self, inode: Inode, lblk: int) -> int | None:
        ptrs = struct.unpack("<15I", inode.block)
        per = self.bs // 4
        if lblk < 12:
            return ptrs[lblk] or None
        lblk -= 12
        for level, slot in ((1, 12), (2, 13), (3, 14)):
            span = per**level
            if lblk < span:
                block = ptrs[slot]
                for depth in range(level - 1, -1, -1):
                    if block == 0:
                        return None
                    table = self._indirect_table(block, inode.ino)
                    block = table[(lblk // per**depth) % per]
                if block and block >= self.sb.blocks_count:
                    raise GuestFSUnreadable(
                        why=f"block map of inode {inode.ino} points past the filesystem"
                    )
                return block or None
            lblk -= span
        raise GuestFSUnreadable(why=f"block {lblk} of inode {inode.ino} is beyond a block map")

    def _indirect_table(self, block: int, ino: int) -> tuple[int, ...]:
        table = self._indirect.get(block)
        if table is None:
            raw = self.read_blocks(block, 1, f"indirect block of inode {ino}")
            table = struct.unpack(f"<{self.bs // 4}I", raw)
            self._indirect.put(block, table)
        return table

    # --- file bytes --------------------------------------------------------------------------

    def read_data(self, inode: Inode, offset: int, n: int) -> bytes:
        """Bytes [offset, offset+n) of a file, cut at its size; holes read as zeros."""
        n = min(n, inode.size - offset)
        if n <= 0:
            return b""
        if inode.flags & layout.FL_INLINE_DATA:
            data = layout.inline_data(inode)
            if len(data) < inode.size:
                raise GuestFSUnreadable(
                    why=f"inode {inode.ino} holds {len(data)} inline bytes but claims {inode.size}"
                )
            return data[offset : offset + n]
        bs = self.bs
        first, end = offset // bs, (offset + n + bs - 1) // bs
        parts = []
        for _lblk, count, phys in self.runs(inode, first, end):
            if phys is None:
                parts.append(bytes(count * bs))
            else:
                parts.append(self.read_blocks(phys, count, f"data of inode {inode.ino}"))
        data = b"".join(parts)
        skip = offset - first * bs
        return data[skip : skip + n]
