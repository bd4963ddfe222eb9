"""The mount's tree without a kernel: inode numbers, open handles and every verb, over the nodes.

``CheckpointTree`` turns the path templates of ``ksfs.fuse.nodes`` into what a FUSE layer needs:
stable inode numbers, directory snapshots with stable offsets, open-file handles that hold a
reader, and the bad-input rules of the mount (each refusal recorded as an ``input.rejected``
event in the session it names). Every method may block (LMDB, the chunk store) and is safe to
call from several threads at once. It never imports pyfuse3 or trio, and never answers with an
errno: it raises ksfs.errors classes, which the FUSE layer translates in one place.

Inodes: the identity key of a node (see dirs.py: lineage ids and checkpoint seqs, never bare
names) maps to a number handed out by a counter, and numbers are never reused; a checkpoint
deleted and taken again under its old name gets a new inode, so no page the kernel cached for
the old one is ever served for the new one. Nodes of ksfs's own tree (sessions, checkpoints,
their files) stay in the table for the mount's life: one small entry each. A guest's files
under ``fs/`` (``Node.forgettable``), of which a disk may hold millions, are counted as the
kernel is told of them (lookup, readdir) and leave the table when it forgets them all; a later
lookup makes the node again from the guest's inode, under the same number (drawn from its
identity: see ``_new_ino``).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ksfs.errors import (
    AlreadyExists,
    BadInput,
    ChunkMissing,
    KsfsError,
    NoSuchAttribute,
    NoSuchFile,
    NotFound,
    NotPermitted,
    NotRunning,
    ReadOnly,
    StoppedWhileSaved,
)
from ksfs.fuse import guest as _guest_fs_dir  # noqa: F401  (registers fs/ under checkpoints)
from ksfs.fuse.dirs import CheckpointDir, Root, SessionsDir
from ksfs.fuse.nodes import (
    Attr,
    Dir,
    DynamicFile,
    Node,
    RecordFile,
    ResumeFile,
    StoredFile,
)
from ksfs.model import validate_name

log = logging.getLogger(__name__)

UNKNOWN = Attr(False, 0o444, 0, 0, 0.0, 0.0, 0.0)

ROOT_INODE = 1
GUEST_INO_BASE = 1 << 62  # guest files' numbers: above any the counter reaches
READERS_KEPT = 4  # readers kept for re-opens; each holds up to 32 MiB of decompressed chunks

REFUSALS_EVERY = 1.0  # seconds between input.rejected events of one checkpoint's fs/

# The refusals that are the user's bad input, worth an input.rejected event in the session.
# NotRunning: a save (mkdir checkpoints/C) asked of a machine that is shut off or crashed;
# it keeps its own errno, ESRCH (docs/mount.md, "Errors"). Not StoppedWhileSaved, its subclass:
# a machine that stopped during a save was asked rightly, and the save has its own events.
_REJECTIONS = (BadInput, NotFound, AlreadyExists, NotPermitted, ReadOnly, NotRunning)


class Entry(NamedTuple):
    """A directory entry as listed: name, inode and attributes (one per entry of a listing)."""

    name: str
    ino: int
    attr: Attr


class Handle:
    """An open file. ``needs_io``: reads may block; ``keep_cache``/``direct_io``: kernel caching."""

    needs_io = True
    keep_cache = True
    direct_io = False

    def read(self, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def write(self, offset: int, data: bytes) -> int:
        raise ReadOnly(what="this file")


class ReaderHandle(Handle):
    """A stored checkpoint file: reads go to the store's thread-safe random-access reader.

    With ``inline`` its READs are answered on the FUSE loop's own thread, as borg mount answers
    all of its own: a READ decodes at most one request's chunks (1 MiB and a chunk either side)
    from packs, takes no lock that a verb holds for long, and never waits on the loop. Measured
    on fresh mounts, alternating (docs/mount.md, "Performance"), this answers a first ``cat``
    ~1.5x faster than handing each READ to a worker thread, whose two hand-offs per request cost
    more than the decode they overlap. The price: other requests wait for the READ in progress
    (about a millisecond with the packs in page cache). Readers that may wait longer (a guest
    file's, which shares its filesystem's caches and locks with listings) keep the thread.
    """

    def __init__(self, reader: Any, inline: bool,
                 explain: Callable[[KsfsError], KsfsError] | None = None) -> None:
        self.reader = reader
        self.needs_io = not inline
        self._readinto = getattr(reader, "readinto", None)  # stored files have it
        # A missing chunk may mean the checkpoint was deleted and collected while open
        # (ESTALE, not damage): ``explain`` says which (keeper.gone_error).
        self._explain = explain

    def read(self, offset: int, size: int) -> bytes | bytearray:
        end = min(offset + size, self.reader.size)
        if offset >= end:
            return b""
        try:
            if self._readinto is None:
                return self.reader.read(offset, end - offset)
            # Decoded straight into the reply: a fresh bytearray is zeros, so holes cost
            # nothing and raw chunks are read from their packs into it (FileReader.readinto).
            buf = bytearray(end - offset)
            self._readinto(offset, buf, zeroed=True)
            return buf
        except ChunkMissing as exc:
            if self._explain is None:
                raise
            raise self._explain(exc) from None


class BytesHandle(Handle):
    """A checkpoint file built from its record: fixed bytes, answered from memory."""

    needs_io = False

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, offset: int, size: int) -> bytes:
        return self.data[offset : offset + size]


class DynamicHandle(Handle):
    """A file that grows (events, status, ...): a snapshot taken at open, refreshed when a read
    reaches its end, so ``cat`` sees one consistent copy and ``tail -f`` sees growth."""

    keep_cache = False
    direct_io = True

    def __init__(self, node: DynamicFile) -> None:
        self.node = node
        self.data = node.content()

    def read(self, offset: int, size: int) -> bytes:
        # Only a log that grows by appending may be refreshed mid-read: a file rewritten whole
        # (status, usage) refreshed at its end would splice the tail of a newer copy onto the
        # older one. Those are one snapshot per open.
        if offset >= len(self.data) and self.node.append_only:
            try:
                self.data = self.node.content()
            except NotFound:
                pass  # its session was removed meanwhile: the log as it was, and its end (QA)
        return self.data[offset : offset + size]


class ResumeHandle(DynamicHandle):
    """``resume`` opened. A read says the last result. What is written is one checkpoint name,
    acted on once per open, at the write that completes it: one that ends it with a newline
    (``echo C > resume``), or one after which it can only be the name it is (a checkpoint that
    no longer name begins with: ``printf C > resume``). So the errno of a bad name comes back
    from write(2), which shells report (they ignore close(2)'s). A name that is still the
    beginning of another's when the writer closes is acted on at that close (flush), whose
    close(2) answers the errno. Pieces must come in order from the start (or from where the
    first write of an ``O_APPEND`` open landed): a write at any other offset, or after the name
    was acted on (but for its newline), is EINVAL, never a second restore (QA: a name written
    in two pieces restored twice, the first time to its first piece)."""

    def __init__(self, node: ResumeFile, writable: bool, readable: bool,
                 appending: bool = False) -> None:
        self.node = node
        self.data = node.content() if readable else b""
        self.written = bytearray()
        self.start: int | None = None if appending else 0  # offset of the name's first byte
        self.acted = False  # the name was acted on (restored, or refused)
        # What refused this open's name: every later write answers it again, without another
        # event (a writer retries what failed: Python's close flushes its buffer once more,
        # and took "one name per open" for the answer to a name that does not exist)
        self.refusal: KsfsError | None = None
        self.lock = threading.Lock()

    def take(self, offset: int, data: bytes) -> bytes | None:
        """Add a written piece; the whole name once it is complete, to act on now. Any refusal
        ends this open's say: nothing written to it is acted on afterwards."""
        try:
            if self.start is None:
                self.start = offset
            in_order = offset == self.start + len(self.written)
            if self.acted:
                if in_order and data == b"\n" and not self.written.endswith(b"\n"):
                    self.written += data  # the newline of a name acted on without it
                    return None
                raise BadInput("resume takes one checkpoint name per open, and this one's was "
                               "already written: open it again for another")
            if not in_order:
                raise BadInput(f"resume takes a checkpoint name written from its start, in "
                               f"order: a write at offset {offset} (expected "
                               f"{self.start + len(self.written)})")
            self.written += data
            if self.written.endswith(b"\n") or self.node.complete(bytes(self.written)):
                return self.pending()
            return None
        except KsfsError:
            self.acted = True
            raise

    def pending(self) -> bytes | None:
        """The name written and not yet acted on, which acting now takes; else None."""
        if self.acted or not self.written:
            return None
        self.acted = True
        return bytes(self.written)

    def write(self, offset: int, data: bytes) -> int:
        raise AssertionError("CheckpointTree.write handles resume")


class CheckpointTree:
    """Inode and handle tables over the nodes of one keeper; see the module docstring."""

    def __init__(self, keeper: Any, open_reader: Callable[[StoredFile], Any] | None = None) -> None:
        self.keeper = keeper
        # How a stored file is opened; tests put a failing reader here (ksfs.fuse.faults).
        self.open_reader = open_reader or (lambda node: node.open_reader())
        self._lock = threading.Lock()
        self._ino_of: dict[tuple, int] = {}
        self._nodes: dict[int, Node] = {}
        # Names from the root of ksfs's own nodes; a guest file (forgettable: a disk may hold
        # millions) keeps only its parent's inode and its name, its path made when asked.
        self._paths: dict[int, tuple[str, ...]] = {}
        self._parent_of: dict[int, tuple[int, str]] = {}
        self._lookups: dict[int, int] = {}  # forgettable inode -> times the kernel was told
        self._next_ino = ROOT_INODE
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._readers: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._told: dict[tuple[str, str], float] = {}  # (session, checkpoint) -> last fs/ refusal
        self._intern(Root(keeper), None, "")

    # --- inodes -------------------------------------------------------------------------------

    def _intern(self, node: Node, parent: int | None, name: str, counted: bool = False) -> int:
        """The inode of ``node``, named ``name`` in directory ``parent`` (None: the root), a new
        number for a node not known yet. ``counted``: the kernel is being told of it (a
        lookup's or readdir's reply): one more it must forget."""
        with self._lock:
            ino = self._intern_locked(node, parent, name)
            if counted:
                self._count_locked(ino, node)
            return ino

    def _count_locked(self, ino: int, node: Node) -> None:
        if node.forgettable:  # the others stay for the mount's life: no count to keep
            self._lookups[ino] = self._lookups.get(ino, 0) + 1

    def forget(self, ino: int, n: int) -> None:
        """The kernel forgot ``n`` of the times it was told of ``ino`` (or a reply that would
        have told it was not sent); a forgettable node it no longer knows leaves the table."""
        with self._lock:
            left = self._lookups.get(ino, 0) - n
            if left > 0:
                self._lookups[ino] = left
                return
            self._lookups.pop(ino, None)
            node = self._nodes.get(ino)
            if node is None or not node.forgettable:
                return
            del self._nodes[ino]
            self._paths.pop(ino, None)
            self._parent_of.pop(ino, None)
            if self._ino_of.get(node.key) == ino:
                del self._ino_of[node.key]

    def _intern_locked(self, node: Node, parent: int | None, name: str) -> int:
        ino = self._ino_of.get(node.key)
        if ino is None:
            ino = self._new_ino(node)
            self._ino_of[node.key] = ino
            self._nodes[ino] = node
            if node.forgettable and parent is not None:
                self._parent_of[ino] = (parent, name)
            else:
                self._paths[ino] = () if parent is None else self._path(parent) + (name,)
        else:
            old = self._nodes[ino]
            # Keep the node already known (it holds what was loaded for it), adding a record
            # the newer one may carry.
            if isinstance(old, CheckpointDir) and old.record is None:
                old.record = getattr(node, "record", None)
        return ino

    def _new_ino(self, node: Node) -> int:
        """A counter's next number; for a guest's file, a number drawn from its identity (the
        checkpoint's lineage and seq and the guest's inode) in [2**62, 2**63), so it gets the
        same number when it is looked up again after the kernel forgot it, and in the next
        mount: incremental backups (tar --listed-incremental, rsync -H) see the same file. A
        number taken (two identities hashing alike) gives way to the next free one."""
        if not node.ino_from_key:
            ino = self._next_ino
            self._next_ino += 1
            return ino
        digest = hashlib.blake2b(repr(node.key).encode(), digest_size=8).digest()
        ino = GUEST_INO_BASE | (int.from_bytes(digest, "big") & (GUEST_INO_BASE - 1))
        while ino in self._nodes:
            ino = GUEST_INO_BASE | ((ino + 1) & (GUEST_INO_BASE - 1))
        return ino

    def node(self, ino: int) -> Node:
        try:
            return self._nodes[ino]
        except KeyError:
            raise NoSuchFile(what="inode", name=str(ino)) from None

    def known_inodes(self, path: tuple[str, ...]) -> list[int]:
        """Every inode the kernel was given for ``path`` (names from the root): more than one
        when what it names was removed and made again (a session of a new lineage)."""
        with self._lock:
            return [ino for ino, p in self._paths.items() if p == path]

    def stored_file_inodes(self) -> list[int]:
        """The inodes of every checkpoint file held in the store that the kernel was told of."""
        with self._lock:
            # not guest files (a StoredFile subclass): their blocks are the guest's own
            return [ino for ino, node in self._nodes.items() if type(node) is StoredFile]

    def _path(self, ino: int) -> tuple[str, ...]:
        """The names from the root to ``ino`` (empty for the root, and for an inode not known)."""
        path = self._paths.get(ino)
        if path is not None:
            return path
        names: list[str] = []
        while True:
            link = self._parent_of.get(ino)
            if link is None:
                return ()
            ino, name = link
            names.append(name)
            path = self._paths.get(ino)
            if path is not None:
                return path + tuple(reversed(names))

    def path(self, ino: int) -> str:
        return "/".join(self._path(ino))

    def _dir(self, ino: int) -> Dir:
        node = self.node(ino)
        if not isinstance(node, Dir):
            raise NotPermitted(f"{self.path(ino)} is not a directory")
        return node

    def attr(self, ino: int) -> Attr:
        return self.node(ino).attr()

    def lookup(self, parent: int, name: str, counted: bool = False) -> Entry:
        if name in (".", ".."):  # asked for by the kernel (export_support): counted as well
            if name == ".":
                entry = Entry(name, parent, self.attr(parent))
            else:
                entry = self._walk(self._path(parent)[:-1], name)
            if counted:
                with self._lock:
                    node = self._nodes.get(entry.ino)
                    if node is not None:
                        self._count_locked(entry.ino, node)
            return entry
        pdir = self._dir(parent)
        if pdir.names_checked:
            try:
                validate_name(name)
            except BadInput:
                # Nothing the ledger keeps has such a name (a guest's own files may: fs/).
                raise NoSuchFile(what="entry", name=repr(name)) from None
        node = pdir.lookup(name)
        ino = self._intern(node, parent, name, counted)
        try:
            # the node already known holds what was loaded for it (a forgotten one: this one)
            return Entry(name, ino, self._nodes.get(ino, node).attr())
        except BaseException:
            if counted:  # no reply: the kernel is not told of it
                self.forget(ino, 1)
            raise

    def _walk(self, path: tuple[str, ...], name: str) -> Entry:
        ino = ROOT_INODE
        for part in path:
            ino = self.lookup(ino, part).ino
        return Entry(name, ino, self.attr(ino))

    def listdir(self, ino: int, dots: bool = False, children: bool = True) -> list[Entry]:
        """A snapshot of a directory, in a stable order; offsets into it stay valid. With
        ``dots``, ``.`` and ``..`` first, as ``ls -a`` and ``readdir(3)`` users expect; without
        ``children``, only those."""
        parent = self._dir(ino)
        out = [Entry(".", ino, parent.attr()), self.lookup(ino, "..")] if dots else []
        for name, node in parent.children() if children else ():
            child = self._intern(node, ino, name)
            try:
                attr = self._nodes[child].attr()
            except NotFound as exc:
                # gone since the directory named it (a session removed, a checkpoint deleted):
                # left out, as it would be from a listing taken a moment later; no traceback
                log.debug("%s/%s vanished while listing: %s", self.path(ino), name, exc)
                continue
            except Exception:
                # One entry that cannot be described (a view whose source is damaged or
                # missing) must not hide the rest of the directory: list it with a placeholder
                # the kernel may not keep, so a stat of it asks again and answers its own error.
                log.exception("cannot describe %s/%s while listing", self.path(ino), name)
                attr = UNKNOWN
            out.append(Entry(name, child, attr))
        return out

    def lists_lazily(self, ino: int) -> bool:
        """Whether ``ino`` is listed part by part (opendir asks, so a directory gone since it
        was looked up, a deleted checkpoint's guest directory, is ENOENT there)."""
        d = self._dir(ino)
        if d.lists_lazily:
            d.check()  # type: ignore[attr-defined]
        return d.lists_lazily

    def entries_from(self, ino: int, after: int, limit: int) -> list[tuple[Entry, int]]:
        """Up to ``limit`` entries of the lazily listed directory ``ino`` past cookie ``after``,
        each with its cookie, as read (a guest directory of millions shows its first names at
        once). Each is counted as told to the kernel: give back with ``forget(ino, 1)`` those
        not sent."""
        d = self._dir(ino)
        read: list[tuple[str, Node, int]] = []
        for name, node, cookie in d.children_from(after):  # type: ignore[attr-defined]
            read.append((name, node, cookie))
            if len(read) >= limit:
                break
        # one lock for the step, not one for each entry
        told: list[tuple[str, int, Node, int]] = []
        with self._lock:
            for name, node, cookie in read:
                child = self._intern_locked(node, ino, name)
                self._count_locked(child, node)
                told.append((name, child, node, cookie))
        try:
            return [(Entry(name, child, node.attr()), cookie)
                    for name, child, node, cookie in told]
        except BaseException:
            for _, child, _, _ in told:  # none of them reaches the kernel
                self.forget(child, 1)
            raise

    # --- verbs --------------------------------------------------------------------------------

    def _session_file(self, parent: int, name: str) -> tuple[str | None, str]:
        """The session a path names and the path below it, for input.rejected events."""
        parts = self._path(parent) + (name,)
        if len(parts) >= 2 and parts[0] == "sessions":
            return parts[1], "/".join(parts[2:]) or parts[1]
        return None, "/".join(parts)

    def _rejecting(self, session: str | None, file: str, value: str, fn: Callable[[], Any],
                   **about: str) -> Any:
        try:
            return fn()
        except _REJECTIONS as exc:
            if isinstance(exc, StoppedWhileSaved):
                raise
            if self._tell_refusal(session, file):
                self.keeper.reject(session, file, value, str(exc), **about)
            raise

    def _tell_refusal(self, session: str | None, file: str) -> bool:
        """Whether a refusal gets its event. Under a checkpoint's ``fs/``, at most one a second
        for each checkpoint: an `rm -rf` or `cp -r` over a guest tree is refused once for each
        of its files, and a guest's millions would each have added an event (QA: 3,073 in one
        `rm -rf`). Every one still gets its errno."""
        head, sep, _ = file.partition("/fs/")
        if session is None or not (sep or file.endswith("/fs")):
            return True
        key, now = (session, head if sep else file), time.monotonic()
        with self._lock:
            if now - self._told.get(key, -REFUSALS_EVERY) < REFUSALS_EVERY:
                return False
            self._told[key] = now
            if len(self._told) > 4096:  # old ones: told long ago, or as good as
                self._told = {k: t for k, t in self._told.items() if now - t < REFUSALS_EVERY}
            return True

    def mkdir(self, parent: int, name: str) -> Entry:
        pdir = self._dir(parent)
        pdir.require_current()  # (gone: ENOENT, and no event in a namesake's log)
        session, file = self._session_file(parent, name)
        if isinstance(pdir, SessionsDir) and name in self._safe_session_names():
            session = name  # mkdir of an existing session names that session
        node = self._rejecting(session, file, name, lambda: pdir.mkdir(name))
        ino = self._intern(node, parent, name)
        return Entry(name, ino, self._nodes[ino].attr())

    def _safe_session_names(self) -> list[str]:
        try:
            return self.keeper.session_names()
        except KsfsError:
            return []

    def rmdir(self, parent: int, name: str) -> None:
        pdir = self._dir(parent)
        pdir.require_current()
        session, file = self._session_file(parent, name)
        self._rejecting(session, file, name, lambda: pdir.rmdir(name))

    def refuse(self, parent: int, name: str, verb: str) -> None:
        """Refuse a verb the tree never allows (create, mknod, unlink, rename...) with EPERM;
        ENOENT in a directory whose session or checkpoint is gone (QA, thirty-fourth session:
        `echo x > resume` in a removed session's directory was refused in the log of the
        session made again under its name)."""
        parent_node = self.node(parent)
        if isinstance(parent_node, Dir):
            parent_node.require_current()
        session, file = self._session_file(parent, name)

        def no() -> None:
            raise NotPermitted(f"{verb} is not allowed here: {file}")

        self._rejecting(session, file, name, no)

    def refuse_setattr(self, ino: int, truncate_only: bool) -> Attr:
        """Truncating ``resume`` is part of ``echo C > resume``; every other change is refused."""
        node = self.node(ino)
        if isinstance(node, ResumeFile) and truncate_only:
            return node.attr()
        parts = self._path(ino)
        session = parts[1] if len(parts) >= 2 and parts[0] == "sessions" else None

        def no() -> None:
            if isinstance(node, ResumeFile):  # (writable, so "read-only" misled: QA)
                raise ReadOnly(what=f"{'/'.join(parts)}'s size, mode, owner and times (only "
                                    "a checkpoint's name may be written into it)")
            raise ReadOnly(what="/".join(parts) or "the mount's root")

        # (a chmod or touch of resume is not a write of it: what reading resume says stays)
        return self._rejecting(session, "/".join(parts[2:]) or "/".join(parts), "", no,
                               change="attributes")

    # --- open files ---------------------------------------------------------------------------

    def open(self, ino: int, flags: int) -> tuple[int, Handle]:
        node = self.node(ino)
        writing = (flags & os.O_ACCMODE) != os.O_RDONLY or bool(flags & os.O_TRUNC)
        if isinstance(node, Dir):
            raise NotPermitted(f"{self.path(ino)} is a directory")
        if isinstance(node, ResumeFile):
            handle: Handle = ResumeHandle(
                node, writing, (flags & os.O_ACCMODE) != os.O_WRONLY,
                appending=bool(flags & os.O_APPEND),
            )
        elif writing:
            parts = self._path(ino)
            session = parts[1] if len(parts) >= 2 and parts[0] == "sessions" else None

            def no() -> None:
                raise ReadOnly(what="/".join(parts))

            self._rejecting(session, "/".join(parts[2:]) or "/".join(parts), "", no)
            raise AssertionError("unreachable")
        elif isinstance(node, StoredFile):
            handle = ReaderHandle(self._reader(node), inline=node.reads_inline,
                                  explain=node.explain_missing)
        elif isinstance(node, RecordFile):
            what = node.reader()
            handle = BytesHandle(what) if isinstance(what, bytes) else \
                ReaderHandle(what, inline=False)
        elif isinstance(node, DynamicFile):
            handle = DynamicHandle(node)
        else:
            raise NotPermitted(f"{self.path(ino)} cannot be opened")
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = handle
        return fh, handle

    def _reader(self, node: StoredFile) -> Any:
        # Readers are thread-safe and their files immutable: share one per file across opens.
        with self._lock:
            reader = self._readers.get(node.key)
            if reader is not None:
                self._readers.move_to_end(node.key)
                return reader
        reader = self.open_reader(node)
        with self._lock:
            self._readers[node.key] = reader
            while len(self._readers) > READERS_KEPT:
                self._readers.popitem(last=False)
        return reader

    # Extended attributes: a guest file's own (fs/), none anywhere else.
    def can_have_xattrs(self, ino: int) -> bool:
        """Whether the node is a guest file (NoSuchFile for an inode the tree does not know)."""
        return hasattr(self.node(ino), "xattr")

    def listxattr(self, ino: int, privileged: bool) -> list[bytes]:
        node = self.node(ino)
        names = node.xattr_names() if hasattr(node, "xattr") else []
        # trusted.* only for root, as the kernel's own file systems list them
        return [n for n in names if privileged or not n.startswith(b"trusted.")]

    def getxattr(self, ino: int, name: bytes) -> bytes:
        node = self.node(ino)
        value = node.xattr(name) if hasattr(node, "xattr") else None
        if value is None:
            raise NoSuchAttribute(path=self.path(ino), name=os.fsdecode(name))
        return value

    def readlink(self, ino: int) -> bytes:
        node = self.node(ino)
        if not hasattr(node, "target"):
            raise BadInput(f"{self.path(ino)} is not a symbolic link")
        return node.target()

    def handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise NoSuchFile(what="open file", name=str(fh)) from None

    def read(self, fh: int, offset: int, size: int) -> bytes:
        return self.handle(fh).read(offset, size)

    def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.handle(fh)
        if isinstance(handle, ResumeHandle):
            handle.node.require_current()
            with handle.lock:
                if handle.refusal is not None:
                    raise handle.refusal
                name = self._resume_step(handle, lambda: handle.take(offset, data),
                                         bytes(handle.written) + data)
                if name is not None:
                    self._resume_step(handle, lambda: handle.node.restore(name), name)
            return len(data)
        return handle.write(offset, data)

    def _resume_step(self, handle: ResumeHandle, fn: Callable[[], Any], value: bytes) -> Any:
        text = value.decode("utf-8", "replace")
        text = text[:-1] if text.endswith("\n") else text  # as restore reads it
        try:
            return self._rejecting(handle.node.session, "resume", text, fn)
        except KsfsError as exc:
            handle.refusal = exc
            raise

    def pending(self, fh: int) -> bool:
        """Whether ``fh`` is ``resume`` with a name written and not yet acted on (one written
        without its newline): flush or release acts on it."""
        handle = self._handles.get(fh)
        return isinstance(handle, ResumeHandle) and not handle.acted and bool(handle.written)

    def flush(self, fh: int) -> None:
        """A close of ``fh``: a name written to ``resume`` without a newline is acted on now,
        and its error is close(2)'s."""
        handle = self._handles.get(fh)
        if not isinstance(handle, ResumeHandle):
            return
        with handle.lock:
            name = handle.pending()
            if name is not None:
                handle.node.require_current()
                self._resume_step(handle, lambda: handle.node.restore(name), name)

    def release(self, fh: int) -> None:
        try:
            self.flush(fh)  # (flush normally came first; nobody is left to tell of an error)
        except KsfsError as exc:
            log.info("write to resume refused at its release: %s", exc)  # its event says it too
        finally:
            with self._lock:
                self._handles.pop(fh, None)

    def open_handles(self) -> int:
        return len(self._handles)
