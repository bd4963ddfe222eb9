"""Replay of the ext3/4 (jbd2) journal in memory: which filesystem blocks have a newer committed
copy in the journal, as the kernel would write them back when mounting.

A checkpoint is taken while the guest has its filesystem mounted, so metadata the guest already
made durable (an fsync'ed file's new size, a new directory entry) may live only in the journal.
Reading around it would show an older tree. This module only computes the overlay; it never
writes, and it stops at the first transaction that is not whole (as recovery does). A journal the
kernel would refuse to recover (a committed transaction or a replayed block that fails its
checksum) raises GuestFSUnreadable: never a silently older or incomplete tree.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NamedTuple

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs.layout import crc32c

if TYPE_CHECKING:
    from ksfs.guestfs.volume import Volume

JBD2_MAGIC = 0xC03B3998
DESCRIPTOR, COMMIT, SB_V1, SB_V2, REVOKE = 1, 2, 3, 4, 5
INCOMPAT_REVOKE, INCOMPAT_64BIT, INCOMPAT_ASYNC_COMMIT = 0x1, 0x2, 0x4
INCOMPAT_CSUM_V2, INCOMPAT_CSUM_V3, INCOMPAT_FAST_COMMIT = 0x8, 0x10, 0x20
KNOWN_INCOMPAT = 0x3F
TAG_ESCAPE, TAG_SAME_UUID, TAG_LAST = 0x1, 0x2, 0x8


class JournalCopy(NamedTuple):
    """The newest committed copy of a filesystem block, at fs block ``block`` in the journal.
    Its checksum (with journal checksums) was verified when the journal was replayed."""

    block: int
    escaped: bool

    def restore(self, data: bytes) -> bytes:
        """The block as the kernel writes it back, from its bytes in the journal."""
        if self.escaped:  # jbd2 zeroes the magic of data blocks that would look like its own
            data = struct.pack(">I", JBD2_MAGIC) + data[4:]
        return data


def journal_overlay(vol: Volume) -> dict[int, JournalCopy]:
    """fs block -> its newest committed copy in the journal, for a journal that needs
    recovery; empty for a clean journal."""
    sb = vol.sb
    inode = vol.inode(sb.journal_inum)
    bs = vol.bs
    n_blocks = inode.size // bs
    if n_blocks < 2:
        raise GuestFSUnreadable(why=f"the journal inode {sb.journal_inum} is too small")
    phys = _journal_map(vol, inode, n_blocks)
    jsb = vol.read_blocks(phys[0], 1, "journal superblock")
    magic, btype, _ = struct.unpack_from(">III", jsb, 0)
    if magic != JBD2_MAGIC or btype not in (SB_V1, SB_V2):
        raise GuestFSUnreadable(why="the journal superblock is damaged (bad magic)")
    jbs, maxlen, first, sequence, start = struct.unpack_from(">IIIII", jsb, 12)
    incompat = struct.unpack_from(">I", jsb, 0x28)[0] if btype == SB_V2 else 0
    if start == 0:
        return {}  # clean: everything was written back
    if jbs != bs or maxlen > n_blocks or not 0 < first < maxlen or not first <= start < maxlen:
        raise GuestFSUnreadable(why="the journal superblock geometry is damaged")
    if incompat & ~KNOWN_INCOMPAT:
        raise GuestFSUnreadable(why=f"unknown journal feature(s) 0x{incompat & ~KNOWN_INCOMPAT:x}")
    if incompat & INCOMPAT_FAST_COMMIT:
        raise GuestFSUnreadable(why="the journal needs recovery with fast commits (unsupported)")
    is64 = bool(incompat & INCOMPAT_64BIT)
    if incompat & INCOMPAT_CSUM_V3:
        tag_bytes = 16  # journal_block_tag3_t keeps its blocknr_high field even without 64bit
    else:
        tag_bytes = (12 if is64 else 8) + (2 if incompat & INCOMPAT_CSUM_V2 else 0)
    checksums = bool(incompat & (INCOMPAT_CSUM_V2 | INCOMPAT_CSUM_V3))
    tail = 4 if checksums else 0
    seed = crc32c(0xFFFFFFFF, jsb[0x30:0x40])  # the journal's uuid
    mask = 0xFFFFFFFF if incompat & INCOMPAT_CSUM_V3 else 0xFFFF

    def jread(j: int) -> bytes:
        return vol.read_blocks(phys[j], 1, "journal block")

    def advance(j: int) -> int:
        j += 1
        return first if j >= maxlen else j

    transactions: list[tuple[int, list[tuple[int, int, int, int]]]] = []
    revoked: dict[int, int] = {}
    pending: list[tuple[int, int, int, int]] = []  # (target, journal block, flags, checksum)
    pending_revokes: list[int] = []
    damaged = ""  # a descriptor or revoke block of this transaction that fails its checksum
    last_commit_time = 0
    j = start
    seen = 0
    while seen < maxlen:
        block = jread(j)
        magic, btype, seq = struct.unpack_from(">III", block, 0)
        if magic != JBD2_MAGIC or seq != sequence:
            break  # the end of the log: the next transaction was never committed
        seen += 1
        if btype in (DESCRIPTOR, REVOKE) and checksums and not _block_tail_ok(block, seed):
            # as the kernel: judged at the commit block, by its time (a stale block of an
            # older log ends the log; one of this log makes it unrecoverable)
            damaged = f"its {'descriptor' if btype == DESCRIPTOR else 'revoke'} block, " \
                      f"journal block {j}, fails its checksum"
        if btype == DESCRIPTOR:
            off = 12
            while off + tag_bytes <= bs - tail:
                target, flags, csum = _tag(block, off, incompat, is64)
                off += tag_bytes
                j = advance(j)
                seen += 1
                pending.append((target, j, flags, csum))
                if not flags & TAG_SAME_UUID:
                    off += 16
                if flags & TAG_LAST:
                    break
        elif btype == REVOKE:
            used = struct.unpack_from(">I", block, 12)[0]
            size = 8 if is64 else 4
            if used > bs:
                raise GuestFSUnreadable(why="a journal revoke block is damaged")
            for off in range(16, used, size):
                fmt = ">Q" if is64 else ">I"
                pending_revokes.append(struct.unpack_from(fmt, block, off)[0])
        elif btype == COMMIT:
            commit_time = struct.unpack_from(">Q", block, 0x30)[0]
            if checksums and not _commit_ok(block, seed):
                damaged = f"its commit block, journal block {j}, fails its checksum"
            if damaged:
                if commit_time < last_commit_time or incompat & INCOMPAT_ASYNC_COMMIT:
                    break  # a stale block of an older log (or async commit): the log ends here
                raise GuestFSUnreadable(why=f"the journal cannot be recovered (the kernel "
                                            f"refuses to mount it): transaction {sequence} is "
                                            f"corrupt: {damaged}")
            last_commit_time = commit_time
            transactions.append((sequence, pending))
            for b in pending_revokes:
                revoked[b] = max(revoked.get(b, -1), sequence)
            pending, pending_revokes = [], []
            sequence = (sequence + 1) & 0xFFFFFFFF
        else:
            break
        j = advance(j)
    overlay: dict[int, JournalCopy] = {}
    for seq, tags in transactions:
        seq_seed = crc32c(seed, struct.pack(">I", seq))
        for target, jblock, flags, csum in tags:
            if revoked.get(target, -1) >= seq:
                continue  # a later transaction freed this block: its journal copy is stale
            if target >= vol.sb.blocks_count:
                raise GuestFSUnreadable(why=f"the journal writes block {target}, past the end")
            # Every copy the kernel would write back is checked now, superseded ones too, as
            # its recovery does: one that fails makes the kernel refuse the whole journal, so
            # it must not leave a tree with some blocks silently old.
            if checksums and crc32c(seq_seed, jread(jblock)) & mask != csum:
                raise GuestFSUnreadable(
                    why=f"the journal cannot be recovered (the kernel refuses to mount it): "
                        f"the copy of block {target} in journal block {jblock} (transaction "
                        f"{seq}) fails its checksum")
            overlay[target] = JournalCopy(phys[jblock], bool(flags & TAG_ESCAPE))
    return overlay


def _tag(block: bytes, off: int, incompat: int, is64: bool) -> tuple[int, int, int]:
    """(target block, flags, checksum) of one descriptor tag."""
    if incompat & INCOMPAT_CSUM_V3:
        lo, flags, hi, csum = struct.unpack_from(">IIII", block, off)
    else:
        lo, csum, flags = struct.unpack_from(">IHH", block, off)
        hi = struct.unpack_from(">I", block, off + 8)[0] if is64 else 0
    return lo | ((hi << 32) if is64 else 0), flags, csum


COMMIT_HEADER = 60  # struct commit_header: what a commit block holds before its padding


def _commit_ok(block: bytes, seed: int) -> bool:
    """Whether a commit block passes its checksum, over the whole block or, as the kernel
    (jbd2_commit_block_csum_verify_partial, since 6.x) also accepts, over its header alone
    with zeros after it: a block whose padding was not all written still commits."""
    provided = struct.unpack_from(">I", block, 16)[0]
    header = block[:16] + b"\0\0\0\0" + block[20:COMMIT_HEADER]
    if crc32c(seed, header + block[COMMIT_HEADER:]) == provided:
        return True
    return crc32c(seed, header + bytes(len(block) - COMMIT_HEADER)) == provided


def _block_tail_ok(block: bytes, seed: int) -> bool:
    """Whether a descriptor or revoke block passes the checksum in its last 4 bytes."""
    provided = struct.unpack_from(">I", block, len(block) - 4)[0]
    return crc32c(seed, block[:-4] + b"\0\0\0\0") == provided


def _journal_map(vol: Volume, inode: object, n_blocks: int) -> list[int]:
    phys: list[int] = []
    for lblk, count, start in vol.runs(inode, 0, n_blocks):  # type: ignore[arg-type]
        if start is None:
            raise GuestFSUnreadable(why=f"the journal has a hole at block {lblk}")
        phys.extend(range(start, start + count))
    return phys
