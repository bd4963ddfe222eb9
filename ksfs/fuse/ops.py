"""The pyfuse3 Operations of the mount: resolve through the tree, call it, convert. Nothing more.

Handlers are short on purpose: every rule lives in ``ksfs.fuse.tree`` (testable without a
kernel). Blocking work runs in worker threads (``trio.to_thread.run_sync``); answers that come
from memory do not. Errors are turned into errnos in one place, ``_answer``: a KsfsError gives its
own ``errno``; anything else is a bug, logged with its traceback and answered EIO, and the mount
stays up. This module never imports click or libvirt, and never touches the store directly.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from ksfs.errors import KsfsError, NoSuchAttribute, NotFound, from_foreign
from ksfs.fuse.nodes import Attr
from ksfs.fuse.tree import CheckpointTree, Entry

log = logging.getLogger(__name__)

T = TypeVar("T")
BLOCK = 512
# Reads of stored files are answered on the loop itself (tree.ReaderHandle explains why); this
# thread is for the reads of files made from the ledger (events, status, resume). Metadata and
# verbs get threads of their own, so a long save never holds up an ls.
READ_THREADS = 1
META_THREADS = 4
# Guest entries read per step of a lazy listing: about what one readdirplus reply holds (a
# 4 KiB page), so little is read ahead and each step leaves the threads to other requests.
LAZY_BATCH = 32
LAZY_BATCH_MAX = 1024
# What ls -l asks of every entry: its SELinux label, and (passed on by the kernel to a FUSE file
# system in the initial user namespace) whether it has a POSIX ACL.
ASKED_BY_LS = (b"security.selinux", b"system.posix_acl_access", b"system.posix_acl_default")
VERB_THREADS = 4


def entry_attributes(ino: int, attr: Attr, uid: int, gid: int) -> pyfuse3.EntryAttributes:
    """The one place an EntryAttributes is filled."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = ino
    e.generation = 0
    e.entry_timeout = attr.entry_timeout
    e.attr_timeout = attr.attr_timeout
    e.st_mode = (attr.kind or (stat.S_IFDIR if attr.is_dir else stat.S_IFREG)) | attr.mode
    e.st_nlink = attr.nlink or (2 if attr.is_dir else 1)
    e.st_uid = uid if attr.uid is None else attr.uid
    e.st_gid = gid if attr.gid is None else attr.gid
    e.st_rdev = attr.rdev
    e.st_size = attr.size
    e.st_blksize = 128 * 1024
    e.st_blocks = attr.blocks
    if attr.times_ns is not None:
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = attr.times_ns
    else:
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = int(attr.mtime * 1e9)
    return e


@contextlib.asynccontextmanager
async def _answer(what: str) -> AsyncIterator[None]:
    try:
        yield
    except pyfuse3.FUSEError:
        raise
    except NotFound as exc:
        log.debug("%s: %s", what, exc)  # lookups of absent names: routine, not worth a line
        raise pyfuse3.FUSEError(exc.errno) from None
    except KsfsError as exc:
        log.info("%s refused: %s", what, exc)
        raise pyfuse3.FUSEError(exc.errno) from None
    except Exception as exc:
        known = from_foreign(exc)  # a damaged index, a full disk: its own errno, no traceback
        if known is not None:
            log.warning("%s failed: %s", what, known)
            raise pyfuse3.FUSEError(known.errno) from None
        log.exception("%s failed; answering EIO", what)
        raise pyfuse3.FUSEError(errno.EIO) from None


def handler(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapped(self: Operations, *args: Any) -> Any:
        async with _answer(f"{fn.__name__}{args[:2]!r}"):
            return await fn(self, *args)

    return wrapped


def _name(raw: bytes) -> str:
    # Non-UTF-8 names survive as surrogates; validate_name refuses them where they would be kept.
    return os.fsdecode(raw)


class _Lazy:
    """An open guest directory: read as listed, not snapshotted. Holds the entries one reply
    had no room for, for the next readdir that resumes at the same place."""

    def __init__(self, inode: int) -> None:
        self.inode = inode
        self.step = LAZY_BATCH
        self._after = -1
        self._held: list[tuple[Entry, int]] = []

    def take(self, after: int) -> list[tuple[Entry, int]]:
        """The held entries when a listing resumes where they begin, else nothing."""
        if after != self._after or not self._held:
            return []
        out, self._held, self._after = self._held, [], -1
        return out

    def keep(self, after: int, rest: list[tuple[Entry, int]]) -> list[tuple[Entry, int]]:
        """Hold ``rest`` (read past cookie ``after``, not sent); returns what was held before
        (never to be sent now: the caller gives back its lookup counts)."""
        old, self._held, self._after = self._held, rest, after
        return old


class Operations(pyfuse3.Operations):
    """Thin handlers over a ``CheckpointTree``; see the module docstring."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, tree: CheckpointTree) -> None:
        super().__init__()
        self.tree = tree
        self.uid = os.getuid()
        self.gid = os.getgid()
        self._read_limiter = trio.CapacityLimiter(READ_THREADS)
        self._limiter = trio.CapacityLimiter(META_THREADS)
        # Verbs (save, fork, restore) may take seconds: their own threads, so reads never wait.
        self._verb_limiter = trio.CapacityLimiter(VERB_THREADS)
        self._dirs: dict[int, list[Entry]] = {}
        self._next_dir = 1

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def _verb(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._verb_limiter)

    def _entry(self, e: Entry) -> pyfuse3.EntryAttributes:
        return entry_attributes(e.ino, e.attr, self.uid, self.gid)

    @handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        return self._entry(await self._io(functools.partial(
            self.tree.lookup, parent_inode, _name(name), counted=True)))

    @handler
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        node = self.tree.node(inode)
        attr = await self._io(node.attr) if node.needs_io else node.attr()
        return entry_attributes(inode, attr, self.uid, self.gid)

    @handler
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        only_size = fields.update_size and attr.st_size == 0 and not (
            fields.update_mode or fields.update_uid or fields.update_gid
        )
        a = await self._io(self.tree.refuse_setattr, inode, only_size)
        return entry_attributes(inode, a, self.uid, self.gid)

    @handler
    async def opendir(self, inode: int, ctx: Any) -> int:
        if await self._io(self.tree.lists_lazily, inode):
            listing: list[Entry] | _Lazy = _Lazy(inode)
        else:
            listing = await self._io(functools.partial(self.tree.listdir, inode, dots=True))
        fh = self._next_dir
        self._next_dir += 1
        self._dirs[fh] = listing
        return fh

    @handler
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        listing = self._dirs.get(fh, [])
        if isinstance(listing, _Lazy):
            await self._readdir_lazily(listing, start_id, token)
            return
        # Offsets index the snapshot taken at opendir, so a resumed listing neither repeats
        # nor skips an entry.
        for i in range(start_id, len(listing)):
            e = listing[i]
            if not pyfuse3.readdir_reply(token, os.fsencode(e.name), self._entry(e), i + 1):
                break

    async def _readdir_lazily(self, d: _Lazy, start_id: int, token: Any) -> None:
        """A guest directory as it is read: offsets 1 and 2 are ``.`` and ``..``, then each
        entry's offset is its cookie + 2, so a listing resumes where it stopped without
        reading what came before, and the first names come at once however many follow.
        Entries read but not sent wait for the next call (their lookup counts held)."""
        if start_id < 2:
            dots = await self._io(functools.partial(self.tree.listdir, d.inode, dots=True,
                                                    children=False))
            for i in range(start_id, 2):
                if not pyfuse3.readdir_reply(token, os.fsencode(dots[i].name),
                                             self._entry(dots[i]), i + 1):
                    return
        after = max(0, start_id - 2)
        sent = start_id < 2  # the dots went into this reply
        while True:
            batch = d.take(after)
            if not batch:
                try:
                    batch = await self._io(self.tree.entries_from, d.inode, after, d.step)
                except Exception:
                    if sent:  # a reply that raises is thrown away, entries and all: send
                        return  # what it holds; the next call meets the error first
                    raise
                # the first names at once, then longer steps: a whole listing is not paid
                # for in thread hops (what a step reads beyond one reply waits, held)
                d.step = min(d.step * 2, LAZY_BATCH_MAX)
            if not batch:
                return
            for i, (e, cookie) in enumerate(batch):
                if not pyfuse3.readdir_reply(token, os.fsencode(e.name), self._entry(e),
                                             cookie + 2):
                    self._unsent(d, after, batch[i:])
                    return
                after, sent = cookie, True

    def _unsent(self, d: _Lazy, after: int, rest: list[tuple[Entry, int]]) -> None:
        for e, _ in d.keep(after, rest):  # those it held before: never sent, given back
            self.tree.forget(e.ino, 1)

    @handler
    async def releasedir(self, fh: int) -> None:
        listing = self._dirs.pop(fh, None)
        if isinstance(listing, _Lazy):
            for e, _ in listing.keep(0, []):
                self.tree.forget(e.ino, 1)

    @handler
    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        fh, h = await self._io(self.tree.open, inode, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=h.keep_cache, direct_io=h.direct_io)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.tree.handle(fh)
        if not h.needs_io:
            return h.read(off, size)
        return await trio.to_thread.run_sync(h.read, off, size, limiter=self._read_limiter)

    @handler
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self._io(self.tree.readlink, inode)

    @handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self._verb(self.tree.write, fh, off, buf)

    @handler
    async def flush(self, fh: int) -> None:
        # resume acts on a name written without its newline here (close(2) answers its errno)
        if self.tree.pending(fh):
            await self._verb(self.tree.flush, fh)

    @handler
    async def release(self, fh: int) -> None:
        if self.tree.pending(fh):  # closed without a flush: still acted on, once
            await self._verb(self.tree.release, fh)
        else:
            self.tree.release(fh)

    @handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        return self._entry(await self._verb(self.tree.mkdir, parent_inode, _name(name)))

    @handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self._verb(self.tree.rmdir, parent_inode, _name(name))

    async def _refuse(self, parent_inode: int, name: bytes, verb: str) -> None:
        async with _answer(verb):
            await self._io(self.tree.refuse, parent_inode, _name(name), verb)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> Any:
        await self._refuse(parent_inode, name, "create")

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> Any:
        await self._refuse(parent_inode, name, "mknod")

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        await self._refuse(parent_inode, name, "symlink")

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        await self._refuse(new_parent_inode, new_name, "link")

    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self._refuse(parent_inode, name, "unlink")

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        await self._refuse(parent_inode_old, name_old, "rename")

    async def forget(self, inode_list: Any) -> None:
        # Must not fail (libfuse gets no reply): a guest file forgotten leaves the inode table.
        for inode, nlookup in inode_list:
            try:
                self.tree.forget(inode, nlookup)
            except Exception:  # noqa: BLE001
                log.exception("forget of inode %d failed", inode)

    @handler
    async def statfs(self, ctx: Any) -> Any:
        # The file system the store lives on: what df shows is the room new checkpoints have.
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = BLOCK
        s.f_namemax = 255
        host = await self._io(os.statvfs, self.tree.keeper.store_path)
        scale = host.f_frsize / BLOCK
        s.f_blocks = int(host.f_blocks * scale)
        s.f_bfree = int(host.f_bfree * scale)
        s.f_bavail = int(host.f_bavail * scale)
        return s

    # Extended attributes: a guest file's own under fs/, none anywhere else. Listing finds
    # none there (tar --xattrs, getfattr -d and cp -a list first, and took "not supported" for
    # an error); getxattr says "not supported", answered here without a thread. ls -l asks
    # every entry's SELinux label and POSIX ACL, and on EOPNOTSUPP stops asking for the whole
    # mount (coreutils remembers it per device), where ENODATA cost two round trips per entry
    # (1,000 checkpoints: 170 ms against 22; 5,000 guest files: 1.5 s against 0.35). So a
    # guest file without one of those says the same of that name (getfacl then says "not
    # supported", as on a file system without ACLs); its other absent names are ENODATA.
    @handler
    async def listxattr(self, inode: int, ctx: Any) -> list:
        if not self.tree.can_have_xattrs(inode):
            return []
        return await self._io(self.tree.listxattr, inode, ctx.uid == 0)

    @handler
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        if not self.tree.can_have_xattrs(inode):
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        try:
            return await self._io(self.tree.getxattr, inode, name)
        except NoSuchAttribute:
            if name not in ASKED_BY_LS:  # see above
                raise
            if name.startswith(b"system.posix_acl_") and await self._io(self._has_acl, inode):
                raise
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP) from None

    def _has_acl(self, inode: int) -> bool:
        # A file with one POSIX ACL must not say ACLs are not supported: cp -a and tar --acls
        # would then drop its default ACL, and ls the + of the files after it (QA).
        return any(n.startswith(b"system.posix_acl_")
                   for n in self.tree.listxattr(inode, privileged=True))

    @handler
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        self.tree.node(inode)
        raise pyfuse3.FUSEError(errno.EROFS)  # nothing here changes, as for every write

    @handler
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        self.tree.node(inode)
        raise pyfuse3.FUSEError(errno.EROFS)
