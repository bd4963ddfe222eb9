"""Read-only views the mount and the CLI show: status, events, meta.json, store figures, usage.

Each returns bytes ready to serve as a file, built from the ledger on demand (cheap: no manifest is
loaded to list or describe a checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ksfs.errors import IntegrityError, KsfsError
from ksfs.keeper.activity import Activity
from ksfs.keeper.holdings import ChunkHolders
from ksfs.keeper.offline import is_disk_image
from ksfs.model import (
    CHECKPOINT_VIRTUAL_FILES,
    DEFAULT_TRANSCRIPT,
    CheckpointRecord,
    Event,
    FileRecord,
)

log = logging.getLogger(__name__)

EVENT_LOGS_KEPT = 64  # lineages whose rendered event log is kept between stats
GUEST_DISKS_KEPT = 1024  # multi-disk checkpoints whose guest disk choice is remembered


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _event_line(e: Event) -> bytes:
    return (json.dumps(e.to_dict(), sort_keys=True) + "\n").encode()


def _answer_line(text: str) -> bytes:
    """``text`` as the one line ``resume`` answers: whitespace runs (the newlines of QEMU's
    messages in a failure reason) made one space, other unprintable characters (NUL, a
    surrogate escape of an undecodable file name, which cannot be encoded) written as escapes."""
    text = " ".join(text.split())
    return ("".join(c if c.isprintable() else repr(c)[1:-1] for c in text) + "\n").encode()


# The chunk cache of a store reader under a guest filesystem (the mount keeps a few open,
# fuse.guest.FS_KEPT): guest metadata and files are read a few KiB at a time.
GUEST_READER_CACHE = 8 << 20


class EventLogView:
    """A lineage's ``events`` file and ``resume`` answer, brought up to date by reading only the
    events after the last one seen: a lineage's log is append-only and gapless, and the mount
    asks for both at every getattr (their sizes must be true), which for a long-running session
    would otherwise re-read and re-render its whole log each time."""

    def __init__(self) -> None:
        self.next_seq = 0
        self.data = b""
        self.resume = b"none\n"
        self.lock = threading.Lock()  # one catch-up at a time: two would append events twice

    def catch_up(self, events: Any) -> None:
        """Append ``events`` (those from ``next_seq`` on). Nothing is kept unless all of them
        were read, so a failed read cannot leave a hole that later catch-ups would skip."""
        next_seq, resume, lines = self.next_seq, self.resume, []
        for e in events:
            if e.seq != next_seq and (lines or self.data):
                raise IntegrityError(f"event log of lineage has seq {e.seq} where {next_seq} "
                                     "was expected")
            lines.append(_event_line(e))
            next_seq = e.seq + 1
            if e.type in ("restore.done", "restore.failed"):
                word = "ok" if e.type == "restore.done" else "failed"
                text = f"{word} {e.body.get('checkpoint', '')} seq={e.seq}"
                if e.type == "restore.failed":
                    text += f": {e.body.get('reason', '')}"
                resume = _answer_line(text)
            elif e.type == "input.rejected" and e.body.get("file") == "resume" and \
                    "change" not in e.body:  # a write of it, not a chmod or touch
                resume = _answer_line(f"rejected: {e.body.get('why', '')}")
        if lines:
            self.data += b"".join(lines)
            self.next_seq, self.resume = next_seq, resume


class Views:
    def _init_views(self) -> None:
        # (session, checkpoint, seq) -> the disk holding its transcript ("": none), for
        # checkpoints with several disks: found once, by opening their filesystems
        self._guest_disks: OrderedDict[tuple, str] = OrderedDict()
        self._guest_disks_lock = threading.Lock()
        self._event_logs: OrderedDict[str, EventLogView] = OrderedDict()
        self._event_logs_lock = threading.Lock()
        self._holders = ChunkHolders(self.store, self.ledger)
        self._checkpoint_listeners: list[Callable[[str, str | None], None]] = []
        self._checkpoint_settlers: list[Callable[[], object]] = []
        self._fs_rejected: set[tuple] = set()  # (session, checkpoint, lineage, seq) told once
        self.activity = Activity()

    def on_checkpoint_change(self, listener: Callable[[str, str | None], None],
                             settle: Callable[[], object] | None = None
                             ) -> Callable[[], None]:
        """Call ``listener(session, checkpoint)`` after this keeper publishes or deletes a
        checkpoint, and ``listener(session, None)`` after it removes a session (the mount drops
        the kernel's cached entry for that name at once); ``settle`` waits until what the
        listener started is done (``settle_checkpoint_changes``). Returns what stops both."""
        self._checkpoint_listeners.append(listener)
        if settle is not None:
            self._checkpoint_settlers.append(settle)

        def stop() -> None:
            self._checkpoint_listeners.remove(listener)
            if settle is not None:
                self._checkpoint_settlers.remove(settle)
        return stop

    def settle_checkpoint_changes(self) -> None:
        """Wait until the listeners are done with the changes told so far: called after a verb
        asked for through the daemon's control socket, outside every lock the verb took, so its
        caller sees the names it changed as they are now."""
        for settle in list(self._checkpoint_settlers):
            try:
                settle()
            except Exception:  # the verb is done: its answer must not fail for this
                log.exception("waiting for the checkpoint listeners failed")

    def checkpoint_changed(self, session: str, checkpoint: str | None) -> None:
        """Tell the listeners that ``checkpoint`` of ``session`` was published or deleted
        (also by another process on this store: ``ksfs import`` says so to the daemon)."""
        for listener in self._checkpoint_listeners:
            try:
                listener(session, checkpoint)
            except Exception:  # a listener's failure must not fail the verb that committed
                log.exception("checkpoint listener failed for %s/%s", session, checkpoint)

    def exclusive_bytes(self, record: CheckpointRecord, name: str, wait: bool = True
                        ) -> int | None:
        """The stored bytes of a checkpoint's file that no other checkpoint holds (what
        deleting this checkpoint alone frees of it): the mount's st_blocks. Without ``wait``,
        None while the count of every checkpoint's chunks is first being built (on a thread
        of its own: seconds for a large store)."""
        return self._holders.exclusive_bytes(record, name, wait=wait)

    def holdings_version(self) -> int | None:
        """A number that moves whenever some file's exclusive_bytes may have; None while no
        one has asked for any (nothing to bring up to date)."""
        return self._holders.poll()

    def session_names(self) -> list[str]:
        return [s.name for s in self.ledger.sessions()]

    def status(self, session: str) -> dict[str, Any]:
        rec = self.ledger.session(session)
        latest = self.ledger.latest_checkpoint(session)
        state = "offline"
        held = None
        if rec.removed is not None:
            state = "removed"  # kept checkpoints only: no machine to ask about
        elif rec.domain:
            state = self.machine_state(session)
            # The checkpoint its disks were last at: the last save, or the checkpoint a restore
            # (or the fork) went to; after a restore the newest checkpoint is the save-first,
            # which is not where the machine is.
            with contextlib.suppress(KsfsError):
                held = self.vm.holds_checkpoint(session)
        return {
            "session": rec.name,
            "lineage": rec.lineage,
            "domain": rec.domain,
            "state": state,
            "seq": self.ledger.last_seq(session),
            "last_checkpoint": latest.name if latest else None,
            "running_from": held,
            # (QA: running_from named a checkpoint deleted since, as if it were there)
            "running_from_deleted": self._held_deleted(session, held),
            "parent": rec.parent.to_dict() if rec.parent else None,
            "doing": self.activity.of(session),
        }

    def _held_deleted(self, session: str, held: str | None) -> bool | None:
        """Whether the checkpoint ``held`` (running_from) was deleted since, or its name is now
        a later checkpoint's; None when nothing is held."""
        if held is None:
            return None
        from ksfs.keeper.machine import parse_label

        try:
            label = getattr(self.vm, "held_label", lambda s: None)(session)
        except KsfsError:
            label = None
        parsed = parse_label(label) or parse_label(held)
        if parsed is None:
            return None
        owner, name, lineage, seq = parsed
        rec, now = self._labelled(owner, name)
        if rec is None:  # the checkpoint, or its whole session, is gone
            return True
        return (seq is not None and rec.seq != seq) or (lineage is not None and now != lineage)

    def status_bytes(self, session: str) -> bytes:
        return _json_bytes(self.status(session))

    def events_bytes(self, session: str, since: int = 0) -> bytes:
        if since:
            return b"".join(_event_line(e) for e in self.ledger.events(session, since))
        return self._event_log(session).data

    def _event_log(self, session: str) -> EventLogView:
        """The session's lineage's view, caught up with the ledger (see EventLogView)."""
        lineage = self.ledger.session(session).lineage
        with self._event_logs_lock:  # the table only: a long first catch-up blocks no other log
            view = self._event_logs.pop(lineage, None) or EventLogView()
            self._event_logs[lineage] = view
            while len(self._event_logs) > EVENT_LOGS_KEPT:
                self._event_logs.popitem(last=False)
        with view.lock:
            view.catch_up(self.ledger.lineage_events(lineage, view.next_seq))
        return view

    def usage(self, session: str) -> dict[str, Any]:
        self.ledger.session(session)
        if self.gateway is not None:
            return self.gateway.usage(session)
        from ksfs.gateway.usage import read_usage  # reads the gateway's tables directly

        return read_usage(self.store, self.ledger, session)

    def usage_bytes(self, session: str) -> bytes:
        return _json_bytes(self.usage(session))

    def store_bytes(self) -> bytes:
        """The mount's ``store`` file: the store's figures and where it is (so ``ksfs umount``
        finds the daemon to wait for whatever --store it was given)."""
        return _json_bytes(dict(self.stats(), path=str(self.store_path)))

    def checkpoint_files(self, record: CheckpointRecord) -> list[str]:
        names = [f.name for f in record.files]
        skip = set(names)  # a stored file of a reserved name (stores made before the rule) wins
        if not record.domain_xml:
            skip.add("domain.xml")
        if self.guest_disk(record)[0] is None:
            skip.add("transcript")
        return names + [n for n in CHECKPOINT_VIRTUAL_FILES if n not in skip]

    def meta(self, record: CheckpointRecord) -> dict[str, Any]:
        return {
            "session": record.session,
            "name": record.name,
            "seq": record.seq,
            "parent": record.parent,
            "created": record.created,
            "transcript_seq": record.transcript_seq,
            "frozen_seq": record.frozen_seq,
            "logical_bytes": record.logical_bytes,
            "stored_bytes": record.stored_bytes,
            "files": {
                f.name: {
                    "size": f.size,
                    "stored": f.stored,
                    "chunking": f.chunking,
                    "blake3": f.digest,
                    "manifest": f.manifest,
                }
                for f in record.files
            },
        }

    def meta_bytes(self, record: CheckpointRecord) -> bytes:
        return _json_bytes(self.meta(record))

    def checkpoint_virtual_file(self, record: CheckpointRecord, name: str) -> bytes:
        """The bytes of a checkpoint file made from its record rather than stored as chunks."""
        if name == "meta.json":
            return self.meta_bytes(record)
        if name == "domain.xml":
            return (record.domain_xml or "").encode()
        if name == "transcript":
            return self.transcript_bytes(record)
        raise KeyError(name)

    def transcript_bytes(self, record: CheckpointRecord) -> bytes:
        """The guest's transcript file as of the checkpoint, read out of its disk image: empty
        when the disk holds none (or nothing this can read); a damaged chunk raises (EIO),
        never an empty file that would say the guest did no work (QA)."""
        from ksfs.errors import GuestFSUnreadable

        try:
            reader = self.transcript_reader(record)
            return reader.read(0, reader.size)
        except KsfsError as exc:
            if isinstance(exc, IntegrityError) and not isinstance(exc, GuestFSUnreadable):
                raise
            return b""

    def transcript_reader(self, record: CheckpointRecord) -> Any:
        """transcript_bytes as a reader (``size``, ``read``, ``stream``) that reads the guest's
        file a piece at a time. Empty when the disk holds none or nothing this can read, found
        when it is opened; an error of a later read raises, whatever it is, rather than end the
        bytes short."""
        from ksfs.errors import GuestFSUnreadable
        from ksfs.keeper.offline import BytesReader, GuestFileReader

        try:
            fs = self.guest_fs(record)
            if fs is None:
                return BytesReader(b"")
            ino = fs.resolve(self.transcript_path(record.session))
            found = fs.stat_ino(ino)
            if not found.is_file:  # (a directory, a symlink: no transcript, as the mount says)
                return BytesReader(b"")
            fs.read_ino(ino, 0, 1)  # what stops every read (encrypted, compressed) stops here
            return GuestFileReader(fs, ino, found.size)
        except KsfsError as exc:
            if isinstance(exc, IntegrityError) and not isinstance(exc, GuestFSUnreadable):
                raise
            return BytesReader(b"")

    def resume_result(self, session: str) -> bytes:
        """What reading ``resume`` tells: the last restore's outcome, one line."""
        return self._event_log(session).resume

    def reject(self, session: str | None, file: str, value: str, why: str,
               **about: str) -> None:
        """Record that input to ``file`` was refused, in the session's log when there is one;
        ``about``: what else says what was refused (change="attributes": a chmod, touch...)."""
        if session is None:
            return
        try:
            self.ledger.record(
                session, "input.rejected",
                {"file": file, "value": value[:200], "why": why, **about}
            )
        except Exception:  # an unknown session has no log to record in
            pass

    def reject_fs(self, session: str, checkpoint: str, why: str | None,
                  at: tuple | None = None) -> None:
        """Record that a checkpoint's guest filesystem cannot be shown, and why: once per
        checkpoint for this keeper, however often the mount opens it again (a listing of
        many such checkpoints evicts and reopens them)."""
        key = (session, checkpoint, at)  # at: (lineage, seq), so a name taken again is new
        with self._guest_disks_lock:
            if key in self._fs_rejected:
                return
            self._fs_rejected.add(key)
        try:
            self.ledger.record(session, "fs.unreadable", {"checkpoint": checkpoint, "why": why})
        except KsfsError:
            pass  # a removed session keeps its checkpoints read-only: nowhere to record

    def transcript_path(self, session: str) -> str:
        rec = self.ledger.session(session)
        return rec.config.get("transcript_path", DEFAULT_TRANSCRIPT)

    def guest_disk(self, record: CheckpointRecord) -> tuple[FileRecord | None, str | None]:
        """The disk image whose guest files stand for ``record`` (``fs/``, the transcript,
        ``ksfs diff``): its only disk image (chunked as one: ``disk*.raw``, ``*.img`` or a file
        imported with ``--disk``); of several, the first
        (``disk.raw``, then by name) whose filesystem holds the session's transcript, else
        ``disk.raw`` (an adopted domain's first disk may be a data disk and its second the
        guest's root); or (None, why none)."""
        disks = sorted((f for f in record.files
                        if f.chunking == "fixed" or is_disk_image(f.name)),
                       key=lambda f: (f.name != "disk.raw", f.name))
        label = f"{record.session}/{record.name}"
        if not disks:
            return None, f"{label} has no disk image"
        if len(disks) == 1:
            return disks[0], None
        key = (record.session, record.name, record.seq)
        with self._guest_disks_lock:
            name = self._guest_disks.get(key)
        if name is None:
            name = self._disk_holding_transcript(record, disks) or ""
            with self._guest_disks_lock:
                self._guest_disks[key] = name
                while len(self._guest_disks) > GUEST_DISKS_KEPT:
                    self._guest_disks.popitem(last=False)
        chosen = next((f for f in disks if f.name == (name or "disk.raw")), None)
        if chosen is not None:
            return chosen, None
        return None, (f"{label} has {len(disks)} disk images "
                      f"({', '.join(f.name for f in disks)}), no disk.raw and none holding "
                      f"the transcript")

    def _disk_holding_transcript(self, record: CheckpointRecord,
                                 disks: list[FileRecord]) -> str | None:
        from ksfs.guestfs import GuestFS

        for f in disks:
            reader, path = self._guest_reader(record, f)
            fs, _ = GuestFS.open_or_reason(reader, path)
            if fs is not None and fs.holds(path):
                return f.name
        return None

    def guest_fs(self, record: CheckpointRecord):
        """The guest filesystem of a checkpoint's disk, or None when it has no disk; on a
        partitioned disk, the partition holding the session's transcript when one does."""
        from ksfs.guestfs import GuestFS

        f, _ = self.guest_disk(record)
        return None if f is None else GuestFS.open(*self._guest_reader(record, f))

    def open_guest_fs(self, record: CheckpointRecord) -> tuple[Any, str | None]:
        """(fs, None), or (None, why) when the checkpoint has no disk or none this can read."""
        from ksfs.guestfs import GuestFS

        f, why = self.guest_disk(record)
        return (None, why) if f is None else GuestFS.open_or_reason(
            *self._guest_reader(record, f))

    def _guest_reader(self, record: CheckpointRecord, f: FileRecord) -> tuple[Any, str]:
        return (self.store.open_file(f.manifest, cache_bytes=GUEST_READER_CACHE),
                self._transcript_path_of(record.session))

    def _transcript_path_of(self, session: str) -> str:
        try:
            return self.transcript_path(session)
        except KsfsError:  # a removed session: its checkpoints' guests wrote the default path
            return DEFAULT_TRANSCRIPT
