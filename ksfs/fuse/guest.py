"""``fs/`` under a checkpoint: the guest's own filesystem as it was at that moment.

Read straight from the checkpoint's disk manifest through ksfs.guestfs (no loop mount, no kernel
ext4, no copy): directories list from the guest's directory blocks, files read on demand, and
modes, owners, sizes and mtimes are the guest's. A disk that cannot be read exactly shows an
empty ``fs/`` and records one ``fs.unreadable`` event saying why, never wrong bytes. Nodes here
are keyed by the checkpoint's lineage and seq plus the guest's inode number, so they never
change. Never imports pyfuse3 or trio.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from typing import Any

from ksfs.errors import KsfsError
from ksfs.fuse.dirs import CHECKPOINT_EXTRA_DIRS, CheckpointDir
from ksfs.fuse.nodes import Attr, Dir, Node, StoredFile, blocks_for
from ksfs.lru import LRU

# Open guest filesystems kept (each holds a store reader of the disk: its manifest's table
# and a chunk cache, keeper.GUEST_READER_CACHE): the nodes of fs/ reach theirs through this,
# never hold one, so walking every checkpoint (ls -R, du, find, backups) keeps at most this many.
FS_KEPT = 8

_open = LRU(FS_KEPT)  # (lineage, seq) -> GuestFS, or _UNREADABLE
_UNREADABLE = object()  # kept too: its event is said once, not at every look


def _guest_fs(cp: CheckpointDir) -> Any:
    """The GuestFS of a checkpoint (opened again once it fell out of the kept ones), or None
    when it cannot be read."""
    key = (cp.lineage, cp.seq)
    fs = _open.get(key)
    if fs is None:
        fs, why = cp.keeper.open_guest_fs(cp.load())  # fs_dir saw that it has a disk
        if fs is None:
            cp.keeper.reject_fs(cp.session, cp.name, why, (cp.lineage, cp.seq))
        _open.put(key, _UNREADABLE if fs is None else fs)
    return None if fs is _UNREADABLE else fs


class GuestNode(Node):
    """Attributes of one guest inode, taken from its stat. Its st_blocks is 1 for a file with
    bytes, else 0: the bytes are disk.raw's, counted there, so ``du`` of a checkpoint is about
    what deleting it frees; and not 0, which archivers read as a file all hole (blocks_for)."""

    forgettable = True  # made again from the guest's inode when looked up again
    ino_from_key = True

    def __init__(self, cp: CheckpointDir, st: Any) -> None:
        # What Node's own constructor sets (StoredFile's, a later base of GuestFile, takes other
        # arguments), by hand: one is made for every entry of a listing.
        self.keeper, self.session = cp.keeper, cp.session
        self.key = ("guest", cp.lineage, cp.seq, st.ino)
        self.cp, self.st = cp, st
        self.mtime = st.mtime_ns / 1e9

    @property
    def fs(self) -> Any:
        """The checkpoint's guest filesystem, from the kept ones (nodes live as long as the
        mount: one holding its filesystem would keep every checkpoint's ever listed open)."""
        fs = _guest_fs(self.cp)
        if fs is None:  # it was read when this node was made: the store changed under it
            raise KsfsError(f"the guest filesystem of {self.cp.describe()} can no longer be read")
        return fs

    def blocks(self, size: int) -> int:
        return blocks_for(0, size) if stat.S_ISREG(self.st.mode) else 0

    def xattr_names(self) -> list[bytes]:
        """The guest file's extended attribute names, as the guest's kernel lists them
        (GuestFS.listxattr_ino); read-only, like the rest of fs/."""
        return self.fs.listxattr_ino(self.st.ino)

    def xattr(self, name: bytes) -> bytes | None:
        """One extended attribute's value (POSIX ACLs as getxattr gives them), or None."""
        return self.fs.getxattr_ino(self.st.ino, name)

    def attr(self) -> Attr:
        # made for every entry of a listing: the bits by hand, blocks as blocks() says them
        st = self.st
        kind = st.mode & 0o170000
        size = st.size
        return Attr(kind == stat.S_IFDIR, st.mode & 0o7777, size,
                    (1 if size > 0 else 0) if kind == stat.S_IFREG else 0,
                    self.mtime, self.entry_timeout, self.attr_timeout, kind,
                    st.uid, st.gid, st.nlink, (st.atime_ns, st.mtime_ns, st.ctime_ns), st.rdev)


class GuestDir(GuestNode, Dir):
    names_checked = False  # a guest's names are any bytes but '/' and NUL
    lists_lazily = True  # a guest directory may hold millions: listed as read, by cookie

    def children(self) -> list[tuple[str, Node]]:
        return [(name, node) for name, node, _ in self.children_from(0)]

    def check(self) -> None:
        """NotFound once its checkpoint was deleted (asked at opendir)."""
        self.cp.still_published()

    def children_from(self, after: int) -> Iterator[tuple[str, Node, int]]:
        """(name, node, cookie) of the entries past cookie ``after``, read block by block; an
        entry whose inode cannot be read is left out (GuestFS.listdir_stats_from)."""
        self.cp.still_published()  # (a deleted checkpoint's guest directories are gone too)
        for name, st, cookie in self.fs.listdir_stats_from(self.st.ino, after):
            yield name, node_of(self.cp, st), cookie

    def lookup(self, name: str) -> Node:
        self.cp.still_published()
        fs = self.fs
        return node_of(self.cp, fs.stat_ino(fs.lookup(self.st.ino, name)))

    def describe(self) -> str:
        return self.cp.describe() + "fs/ (read-only)"


class GuestFile(GuestNode, StoredFile):
    """A guest file: its bytes are read on demand from the disk image through the store."""

    reads_inline = False  # an extent walk may wait on the guest filesystem's locks
    needs_io = False  # attributes come from the guest inode read at lookup, not the store

    def size(self) -> int:
        return self.st.size

    def open_reader(self) -> Any:
        fs = self.fs
        # an encrypted file (fscrypt) is refused at open with ENOKEY, as the kernel refuses it
        fs.require_readable(self.st.ino)
        return _InodeReader(fs, self.st.ino, self.st.size)

    def explain_missing(self, exc: Any) -> Any:
        rec = self.cp.record
        if rec is None:
            return exc
        return self.keeper.gone_error(self.session, rec, f"fs/ inode {self.st.ino}", exc)


class GuestSymlink(GuestNode):
    def target(self) -> bytes:
        return self.fs.readlink_bytes(self.st.ino)


class _InodeReader:
    def __init__(self, fs: Any, ino: int, size: int) -> None:
        self.fs, self.ino, self.size = fs, ino, size

    def read(self, offset: int, n: int) -> bytes:
        return self.fs.read_ino(self.ino, offset, n)


def node_of(cp: CheckpointDir, st: Any) -> Node:
    if stat.S_ISDIR(st.mode):
        return GuestDir(cp, st)
    if stat.S_ISLNK(st.mode):
        return GuestSymlink(cp, st)
    return GuestFile(cp, st)  # regular files; device nodes and fifos read as empty


class EmptyFsDir(Dir):
    """``fs/`` of a checkpoint whose disk cannot be read: empty (the event says why)."""

    ino_from_key = True  # as the fs/ it stands for

    def __init__(self, cp: CheckpointDir) -> None:
        super().__init__(cp.keeper, ("guest-empty", cp.lineage, cp.seq), cp.session)
        self.mtime = cp.mtime


def fs_dir(cp: CheckpointDir) -> Node | None:
    if cp.keeper.guest_disk(cp.load())[0] is None:
        return None
    fs = _guest_fs(cp)
    if fs is None:
        return EmptyFsDir(cp)
    from ksfs.guestfs import ROOT_INO

    root = GuestDir(cp, fs.stat_ino(ROOT_INO))
    # one per checkpoint, and listed in the checkpoint's snapshot listing, which counts no
    # lookups: kept for the mount's life like the rest of ksfs's own tree, but numbered from
    # its key as its files are (QA: its number changed with every mount, and tar
    # --listed-incremental archived the whole guest tree again)
    root.forgettable = False
    return root


CHECKPOINT_EXTRA_DIRS["fs"] = fs_dir
