"""Differences between two guest filesystems, exactly as ``diff -rq --no-dereference`` sees them.

A path only on one side is one change (a directory is not descended into); a path on both sides
is changed when its type differs, when a regular file's bytes differ, when a symlink's target
differs, or when a device's numbers differ. Modes, owners and times alone are not changes, as for
``diff -r``, unless ``attrs=True`` is asked for: then a path on both sides with the same type whose
permission bits (``S_IMODE``), owner (uid, gid) or extended attributes differ is a change of kind
``"attrs"``, and a
``"changed"`` path says in ``attrs`` which of those moved too. Times are never compared (every
write moves them). Content is compared cheaply where it can be proven equal without reading: both
ranges are holes, or both lie at the same place of two store files whose chunk ids there are the
same (BLAKE3 ids: equal ids mean equal bytes). Everything else is read and compared.
"""

from __future__ import annotations

import bisect
import logging
import os
import stat as st
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs import layout
from ksfs.guestfs.fs import ROOT_INO, GuestFS, GuestStat

log = logging.getLogger(__name__)

WINDOW = 256  # blocks compared at a time: bounded memory for any file size

_KINDS = {
    st.S_IFREG: "file", st.S_IFDIR: "dir", st.S_IFLNK: "symlink", st.S_IFCHR: "char",
    st.S_IFBLK: "block", st.S_IFIFO: "fifo", st.S_IFSOCK: "socket",
}


@dataclass(frozen=True)
class Change:
    """One difference. ``path`` is relative to the root ("work/a.txt"); sizes are None for
    directories and for the side a path is missing from."""

    kind: str  # "added" | "removed" | "changed" | "attrs" (mode/owner/xattrs only, attrs=True)
    path: str
    type_a: str | None
    type_b: str | None
    size_a: int | None
    size_b: int | None
    # With attrs=True: what moved besides content, {"mode"|"uid"|"gid": [a, b]}: "mode" (the
    # S_IMODE permission bits, as ints) when it differs, "uid" and "gid" when the owner does;
    # "xattrs": the names of the extended attributes added, removed or changed; "rdev": a
    # changed device's numbers, ["major:minor", "major:minor"].
    attrs: dict[str, list] = field(default_factory=dict)

    @property
    def type(self) -> str:
        return self.type_b or self.type_a or ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = self.type
        return d


def kind_of(s: GuestStat) -> str:
    return _KINDS.get(st.S_IFMT(s.mode), "unknown")


def _size(s: GuestStat | None) -> int | None:
    return None if s is None or s.is_dir else s.size


DAMAGED = "damaged"  # the type of a path whose inode cannot be read (diff_trees)


def _kind_or_damage(s: GuestStat | GuestFSUnreadable | None) -> str | None:
    if isinstance(s, GuestFSUnreadable):
        return DAMAGED
    return None if s is None else kind_of(s)


def _size_or_none(s: GuestStat | GuestFSUnreadable | None) -> int | None:
    return None if isinstance(s, GuestFSUnreadable) else _size(s)


def attr_changes(sa: GuestStat, sb: GuestStat) -> dict[str, list[int]]:
    """What moved of the permission bits and the owner between two stats, as {name: [a, b]}:
    "mode" when the bits differ, "uid" and "gid" both when either differs."""
    out: dict[str, list[int]] = {}
    if st.S_IMODE(sa.mode) != st.S_IMODE(sb.mode):
        out["mode"] = [st.S_IMODE(sa.mode), st.S_IMODE(sb.mode)]
    if (sa.uid, sa.gid) != (sb.uid, sb.gid):
        out["uid"], out["gid"] = [sa.uid, sb.uid], [sa.gid, sb.gid]
    return out


def xattr_changes(fs_a: GuestFS, ino_a: int, fs_b: GuestFS, ino_b: int) -> dict[str, Any]:
    """The extended attributes that moved between two inodes, as {"added", "removed",
    "changed": sorted names} with only the non-empty lists (POSIX ACLs compared in getxattr's
    form); {} when none did, {"unreadable": True} when a side's cannot be read."""
    try:
        xa, xb = fs_a.xattrs_ino(ino_a), fs_b.xattrs_ino(ino_b)
    except GuestFSUnreadable as exc:
        log.warning("comparing the extended attributes of inodes %d and %d: %s",
                    ino_a, ino_b, exc)
        return {"unreadable": True}

    def names(found: Any) -> list[str]:
        return sorted(n.decode("utf-8", "surrogateescape") for n in found)

    moved = {"added": names(xb.keys() - xa.keys()), "removed": names(xa.keys() - xb.keys()),
             "changed": names(n for n in xa.keys() & xb.keys() if xa[n] != xb[n])}
    return {k: v for k, v in moved.items() if v}


def _numbers(rdev: int) -> str:
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def _moved(fs_a: GuestFS, sa: GuestStat, fs_b: GuestFS, sb: GuestStat) -> dict[str, Any]:
    out: dict[str, Any] = dict(attr_changes(sa, sb))
    xattrs = xattr_changes(fs_a, sa.ino, fs_b, sb.ino)
    if xattrs:
        out["xattrs"] = xattrs
    return out


def diff_trees(fs_a: GuestFS, fs_b: GuestFS, *, attrs: bool = False) -> list[Change]:
    """Every difference between the two trees, sorted by path (as ``diff -rq`` orders them).

    With ``attrs=True`` mode and owner changes are reported too (kind ``"attrs"`` when nothing
    else changed); without it the result is exactly what ``diff -rq --no-dereference`` says.

    The walk keeps its own stack (a tree thousands of directories deep must not exhaust
    Python's recursion limit) and the directories on the current path of each side: one that
    is its own ancestor (a loop in a damaged filesystem) is one change, not descended."""
    changes: list[Change] = []
    stack = [_DirPair.open(fs_a, ROOT_INO, fs_b, ROOT_INO, "", (), ())]
    while stack:
        pair = stack[-1]
        name = next(pair.names, None)
        if name is None:
            stack.pop()
            continue
        child = _compare_entry(fs_a, fs_b, pair, name, changes, attrs)
        if child is not None:
            stack.append(child)
    return changes


@dataclass
class _DirPair:
    """One directory of each side being compared: their entries, the names still to compare
    (bytewise order, as ``LC_ALL=C diff``) and the directory inodes from the root down to
    them, on each side."""

    a: dict[str, GuestStat | GuestFSUnreadable]
    b: dict[str, GuestStat | GuestFSUnreadable]
    names: Iterator[str]
    prefix: str
    path_a: tuple[int, ...]
    path_b: tuple[int, ...]

    @classmethod
    def open(cls, fs_a: GuestFS, dir_a: int, fs_b: GuestFS, dir_b: int, prefix: str,
             above_a: tuple[int, ...], above_b: tuple[int, ...]) -> _DirPair:
        # entries of cleared or unlinked inodes are left out; a damaged inode is kept, with
        # why it cannot be read, so that it is a change (not a file added or removed)
        a = {n: st for n, st, _ in fs_a.listdir_checked_from(dir_a)}
        b = {n: st for n, st, _ in fs_b.listdir_checked_from(dir_b)}
        # diff sorts names bytewise (LC_ALL=C): surrogateescape'd str would not, bytes do
        names = sorted(a.keys() | b.keys(), key=lambda n: n.encode("utf-8", "surrogateescape"))
        return cls(a, b, iter(names), prefix, above_a + (dir_a,), above_b + (dir_b,))


def _compare_entry(fs_a: GuestFS, fs_b: GuestFS, pair: _DirPair, name: str,
                   out: list[Change], attrs: bool) -> _DirPair | None:
    """Append the change of one name, if any; the pair of directories to descend into when
    both sides hold a directory there that can be listed."""
    path = pair.prefix + name
    sa, sb = pair.a.get(name), pair.b.get(name)
    if isinstance(sa, GuestFSUnreadable) or isinstance(sb, GuestFSUnreadable):
        # one change, as a damaged file is: its type on that side is "damaged"
        for side, s in (("A", sa), ("B", sb)):
            if isinstance(s, GuestFSUnreadable):
                log.warning("comparing guest path %s: its inode on side %s cannot be read: %s",
                            path, side, s)
        out.append(Change("changed", path, _kind_or_damage(sa), _kind_or_damage(sb),
                          _size_or_none(sa), _size_or_none(sb)))
        return None
    if sa is None:
        out.append(Change("added", path, None, kind_of(sb), None, _size(sb)))
    elif sb is None:
        out.append(Change("removed", path, kind_of(sa), None, _size(sa), None))
    elif kind_of(sa) != kind_of(sb):
        out.append(Change("changed", path, kind_of(sa), kind_of(sb), _size(sa), _size(sb)))
    elif sa.is_dir:
        moved = _moved(fs_a, sa, fs_b, sb) if attrs else {}
        if moved:  # the directory itself, before what changed inside it
            out.append(Change("attrs", path, "dir", "dir", None, None, moved))
        return _open_subdir(fs_a, sa, fs_b, sb, pair, path, out)
    else:
        moved = _moved(fs_a, sa, fs_b, sb) if attrs else {}
        if not _same(fs_a, sa, fs_b, sb):
            if attrs and kind_of(sa) in ("char", "block"):
                # a device's content is its numbers (QA: "char, 0 -> 0" said nothing)
                moved["rdev"] = [_numbers(sa.rdev), _numbers(sb.rdev)]
            out.append(Change("changed", path, kind_of(sa), kind_of(sb), sa.size, sb.size,
                              moved))
        elif moved:
            out.append(Change("attrs", path, kind_of(sa), kind_of(sb), _size(sa), _size(sb),
                              moved))
    return None


def _open_subdir(fs_a: GuestFS, sa: GuestStat, fs_b: GuestFS, sb: GuestStat, pair: _DirPair,
                 path: str, out: list[Change]) -> _DirPair | None:
    # A damaged directory (its own blocks, or a loop back to an ancestor) is reported as
    # changed, whole; the rest of the tree is still compared.
    if sa.ino in pair.path_a or sb.ino in pair.path_b:
        log.warning("comparing guest directory %s: it is its own ancestor (a directory loop: "
                    "the filesystem is damaged); not descended", path)
        out.append(Change("changed", path, "dir", "dir", None, None))
        return None
    try:
        return _DirPair.open(fs_a, sa.ino, fs_b, sb.ino, path + "/", pair.path_a, pair.path_b)
    except GuestFSUnreadable as exc:
        log.warning("comparing guest directory %s: %s", path, exc)
        out.append(Change("changed", path, "dir", "dir", None, None))
        return None


def _same(fs_a: GuestFS, sa: GuestStat, fs_b: GuestFS, sb: GuestStat) -> bool:
    try:
        return _same_or_raise(fs_a, sa, fs_b, sb)
    except GuestFSUnreadable as exc:
        # One damaged file (an extent tree, a symlink's size) is reported as changed; it
        # must not take the comparison of the rest of the tree with it.
        log.warning("comparing guest inodes %d and %d: %s", sa.ino, sb.ino, exc)
        return False


def _same_or_raise(fs_a: GuestFS, sa: GuestStat, fs_b: GuestFS, sb: GuestStat) -> bool:
    if sa.is_symlink:
        return fs_a.readlink_bytes(sa.ino) == fs_b.readlink_bytes(sb.ino)
    if not sa.is_file:
        return sa.rdev == sb.rdev  # devices by their numbers; fifos and sockets have no content
    if sa.size != sb.size:
        return False
    return same_content(fs_a, sa.ino, fs_b, sb.ino, sa.size)


def same_content(fs_a: GuestFS, ino_a: int, fs_b: GuestFS, ino_b: int, size: int) -> bool:
    """Whether two regular files of ``size`` bytes hold the same bytes."""
    va, vb = fs_a.volume, fs_b.volume
    ia, ib = va.inode(ino_a), vb.inode(ino_b)
    inline = (ia.flags | ib.flags) & layout.FL_INLINE_DATA
    if inline or va.bs != vb.bs:
        return _same_bytes(fs_a, ino_a, fs_b, ino_b, 0, size)
    bs = va.bs
    n_blocks = (size + bs - 1) // bs
    for first in range(0, n_blocks, WINDOW):
        end = min(n_blocks, first + WINDOW)
        if not _window_proven(va, va.runs(ia, first, end), vb, vb.runs(ib, first, end)):
            if not _same_bytes(fs_a, ino_a, fs_b, ino_b, first * bs, (end - first) * bs):
                return False
    return True


def _same_bytes(fs_a: GuestFS, ino_a: int, fs_b: GuestFS, ino_b: int, offset: int,
                n: int) -> bool:
    return _stored(fs_a, ino_a, offset, n) == _stored(fs_b, ino_b, offset, n)


def _stored(fs: GuestFS, ino: int, offset: int, n: int) -> bytes:
    """A file's bytes; an encrypted file's (fscrypt), which no one can read without its key,
    as stored: the ciphertext of a file read equal exactly where its plaintext is equal under
    the same file key, so an unchanged file is equal and a changed one is not (one written
    anew with equal bytes has a new key, and is called changed)."""
    inode = fs.volume.inode(ino)
    if inode.flags & layout.FL_ENCRYPT:
        return fs.volume.read_data(inode, offset, n)
    return fs.read_ino(ino, offset, n)


def _window_proven(va: Any, runs_a: list, vb: Any, runs_b: list) -> bool:
    """True when every block of the window is equal without reading: holes on both sides, or the
    same store chunks at the same place of both images."""
    i = j = 0
    while i < len(runs_a) and j < len(runs_b):
        la, ca, pa = runs_a[i]
        lb, cb, pb = runs_b[j]
        start = max(la, lb)
        stop = min(la + ca, lb + cb)
        if stop > start:
            sa = None if pa is None else pa + (start - la)
            sb = None if pb is None else pb + (start - lb)
            if not _segment_proven(va, sa, vb, sb, stop - start):
                return False
        if la + ca <= lb + cb:
            i += 1
        else:
            j += 1
    return True


def _segment_proven(va: Any, pa: int | None, vb: Any, pb: int | None, count: int) -> bool:
    if pa is None or pb is None:
        return pa is None and pb is None
    if va.overlaps_overlay(pa, count) or vb.overlaps_overlay(pb, count):
        return False
    off_a = va.offset + pa * va.bs
    off_b = vb.offset + pb * vb.bs
    if off_a != off_b:
        return False
    ids_a = _chunk_ids(va.reader, off_a, count * va.bs)
    return ids_a is not None and ids_a == _chunk_ids(vb.reader, off_b, count * vb.bs)


def _chunk_ids(reader: Any, offset: int, n: int) -> list | None:
    """(start, length, id) of the store chunks covering a byte range, or None when ``reader`` is
    not a store file (duck-typed: ``entries`` of (id, length) and their ``starts``)."""
    entries = getattr(reader, "entries", None)
    starts = getattr(reader, "starts", None)
    if entries is None or starts is None:
        return None
    i = bisect.bisect_right(starts, offset) - 1
    out = []
    while i < len(entries) and starts[i] < offset + n:
        cid, length = entries[i]
        out.append((starts[i], length, cid))
        i += 1
    return out
