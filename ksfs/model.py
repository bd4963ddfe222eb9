"""Ids and records shared by every layer: frozen dataclasses and the one name check. No I/O.

Records serialise to plain JSON-able dicts with ``to_dict``/``from_dict``; ids of chunks and
manifests are 32-byte BLAKE3 digests, written as lowercase hex outside the store.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ksfs.errors import BadName

NAME_MAX = 255

EVENT_TYPES = frozenset(
    {
        "session.created",
        "session.adopted",
        "session.removing",
        "session.remove_failed",
        "session.removed",
        "checkpoint.begin",
        "checkpoint.published",
        "checkpoint.failed",
        "checkpoint.deleted",
        "restore.begin",
        "restore.done",
        "restore.failed",
        "fork.created",
        "fork.failed",
        "lineage.forked",
        "reconcile",
        "pause",
        "resume",
        "gateway.call",
        "gateway.replay",
        "budget.refused",
        "budget.set",
        "recover",
        "input.rejected",
        "fs.unreadable",
        "disk.handed_back",
    }
)


# Files a checkpoint directory shows beside its stored files, made from its record; with its
# subdirectories, names an imported file may not take.
CHECKPOINT_VIRTUAL_FILES = ("domain.xml", "meta.json", "transcript")
CHECKPOINT_RESERVED_NAMES = (*CHECKPOINT_VIRTUAL_FILES, "forks", "fs")


# Format characters that make a name show as another (bidirectional overrides and isolates,
# zero-width spaces, the BOM); the zero-width joiner stays, as emoji sequences hold it.
_INVISIBLE = frozenset("\u200b\u200c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                       "\u2060\u2066\u2067\u2068\u2069\ufeff")


def _control(c: str, new: bool) -> bool:
    """C0 control characters and DEL; for a new name also C1 controls (NEL, CSI ...) and the
    invisible formats above."""
    o = ord(c)
    return o < 0x20 or o == 0x7F or (new and (0x80 <= o <= 0x9F or c in _INVISIBLE))


def validate_name(name: str, what: str = "name", new: bool = False) -> str:
    """Return ``name`` if it can name a session, checkpoint or file; raise BadName otherwise.

    This is the one place names are checked, so no name a user writes can climb out of the
    store or the mount. ``new``: a name about to be given (a session, a checkpoint, a file
    stored) must also not hide what it is (C1 controls, bidirectional overrides, zero-width
    characters); a name only looked up need not, so the names a store made before that rule
    (2026-12-03) stay readable and removable.
    """
    if not isinstance(name, str):
        raise BadName(name=name, why=f"{what} must be text")
    if name == "":
        raise BadName(name=name, why=f"{what} is empty")
    if name in (".", ".."):
        raise BadName(name=name, why=f"{what} cannot be '.' or '..'")
    if "/" in name:
        raise BadName(name=name, why=f"{what} cannot contain '/'")
    if "\0" in name:
        raise BadName(name=name, why=f"{what} cannot contain NUL")
    if any(_control(c, False) for c in name):
        raise BadName(name=name, why=f"{what} cannot contain control characters")
    bad = next((c for c in name if _control(c, True)), None) if new else None
    if bad is not None:
        # (QA, nineteenth session: a bidirectional override was called a control character)
        raise BadName(name=name, why=f"{what} cannot contain control or invisible formatting "
                                     f"characters (U+{ord(bad):04X})")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        # shown as the bytes given (b'\xff.bin'), not Python's surrogate escapes of them
        shown = name.encode("utf-8", "surrogateescape")
        raise BadName(name=shown, why=f"{what} is not valid UTF-8") from None
    if len(encoded) > NAME_MAX:
        raise BadName(name=name[:20] + "...", why=f"{what} is longer than {NAME_MAX} bytes")
    return name


# Where the agent inside a guest writes its transcript, unless a guest.json says otherwise.
DEFAULT_TRANSCRIPT = "agent/transcript.jsonl"


# Events name a checkpoint's files, but an event body has a size limit (64 KiB, records.py) and
# a checkpoint may hold thousands of files: names past this many bytes are counted, not listed.
EVENT_NAMES_BYTES = 16 * 1024


def event_file_names(names: list[str]) -> dict[str, Any]:
    """``{"files": [...]}`` for an event body, the list cut short (with ``files_not_listed``,
    the count left out) once the names pass EVENT_NAMES_BYTES of JSON."""
    listed: list[str] = []
    used = 0
    for name in names:
        used += len(json.dumps(name)) + 2
        if used > EVENT_NAMES_BYTES:
            return {"files": listed, "files_not_listed": len(names) - len(listed)}
        listed.append(name)
    return {"files": listed}


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its manifest in the store and its sizes.

    ``size`` is the true byte size; ``stored`` the compressed bytes of chunks this file was the
    first to bring into the store (what deleting it alone could free, at most).
    ``chunking`` is ``fixed`` (64 KiB, disk images) or ``cdc`` (FastCDC, everything else).
    """

    name: str
    manifest: str  # hex BLAKE3 id of the manifest
    size: int
    stored: int = 0
    chunking: str = "cdc"
    digest: str = ""  # hex BLAKE3 of the whole file's bytes, for meta.json and cmp without reading

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileRecord:
        return cls(**d)


@dataclass(frozen=True)
class ForkPoint:
    """Where a lineage branched: the parent session, its checkpoint and the parent's seq then."""

    session: str
    checkpoint: str
    seq: int
    lineage: str = ""  # the parent's lineage id, so the chain survives the parent's removal

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ForkPoint | None:
        return None if d is None else cls(**d)


@dataclass(frozen=True)
class CheckpointRecord:
    """A published checkpoint. It exists only once the transaction that wrote it committed."""

    session: str
    name: str
    seq: int
    created: float
    files: tuple[FileRecord, ...]
    # The checkpoint this one's machine went on from: the session's last one saved or restored
    # to, or a fork's first's SESSION/CHECKPOINT; an import's: the newest before it.
    parent: str | None = None
    domain_xml: str | None = None
    # last transcript seq seen in the guest disk (-1: the transcript had no line), if read
    transcript_seq: int | None = None
    # The session's last host event when the guest froze (a live snapshot runs the guest for a
    # while after checkpoint.begin): events after it are not in the checkpoint's machine state.
    frozen_seq: int | None = None

    def file(self, name: str) -> FileRecord | None:
        for f in self.files:
            if f.name == name:
                return f
        return None

    @property
    def logical_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_bytes(self) -> int:
        return sum(f.stored for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = [f.to_dict() for f in self.files]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointRecord:
        d = dict(d)
        d["files"] = tuple(FileRecord.from_dict(f) for f in d["files"])
        return cls(**d)


@dataclass(frozen=True)
class SessionRecord:
    """A session: one lineage of one machine. ``domain`` is None for an offline session."""

    name: str
    lineage: str  # hex id, unique for ever, so a reused session name never joins an old history
    created: float
    domain: str | None = None
    parent: ForkPoint | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # Set (a time) when the session was removed but its checkpoints kept, read-only.
    removed: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["parent"] = self.parent.to_dict() if self.parent else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionRecord:
        d = dict(d)
        d["parent"] = ForkPoint.from_dict(d.get("parent"))
        return cls(**d)


@dataclass(frozen=True)
class Event:
    """One entry of a lineage's host event log. Seqs start at 0 and have no gaps."""

    seq: int
    time: float
    type: str
    body: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(**d)


@dataclass(frozen=True)
class TranscriptInfo:
    """What a guest's transcript says: the seq and lineage of its last whole line (None when it
    has none; lineage None when that line names none) and how many whole lines it has."""

    last_seq: int | None
    lineage: str | None
    count: int = 0

    @property
    def lines(self) -> int:
        return self.count

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
