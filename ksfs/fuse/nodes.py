"""The node kinds of the mount's tree: one class per path template, over the domain objects.

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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ksfs.errors import (
    AlreadyExists,
    BadInput,
    BadName,
    NoSuchCheckpoint,
    NoSuchFile,
    NoSuchSession,
    NotPermitted,
)
from ksfs.model import CheckpointRecord, validate_name

# Checkpoint contents never change once published; the kernel may cache them for ever.
FOREVER = 365 * 24 * 3600.0
# Names that come and go (sessions, checkpoints) and files that grow.
SHORT = 1.0
DYNAMIC = 0.0

DIR_MODE = 0o755
FILE_MODE = 0o444
RESUME_MODE = 0o644

# A hook for directories under a checkpoint beyond its files and forks/ (the guest's fs/ tree
# from ksfs.guestfs goes here): name -> factory(parent CheckpointDir) -> Node or None when the
# checkpoint has nothing to show under that name.
CHECKPOINT_EXTRA_DIRS: dict[str, Callable[[CheckpointDir], Node | None]] = {}


@dataclass(frozen=True)
class Attr:
    """What the kernel is told about a node; the FUSE layer turns it into EntryAttributes."""

    is_dir: bool
    mode: int
    size: int
    blocks: int
    mtime: float
    entry_timeout: float
    attr_timeout: float


class Node:
    """One object of the tree. ``key`` is its identity: equal keys are the same inode."""

    is_dir = False
    # True when attr() or children() must ask the keeper (may block); False: answered from memory.
    needs_io = False
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

    def blocks(self) -> int:
        return 0

    def attr(self) -> Attr:
        return Attr(
            self.is_dir,
            self.mode,
            self.size(),
            self.blocks(),
            self.mtime,
            self.entry_timeout,
            self.attr_timeout,
        )


class Dir(Node):
    is_dir = True
    mode = DIR_MODE

    def children(self) -> list[tuple[str, Node]]:
        """Every child, in a stable order, each with its node (attributes must be cheap)."""
        return []

    def lookup(self, name: str) -> Node:
        for n, node in self.children():
            if n == name:
                return node
        raise NoSuchFile(what="entry", name=name)

    def mkdir(self, name: str) -> Node:
        raise NotPermitted(f"nothing can be created in {self.describe()}")

    def rmdir(self, name: str) -> None:
        raise NotPermitted(f"nothing can be removed from {self.describe()}")

    def describe(self) -> str:
        return "/".join(str(k) for k in self.key)


# --- files ------------------------------------------------------------------------------------


class DynamicFile(Node):
    """A file made afresh from the ledger on every look: its size is computed at getattr."""

    needs_io = True
    entry_timeout = SHORT
    attr_timeout = DYNAMIC

    def __init__(self, keeper: Any, key: tuple, session: str | None, name: str,
                 content: Callable[[], bytes]) -> None:
        super().__init__(keeper, key, session)
        self.name = name
        self.content = content

    def size(self) -> int:
        return len(self.content())

    def attr(self) -> Attr:
        self.mtime = time.time()
        return super().attr()


class ResumeFile(DynamicFile):
    mode = RESUME_MODE

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


class StoredFile(Node):
    """A file of a checkpoint held in the chunk store: immutable, true size, blocks = own bytes."""

    def __init__(self, keeper: Any, key: tuple, session: str, checkpoint: CheckpointRecord,
                 name: str, size: int, stored: int) -> None:
        super().__init__(keeper, key, session)
        self.checkpoint = checkpoint
        self.name = name
        self._size = size
        self._stored = stored
        self.mtime = checkpoint.created

    def size(self) -> int:
        return self._size

    def blocks(self) -> int:
        return math.ceil(self._stored / 512)

    def open_reader(self) -> Any:
        reader = self.keeper.open_file(self.session, self.checkpoint.name, self.name)
        expected = self.checkpoint.file(self.name)
        if getattr(reader, "manifest", None) not in (None, expected.manifest):
            # The checkpoint was deleted and its name taken again since this node was made.
            raise NoSuchFile(what=f"file of a deleted checkpoint {self.checkpoint.name!r}",
                             name=self.name)
        return reader


class RecordFile(Node):
    """A checkpoint file made from its record (meta.json, domain.xml, transcript): immutable.

    Its bytes are built on first need and kept, since they can never change.
    """

    needs_io = True

    def __init__(self, keeper: Any, key: tuple, session: str, checkpoint: CheckpointRecord,
                 name: str) -> None:
        super().__init__(keeper, key, session)
        self.checkpoint = checkpoint
        self.name = name
        self.mtime = checkpoint.created
        self._data: bytes | None = None

    def data(self) -> bytes:
        if self._data is None:
            self._data = self.keeper.checkpoint_virtual_file(self.checkpoint, self.name)
        return self._data

    def size(self) -> int:
        return len(self.data())


# --- directories ------------------------------------------------------------------------------


class Root(Dir):
    def __init__(self, keeper: Any) -> None:
        super().__init__(keeper, ("root",))

    def children(self) -> list[tuple[str, Node]]:
        return [
            ("sessions", SessionsDir(self.keeper)),
            ("store", DynamicFile(self.keeper, ("store",), None, "store",
                                  self.keeper.store_bytes)),
        ]

    def describe(self) -> str:
        return "the mount's root"


class SessionsDir(Dir):
    needs_io = True
    entry_timeout = SHORT
    attr_timeout = SHORT

    def __init__(self, keeper: Any) -> None:
        super().__init__(keeper, ("sessions",))

    def children(self) -> list[tuple[str, Node]]:
        return [(rec.name, SessionDir(self.keeper, rec)) for rec in self.keeper.ledger.sessions()]

    def lookup(self, name: str) -> Node:
        try:
            validate_name(name)
            return SessionDir(self.keeper, self.keeper.ledger.session(name))
        except (NoSuchSession, BadName):
            raise NoSuchFile(what="session", name=name) from None

    def mkdir(self, name: str) -> Node:
        validate_name(name, "session name")
        if name in self.keeper.session_names():
            raise AlreadyExists(what="session", name=name)
        self.keeper.new_session(name)
        return self.lookup(name)

    def describe(self) -> str:
        return "sessions/"


class SessionDir(Dir):
    entry_timeout = SHORT

    def __init__(self, keeper: Any, rec: Any) -> None:
        super().__init__(keeper, ("session", rec.lineage), rec.name)
        self.lineage = rec.lineage
        self.mtime = rec.created

    def children(self) -> list[tuple[str, Node]]:
        k, s, lin = self.keeper, self.session, self.lineage

        def dyn(name: str, content: Callable[[], bytes], cls: type = DynamicFile) -> Node:
            return cls(k, (name, lin), s, name, content)

        return [
            ("status", dyn("status", lambda: k.status_bytes(s))),
            ("events", dyn("events", lambda: k.events_bytes(s))),
            ("usage", dyn("usage", lambda: k.usage_bytes(s))),
            ("resume", dyn("resume", lambda: k.resume_result(s), ResumeFile)),
            ("checkpoints", CheckpointsDir(k, lin, s)),
        ]

    def describe(self) -> str:
        return f"sessions/{self.session}/"


class CheckpointsDir(Dir):
    """Lists checkpoints from the ledger's summaries: no record's file list, no manifest."""

    needs_io = True
    entry_timeout = SHORT
    attr_timeout = SHORT

    def __init__(self, keeper: Any, lineage: str, session: str) -> None:
        super().__init__(keeper, ("checkpoints", lineage), session)
        self.lineage = lineage

    def _dir(self, name: str, seq: int, created: float) -> CheckpointDir:
        return CheckpointDir(self.keeper, self.lineage, self.session, name, seq, created)

    def children(self) -> list[tuple[str, Node]]:
        ledger = self.keeper.ledger
        if hasattr(ledger, "checkpoint_summaries"):
            return [(s.name, self._dir(s.name, s.seq, s.created))
                    for s in ledger.checkpoint_summaries(self.session)]
        return [(n, self.lookup(n)) for n in ledger.checkpoint_names(self.session)]

    def lookup(self, name: str) -> Node:
        try:
            rec = self.keeper.ledger.checkpoint(self.session, name)
        except NoSuchCheckpoint:
            raise NoSuchFile(what="checkpoint", name=name) from None
        node = self._dir(rec.name, rec.seq, rec.created)
        node.record = rec
        return node

    def mkdir(self, name: str) -> Node:
        validate_name(name, "checkpoint name")
        if name in self.keeper.ledger.checkpoint_names(self.session):
            raise AlreadyExists(what="checkpoint", name=name)
        rec = self.keeper.save(self.session, name)
        node = self._dir(rec.name, rec.seq, rec.created)
        node.record = rec
        return node

    def rmdir(self, name: str) -> None:
        validate_name(name, "checkpoint name")
        self.keeper.delete_checkpoint(self.session, name)

    def describe(self) -> str:
        return f"sessions/{self.session}/checkpoints/"


class CheckpointDir(Dir):
    """A published checkpoint. Its key holds the lineage and seq, so a later checkpoint reusing a
    deleted one's name is a new inode and no cached page of the old one can be served for it."""

    entry_timeout = SHORT  # the name may be deleted; what it names never changes

    def __init__(self, keeper: Any, lineage: str, session: str, name: str, seq: int,
                 created: float) -> None:
        super().__init__(keeper, ("checkpoint", lineage, name, seq), session)
        self.lineage = lineage
        self.name = name
        self.seq = seq
        self.mtime = created
        self.record: CheckpointRecord | None = None

    def load(self) -> CheckpointRecord:
        if self.record is None:
            rec = self.keeper.ledger.checkpoint(self.session, self.name)
            if rec.seq != self.seq:  # deleted and taken again under the same name
                raise NoSuchCheckpoint(session=self.session, checkpoint=self.name)
            self.record = rec
        return self.record

    def children(self) -> list[tuple[str, Node]]:
        rec = self.load()
        base = ("file", self.lineage, self.name, self.seq)
        out: list[tuple[str, Node]] = []
        for fname in self.keeper.checkpoint_files(rec):
            f = rec.file(fname)
            if f is not None:
                node: Node = StoredFile(self.keeper, base + (fname,), self.session, rec, fname,
                                        f.size, f.stored)
            else:
                node = RecordFile(self.keeper, base + (fname,), self.session, rec, fname)
            out.append((fname, node))
        out.append(("forks", ForksDir(self.keeper, self)))
        for name, factory in CHECKPOINT_EXTRA_DIRS.items():
            extra = factory(self)
            if extra is not None:
                out.append((name, extra))
        return out

    def describe(self) -> str:
        return f"sessions/{self.session}/checkpoints/{self.name}/"


class ForksDir(Dir):
    """Sessions forked from this checkpoint, each an empty directory; mkdir NEW forks one."""

    needs_io = True
    entry_timeout = SHORT
    attr_timeout = SHORT

    def __init__(self, keeper: Any, cp: CheckpointDir) -> None:
        super().__init__(keeper, ("forks", cp.lineage, cp.name, cp.seq), cp.session)
        self.cp = cp
        self.mtime = cp.mtime

    def children(self) -> list[tuple[str, Node]]:
        out: list[tuple[str, Node]] = []
        for rec in self.keeper.ledger.sessions():
            p = rec.parent
            if p is None or p.checkpoint != self.cp.name:
                continue
            if p.lineage and p.lineage != self.cp.lineage:
                continue
            if not p.lineage and p.session != self.cp.session:
                continue
            out.append((rec.name, ForkDir(self.keeper, rec, self.cp.session)))
        return out

    def mkdir(self, name: str) -> Node:
        validate_name(name, "session name")
        if name in self.keeper.session_names():
            raise AlreadyExists(what="session", name=name)
        self.cp.load()
        self.keeper.fork(self.cp.session, self.cp.name, name)
        return ForkDir(self.keeper, self.keeper.ledger.session(name), self.cp.session)

    def describe(self) -> str:
        return self.cp.describe() + "forks/"


class ForkDir(Dir):
    """A fork made from the checkpoint above; the new session itself lives at sessions/NEW."""

    entry_timeout = SHORT

    def __init__(self, keeper: Any, rec: Any, parent_session: str) -> None:
        super().__init__(keeper, ("fork", rec.lineage), parent_session)
        self.mtime = rec.created
        self.child = rec.name

    def describe(self) -> str:
        return f"the fork {self.child!r}"
