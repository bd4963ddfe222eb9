"""The node kinds of the mount's tree: the base classes and the files (directories: dirs.py).

Each node knows its identity key (what makes it the same object from one lookup to the next),
its attributes, and, for directories, how to list and look up its children. Nodes call the keeper
directly and may block (LMDB, the chunk store): the FUSE layer calls them from worker threads.
This module never imports pyfuse3 or trio, and never reaches below the keeper's public methods.

Templates (``S`` a session, ``C`` a checkpoint, ``F`` a file of it)::

    /                         Root
    /store                    StoreFile          dynamic
    /sessions                 SessionsDir        mkdir NAME -> keeper.new_session
    /sessions/S               SessionDir
    /sessions/S/{status,events,usage}            dynamic, read-only
    /sessions/S/resume        ResumeFile         dynamic, write -> keeper.restore
    /sessions/S/checkpoints   CheckpointsDir     mkdir -> keeper.save, rmdir -> delete_checkpoint
    /sessions/S/checkpoints/C CheckpointDir      immutable
    .../C/F                   StoredFile | RecordFile   immutable
    .../C/forks               ForksDir           mkdir NEW -> keeper.fork
    .../C/forks/NEW           ForkDir            empty; the session is sessions/NEW
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ksfs.errors import (
    BadInput,
    BadName,
    KsfsError,
    NoSuchCheckpoint,
    NoSuchFile,
    NoSuchSession,
    NotPermitted,
)
from ksfs.lru import LRU
from ksfs.model import NAME_MAX, CheckpointRecord, validate_name

# Checkpoint contents never change once published; the kernel may cache them for ever.
FOREVER = 365 * 24 * 3600.0
# Names that come and go (sessions, checkpoints) and files that grow.
SHORT = 1.0
DYNAMIC = 0.0

DIR_MODE = 0o755
FILE_MODE = 0o444
RESUME_MODE = 0o644

class Attr(NamedTuple):
    """What the kernel is told about a node; the FUSE layer turns it into EntryAttributes.

    A NamedTuple, not a frozen dataclass: one is made for every entry of a listing (a guest
    directory may hold millions), and a frozen dataclass's __init__ sets each of its twelve
    fields through object.__setattr__ (about 3x the cost)."""

    is_dir: bool
    mode: int
    size: int
    blocks: int
    mtime: float
    entry_timeout: float
    attr_timeout: float
    # The guest's own files (fs/) carry their type, owners and link count; 0/None: the defaults
    # (a directory or regular file owned by the mounting user).
    kind: int = 0
    uid: int | None = None
    gid: int | None = None
    nlink: int | None = None
    # The guest's files keep their own three times to the nanosecond; None: all are mtime.
    times_ns: tuple[int, int, int] | None = None  # (atime, mtime, ctime)
    rdev: int = 0  # a guest device node's numbers


class Node:
    """One object of the tree. ``key`` is its identity: equal keys are the same inode."""

    is_dir = False
    # True when attr() or children() must ask the keeper (may block); False: answered from memory.
    needs_io = False
    # True: dropped from the inode table once the kernel forgets it (a guest's file, which may
    # be one of millions); False: kept for the mount's life (sessions, checkpoints, records).
    forgettable = False
    # True: its inode number is drawn from its key (tree._new_ino), the same in every mount,
    # where ksfs's own nodes take a counter's: a guest's files and fs/ itself, which
    # incremental backups (tar --listed-incremental) compare across mounts.
    ino_from_key = False
    lists_lazily = False  # a directory listed part by part (children_from), not snapshotted
    mode = FILE_MODE
    entry_timeout = FOREVER
    attr_timeout = FOREVER

    def __init__(self, keeper: Any, key: tuple, session: str | None = None) -> None:
        self.keeper = keeper
        self.key = key
        self.session = session  # the session this node belongs to, for input.rejected events
        self.mtime = time.time()

    def size(self) -> int:
        return 0

    def blocks(self, size: int) -> int:
        """512-byte blocks ``stat`` reports for ``size`` bytes (asked once per getattr: a
        dynamic file builds its content to know it): never 0 for a file with bytes."""
        return blocks_for(size, size) if not self.is_dir else 0

    def attr(self) -> Attr:
        size = self.size()
        return Attr(
            self.is_dir,
            self.mode,
            size,
            self.blocks(size),
            self.mtime,
            self.entry_timeout,
            self.attr_timeout,
        )


class Dir(Node):
    is_dir = True
    mode = DIR_MODE
    # Its entries are names a user or the ledger gave (validate_name's): a lookup of any other
    # name is answered "no such entry" before the directory is asked.
    names_checked = True

    def children(self) -> list[tuple[str, Node]]:
        """Every child, in a stable order, each with its node (attributes must be cheap)."""
        return []

    def lookup(self, name: str) -> Node:
        for n, node in self.children():
            if n == name:
                return node
        raise NoSuchFile(what="entry", name=name)

    def require_current(self) -> None:
        """NoSuchFile (ENOENT) when what this directory shows is gone: removed, or its name
        taken again by another (a session of a new lineage, a checkpoint of a later seq). A
        directory a shell still sits in must then act on nothing, not on the namesake."""

    def mkdir(self, name: str) -> Node:
        raise NotPermitted(f"nothing can be created in {self.describe()}")

    def rmdir(self, name: str) -> None:
        raise NotPermitted(f"nothing can be removed from {self.describe()}")

    def describe(self) -> str:
        return "/".join(str(k) for k in self.key)


def require_lineage(keeper: Any, session: str, lineage: str) -> None:
    """NoSuchFile (ENOENT) unless ``session`` is still the session of ``lineage``: not
    removed, nor made again under its name (a node of the old one acts on nothing)."""
    try:
        rec = keeper.ledger.session(session)
    except NoSuchSession:
        rec = None
    if rec is None or rec.lineage != lineage:
        raise NoSuchFile(what="session (removed)", name=session)


# --- files ------------------------------------------------------------------------------------


class DynamicFile(Node):
    """A file made afresh from the ledger on every look: its size is computed at getattr."""

    needs_io = True
    entry_timeout = SHORT
    attr_timeout = DYNAMIC

    def __init__(self, keeper: Any, key: tuple, session: str | None, name: str,
                 content: Callable[[], bytes], append_only: bool = False) -> None:
        super().__init__(keeper, key, session)
        self.name = name
        self.content = content
        self.append_only = append_only  # grows only at its end (events): readers may follow it
        self._seen: int | None = None  # the size (append-only) or hash of the bytes last seen

    def size(self) -> int:
        data = self.content()
        # mtime (and ctime) move when the bytes do, not at every look: tar and rsync compare
        # them before and after a read and took an unchanged status for one that changed (QA:
        # `tar -c` of a session exited 1, "file changed as we read it").
        seen = len(data) if self.append_only else hash(data)
        if seen != self._seen:
            if self._seen is not None:
                self.mtime = time.time()
            self._seen = seen
        return len(data)


class ResumeFile(DynamicFile):
    mode = RESUME_MODE

    def require_current(self) -> None:
        """NoSuchFile (ENOENT) when the session this file was opened in is gone or another
        now by its name (a descriptor held across a removal): nothing is restored, and no
        event goes in the namesake's log."""
        require_lineage(self.keeper, self.session, self.key[1])

    def restore(self, data: bytes) -> None:
        """Restore the session to the checkpoint named in ``data`` (one trailing newline off)."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput("resume takes a checkpoint name in UTF-8") from None
        if text.endswith("\n"):
            text = text[:-1]
        if text == "":
            raise BadInput("resume takes a checkpoint name; nothing was written")
        validate_name(text, "checkpoint name")
        self.keeper.ledger.checkpoint(self.session, text)  # NoSuchCheckpoint -> ENOENT
        self.keeper.restore(self.session, text)

    def complete(self, data: bytes) -> bool:
        """For a name still being written (no newline yet): True when it can only be the name
        it already is (a checkpoint no longer name begins with), so it is acted on now; False
        while more may follow. Raises now what no later piece could mend: '/', NUL or a control
        character, more bytes than a name holds, or no checkpoint's name beginning so
        (ENOENT), so that even ``printf C > resume`` (one write, no newline, its close's error
        ignored by shells) hears of it from write(2)."""
        text = data.decode("utf-8", "ignore")
        if any(c in "/\0" or ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            validate_name(text, "checkpoint name")  # refuses it, saying why
        if len(data) > NAME_MAX:
            raise BadName(name=text[:20] + "...",
                          why=f"checkpoint name is longer than {NAME_MAX} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return False  # (a character cut between two writes; any other is said at the end)
        names = self.keeper.ledger.checkpoint_names(self.session)
        longer = [n for n in names if n.startswith(text) and n != text]
        if text in names:
            return not longer
        if not longer:
            raise NoSuchCheckpoint(session=self.session, checkpoint=text)
        return False


def blocks_for(held: int, size: int) -> int:
    """st_blocks for ``held`` bytes of a file of ``size``: at least 1 when the file has any
    bytes. GNU tar's --sparse (and other archivers) take a file with st_blocks 0 for one whole
    hole and store zeros without reading it, so a checkpoint file whose chunks other
    checkpoints share, a record or a guest file must never say 0."""
    return max(math.ceil(held / 512), 1 if size > 0 else 0)


class StoredFile(Node):
    """A file of a checkpoint held in the chunk store: immutable bytes and true size; blocks =
    the stored bytes no other checkpoint holds (ZFS's ``used``, keeper.exclusive_bytes), which
    move as other checkpoints come and go: the mount then invalidates the kernel's copy of
    them (fuse.mount), so their attributes can still be cached for ever."""

    needs_io = True  # blocks: reads this file's manifest (and the earlier files')
    reads_inline = True  # answered on the FUSE loop: tree.ReaderHandle says why

    def __init__(self, keeper: Any, key: tuple, session: str, checkpoint: CheckpointRecord,
                 name: str, size: int) -> None:
        super().__init__(keeper, key, session)
        self.checkpoint = checkpoint
        self.name = name
        self._size = size
        self.mtime = checkpoint.created

    def size(self) -> int:
        return self._size

    def blocks(self, size: int) -> int:
        n = self.keeper.exclusive_bytes(self.checkpoint, self.name, wait=False)
        if n is None:  # still counting every checkpoint's chunks: what this file brought in
            f = self.checkpoint.file(self.name)
            n = f.stored if f is not None else 0
        return blocks_for(n, self._size)

    def explain_missing(self, exc: Any) -> Any:
        """ESTALE when this checkpoint was deleted and collected while open; else exc."""
        return self.keeper.gone_error(self.session, self.checkpoint, self.name, exc)

    def open_reader(self) -> Any:
        reader = self.keeper.open_file(self.session, self.checkpoint.name, self.name)
        expected = self.checkpoint.file(self.name)
        if expected is None or getattr(reader, "manifest", None) not in (None, expected.manifest):
            # The checkpoint was deleted and its name taken again since this node was made.
            raise NoSuchFile(what=f"file of a deleted checkpoint {self.checkpoint.name!r}",
                             name=self.name)
        return reader


_record_bytes = LRU(32 << 20, weight=len)  # the bytes of record files, shared


class RecordFile(Node):
    """A checkpoint file made from its record (meta.json, domain.xml, transcript): immutable.

    Its bytes are built on first need and kept in a cache of bounded size shared by every
    record file (nodes live as long as the mount: each keeping its own bytes, a walk over
    every checkpoint's transcript kept them all); its size is kept for ever. The transcript is
    not built: it is as large as the guest made it, so an open reads the guest's file out of
    the checkpoint's disk a piece at a time, as ``ksfs cat`` does (built whole, an 80 MB one
    was held once per open handle and built again at every open, past the cache's bound).
    """

    needs_io = True

    def __init__(self, keeper: Any, key: tuple, session: str, checkpoint: CheckpointRecord,
                 name: str) -> None:
        super().__init__(keeper, key, session)
        self.checkpoint = checkpoint
        self.name = name
        self.mtime = checkpoint.created
        self._size: int | None = None
        self._digest: bytes | None = None  # of the first build: a rebuild must equal it

    def data(self) -> bytes:
        data = _record_bytes.get(self.key)
        if data is None:
            data = self.keeper.checkpoint_virtual_file(self.checkpoint, self.name)
            digest = hashlib.blake2b(data, digest_size=16).digest()
            if self._digest is not None and digest != self._digest:
                # built again after the cache let it go, and not as the first time (a read of
                # the guest's disk that failed now): EIO, never bytes other than those the
                # kernel may hold already, or of another size than it was told
                raise KsfsError(f"{self.name} of checkpoint {self.checkpoint.name} could not be "
                                "built again as it was")
            self._digest = digest
            _record_bytes.put(self.key, data)
        self._size = len(data)
        return data

    def reader(self) -> bytes | Any:
        """What an open reads: a record's bytes, or a reader (``size``, ``read``) of the
        guest's transcript. A transcript that reads as another size than it first did (its
        disk unreadable now) is EIO, never other bytes than the kernel may hold already."""
        if self.name != "transcript":
            return self.data()
        reader = self.keeper.transcript_reader(self.checkpoint)
        if self._size is not None and reader.size != self._size:
            raise KsfsError(f"transcript of checkpoint {self.checkpoint.name} reads as "
                            f"{reader.size} bytes where it was {self._size}")
        self._size = reader.size
        return reader

    def size(self) -> int:
        if self._size is None and self.name == "transcript":
            self.reader()
        elif self._size is None:
            self.data()
        assert self._size is not None
        return self._size

    def blocks(self, size: int) -> int:
        # 1 (not 0: blocks_for): records are small, and a transcript is a view of disk.raw,
        # whose bytes are counted there, so du of a checkpoint does not count them twice
        return blocks_for(0, size)
