"""The directories of the mount's tree, one class per path template (see nodes.py for the map).

Directories list and look up their children through the keeper's public methods, and may block
(LMDB): the FUSE layer calls them from worker threads. Never imports pyfuse3 or trio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ksfs.errors import AlreadyExists, BadName, NoSuchCheckpoint, NoSuchFile, NoSuchSession
from ksfs.fuse.nodes import (
    SHORT,
    Dir,
    DynamicFile,
    Node,
    RecordFile,
    ResumeFile,
    StoredFile,
    require_lineage,
)
from ksfs.model import CheckpointRecord, validate_name

# A hook for directories under a checkpoint beyond its files and forks/ (the guest's fs/ tree
# from ksfs.guestfs goes here): name -> factory(parent CheckpointDir) -> Node or None when the
# checkpoint has nothing to show under that name.
CHECKPOINT_EXTRA_DIRS: dict[str, Callable[[CheckpointDir], Node | None]] = {}


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
        # Removed sessions whose checkpoints were kept too: they are looked up by name, so a
        # find, tar or rsync of the mount must not pass over checkpoints the user kept (QA).
        return [(rec.name, SessionDir(self.keeper, rec))
                for rec in self.keeper.ledger.sessions(include_removed=True)]

    def lookup(self, name: str) -> Node:
        try:
            validate_name(name)
            return SessionDir(self.keeper, self.keeper.ledger.session(name))
        except (NoSuchSession, BadName):
            raise NoSuchFile(what="session", name=name) from None

    def mkdir(self, name: str) -> Node:
        validate_name(name, "session name", new=True)
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

    def require_current(self) -> None:
        require_lineage(self.keeper, self.session, self.lineage)

    def children(self) -> list[tuple[str, Node]]:
        # Checked on every listing and lookup: a shell sitting in a session removed since (or
        # made again under its name: a new lineage) finds it gone, ENOENT, as a removed
        # directory reads (QA: its files' attributes failed one by one, each an ERROR with
        # a traceback in the log).
        self.require_current()
        k, s, lin = self.keeper, self.session, self.lineage

        def dyn(name: str, content: Callable[[], bytes], cls: type = DynamicFile) -> Node:
            return cls(k, (name, lin), s, name, content)

        return [
            ("status", dyn("status", lambda: k.status_bytes(s))),
            ("events", DynamicFile(k, ("events", lin), s, "events", lambda: k.events_bytes(s),
                                   append_only=True)),
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

    def require_current(self) -> None:
        # (QA, thirty-fourth session: in a removed session's checkpoints/, with the session
        # made again, mkdir saved the new one's machine and rmdir deleted its checkpoint)
        require_lineage(self.keeper, self.session, self.lineage)

    def children(self) -> list[tuple[str, Node]]:
        self.require_current()
        ledger = self.keeper.ledger
        if hasattr(ledger, "checkpoint_summaries"):
            return [(s.name, self._dir(s.name, s.seq, s.created))
                    for s in ledger.checkpoint_summaries(self.session)]
        return [(n, self.lookup(n)) for n in ledger.checkpoint_names(self.session)]

    def lookup(self, name: str) -> Node:
        self.require_current()
        try:
            rec = self.keeper.ledger.checkpoint(self.session, name)
        except NoSuchCheckpoint:
            raise NoSuchFile(what="checkpoint", name=name) from None
        node = self._dir(rec.name, rec.seq, rec.created)
        node.record = rec
        return node

    def mkdir(self, name: str) -> Node:
        self.require_current()
        validate_name(name, "checkpoint name", new=True)
        if name in self.keeper.ledger.checkpoint_names(self.session):
            raise AlreadyExists(what="checkpoint", name=f"{self.session}/{name}")
        rec = self.keeper.save(self.session, name, lineage=self.lineage)  # (and under its lock)
        node = self._dir(rec.name, rec.seq, rec.created)
        node.record = rec
        return node

    def rmdir(self, name: str) -> None:
        self.require_current()
        validate_name(name, "checkpoint name")
        self.keeper.delete_checkpoint(self.session, name, lineage=self.lineage)

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
        self._checked_at: int | None = None  # the LMDB txn id still_published last looked at

    def load(self) -> CheckpointRecord:
        if self.record is None:
            self.record = self._published()
        return self.record

    def still_published(self) -> None:
        """NoSuchCheckpoint once this checkpoint was deleted (or its name or session taken
        again). Asked by every lookup and listing step under its ``fs/``: a shell sitting in a
        guest directory of a deleted checkpoint found its files still (QA: stale entries after
        a delete). Read again only when the store's LMDB environment has committed since the
        last look (one cheap call otherwise: guest lookups are many)."""
        txn = self.keeper.store.env.info()["last_txnid"]
        if txn != self._checked_at:
            self.record = self._published()
            self._checked_at = txn

    def _published(self) -> CheckpointRecord:
        """The record, read again; NoSuchCheckpoint once the checkpoint was deleted, its name
        taken again (a later seq) or its session made again (a new lineage, seqs anew)."""
        ledger = self.keeper.ledger
        with self.keeper.store.env.begin() as txn:
            rec = ledger.checkpoint(self.session, self.name, txn)
            lineage = ledger.session(self.session, txn).lineage
        if rec.seq != self.seq or lineage != self.lineage:
            raise NoSuchCheckpoint(session=self.session, checkpoint=self.name)
        return rec

    def require_current(self) -> None:
        try:
            self._published()
        except NoSuchCheckpoint:
            raise NoSuchFile(what="checkpoint (deleted)", name=self.name) from None

    def children(self) -> list[tuple[str, Node]]:
        # Checked on every listing and lookup: a shell sitting in a checkpoint deleted since
        # finds it empty, as a removed directory reads, not the files it had.
        rec = self.record = self._published()
        base = ("file", self.lineage, self.name, self.seq)
        out: list[tuple[str, Node]] = []
        for fname in self.keeper.checkpoint_files(rec):
            f = rec.file(fname)
            if f is not None:
                node: Node = StoredFile(self.keeper, base + (fname,), self.session, rec, fname,
                                        f.size)
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

    def require_current(self) -> None:
        self.cp.require_current()

    def children(self) -> list[tuple[str, Node]]:
        self.require_current()
        out: list[tuple[str, Node]] = []
        for rec in self.keeper.ledger.sessions(include_removed=True):
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
        # this checkpoint, not a later one by its name (QA, thirty-fourth session: a shell in
        # a deleted checkpoint's forks/ forked its namesake, in its session or a new one's)
        self.require_current()
        validate_name(name, "session name", new=True)
        if name in self.keeper.session_names():
            raise AlreadyExists(what="session", name=name)
        self.cp.load()
        self.keeper.fork(self.cp.session, self.cp.name, name, lineage=self.cp.lineage,
                         seq=self.cp.seq)
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

