"""Verbs that need no virtual machine: import files as a checkpoint, delete, gc, check, stats."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ksfs.crashpoints import crash_point
from ksfs.errors import (
    AlreadyExists,
    BadInput,
    BadName,
    CheckpointGone,
    ChunkMissing,
    KsfsError,
    NoSuchFile,
    NoSuchSession,
    NotFound,
    NotPermitted,
    Terminated,
    from_os_error,
)
from ksfs.keeper.locks import drop_session_lock, session_lock
from ksfs.ledger import auto_checkpoint_name
from ksfs.model import (
    CHECKPOINT_RESERVED_NAMES,
    CheckpointRecord,
    FileRecord,
    event_file_names,
    validate_name,
)

Progress = Callable[[int, int], None]

log = logging.getLogger(__name__)


def _claims_empty_but_is_not(path: Path) -> bool:
    # Imports trust the size stat gives (chunking, progress, mapping); kernel-made files give 0
    # and would be stored empty without a word.
    if path.stat().st_size:
        return False
    try:
        with open(path, "rb") as f:
            return f.read(1) != b""
    except OSError:
        return False  # unreadable: the import's own read says why


def _is_regular_file(path: Path) -> bool:
    """Whether ``path`` names a regular file (through symbolic links); a path that names
    nothing or cannot be looked at is said in one sentence (pathlib raises some of these and
    calls others absent: a link loop is not a missing file)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        raise NoSuchFile(what="file to import", name=str(path)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"{path} is a symbolic link that leads round in a loop (or through "
                           "too many links): name the file itself") from None
        if exc.errno == errno.ENAMETOOLONG:
            shown = str(path) if len(str(path)) <= 80 else str(path)[:60] + "..."
            raise BadInput(f"{shown} is too long a path (a name in it is over 255 bytes, or "
                           "the whole over 4095)") from None
        raise from_os_error(exc, "look at the file to import", path) from None


def _require_readable(path: Path) -> None:
    """NotPermitted (exit 12, as docs/cli.md says) for a file this process may not read, found
    before any store is opened or made: left to the import's own open, it came after the
    import had written its checkpoint.begin event to the store. (The command line's own check,
    click's, was a usage error, exit 2, and asked access(2), which answers for the real user,
    not the effective one.) Opening the file is the test that answers for this process."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise NotPermitted(f"{path} cannot be read: {exc.strerror}") from None
        raise from_os_error(exc, "open the file to import", path) from None
    os.close(fd)


def _same_file_key(path: str | os.PathLike) -> tuple:
    """Equal for two arguments that name one file under one base name: the file itself, so
    that f, ./f and $PWD/f are one (the path strings were compared: --disk $PWD/f with f was
    refused as two files of one name, --disk ./f with f taken as one; issue #2 review). Two
    names of one file (hard or symbolic links) stay two files when their base names differ:
    each is stored under its own name, as asked. A path that names nothing keeps its path as
    its key, so the missing file is what import_paths says, as before."""
    p = Path(path)
    try:
        st = os.stat(p)
    except (OSError, ValueError):  # its error is said where each file is looked at
        return ("path", p)
    return ("file", p.name, st.st_dev, st.st_ino)


def is_disk_image(name: str) -> bool:
    """Disk images chunk at fixed 64 KiB (the qcow2 cluster); everything else by content."""
    return (name.startswith("disk") and name.endswith(".raw")) or name.endswith(".img")


def import_paths(session: str, checkpoint: str | None, files: Iterable[str | os.PathLike],
                 disks: Iterable[str | os.PathLike] = ()) -> tuple[list[Path], set[Path]]:
    """The files an import would store, in order, and which of them are disks: every
    argument checked (BadInput, BadName, NoSuchFile) without touching a store, so the command
    line checks them before it opens, and maybe makes, one."""
    validate_name(session, "session name")  # new=True where the import makes the session
    if checkpoint is not None:
        validate_name(checkpoint, "checkpoint name", new=True)
    files, disks = list(files), list(disks)
    for f in files + disks:
        if os.fspath(f).endswith("/"):  # pathlib would drop the slash and take the file
            raise BadInput(f"{os.fspath(f)!r} ends in '/', which names a directory: only "
                           "regular files are imported")
    # A file named twice, as files or as --disk alike, is bad input (which would it be?);
    # named as a file and as a --disk, it is that file, stored as a disk.
    file_keys = [(_same_file_key(f), f) for f in files]
    disk_keys = [(_same_file_key(d), d) for d in disks]
    for group in (file_keys, disk_keys):
        seen: dict[tuple, str] = {}
        for key, f in group:
            if key in seen:
                raise BadInput(f"{seen[key]} and {os.fspath(f)} name one file: give it once")
            seen[key] = os.fspath(f)
    as_files = {key: Path(f) for key, f in file_keys}
    # (a disk that is one of the files is that file, stored as a disk)
    disk_set = {as_files.get(key, Path(d)) for key, d in disk_keys}
    paths = [Path(f) for f in files] + sorted(disk_set - set(as_files.values()))
    if not paths:
        raise BadInput("nothing to import: name at least one file")
    names = [p.name for p in paths]
    for p in paths:
        validate_name(p.name, "file name", new=True)
        if p.name in CHECKPOINT_RESERVED_NAMES:
            raise BadName(name=p.name, why="a checkpoint directory shows its own entry by "
                          f"that name (reserved: {', '.join(CHECKPOINT_RESERVED_NAMES)})")
        if not _is_regular_file(p):
            what = "a directory" if p.is_dir() else "not a regular file"
            raise BadInput(f"{p} is {what}: only regular files are imported")
        _require_readable(p)
        if _claims_empty_but_is_not(p):
            raise BadInput(f"{p} says it is empty but has content (a /proc or /sys file?): "
                           "copy it to a regular file and import that")
    if len(set(names)) != len(names):
        first: dict[str, Path] = {}
        for p, name in zip(paths, names, strict=True):
            if name in first:
                raise BadInput(f"{first[name]} and {p} would both be stored as {name!r}: "
                               "a checkpoint keeps each file under its base name")
            first[name] = p
    return paths, disk_set


class OfflineVerbs:
    def ensure_session(self, session: str) -> bool:
        """Create an offline session (no machine) when ``session`` does not exist yet; True
        when this call made it."""
        validate_name(session, "session name")
        try:
            self.ledger.session(session)
        except NoSuchSession:
            with self.store.env.begin(write=True) as txn:
                try:
                    self.ledger.create_session(txn, session)
                except AlreadyExists:
                    return False
                return True
        return False

    def _forget_new_session(self, session: str) -> None:
        """Take back a session an import made for itself and could not fill: bad input leaves
        no session behind. (Under the session's lock; one that holds a checkpoint stays.)"""
        try:
            if self.ledger.checkpoint_names(session):
                return
            with self.store.env.begin(write=True) as txn:
                self.ledger.remove_session(txn, session)
            drop_session_lock(self.store_path, session)  # the name leaves no file behind
        except KsfsError as exc:  # the import's own error is the one to report
            log.warning("could not remove session %s its failed import made: %s", session, exc)
            return
        self.checkpoint_changed(session, None)

    def import_files(
        self,
        session: str,
        checkpoint: str | None,
        files: Iterable[str | os.PathLike],
        disks: Iterable[str | os.PathLike] = (),
        progress: Progress | None = None,
        map_files: bool = False,
    ) -> CheckpointRecord:
        """Store ``files`` (each under its base name) as one offline checkpoint of ``session``.

        ``map_files``: disk images may be read through a mapping (see ``FileSource.mapping``);
        only for a process that does nothing else, since a file cut short under it kills it."""
        paths, disk_set = import_paths(session, checkpoint, files, disks)
        validate_name(session, "session name")
        with session_lock(self.store_path, session):
            # made under the lock: an import that fails takes back the session it made, and
            # another import of the same new session, waiting on the lock, makes it again
            made = self.ensure_session(session)
            try:
                return self._import_locked(session, checkpoint, paths, disk_set, progress,
                                           map_files)
            except BaseException:
                if made:
                    self._forget_new_session(session)
                raise

    def _import_locked(self, session: str, checkpoint: str | None, paths: list[Path],
                       disk_set: set[Path], progress: Progress | None, map_files: bool
                       ) -> CheckpointRecord:
        """import_files under the session's lock."""
        taken = set(self.ledger.checkpoint_names(session))  # stable under the lock
        if checkpoint is not None and checkpoint in taken:
            raise AlreadyExists(what="checkpoint", name=f"{session}/{checkpoint}")
        begin = self.ledger.record(
            session, "checkpoint.begin", {"name": checkpoint, "source": "import"}
        )
        name = checkpoint or auto_checkpoint_name(begin.seq, taken)
        total = sum(p.stat().st_size for p in paths)
        done = 0

        def step(n: int, _total: int) -> None:
            if progress:
                progress(done + n, total)

        try:
            # the record's parent, and what new chunks are stored as deltas against (the
            # session lock keeps it the latest until this commits)
            parent = self.ledger.latest_checkpoint(session)
            with self.store.ingest() as ingest:
                records = []
                for p in paths:
                    chunking = "fixed" if (p in disk_set or is_disk_image(p.name)) else "cdc"
                    prev = parent.file(p.name) if parent is not None else None
                    f = ingest.add_file(str(p), chunking=chunking, progress=step,
                                        like=prev.manifest if prev else None,
                                        map_source=map_files)
                    done += f.size
                    records.append(f)
                ingest.seal()
                with self.store.env.begin(write=True) as txn:
                    ingest.commit(txn)
                    # the figures once committed: a chunk another import committed first
                    # (the same new data imported at once) is theirs, not ours
                    record = CheckpointRecord(
                        session=session,
                        name=name,
                        seq=begin.seq,
                        created=time.time(),
                        files=tuple(FileRecord(p.name, f.manifest, f.size,
                                               ingest.stored(f), f.chunking, f.digest)
                                    for p, f in zip(paths, records, strict=True)),
                        parent=parent.name if parent else None,
                    )
                    self.ledger.put_checkpoint(txn, record)
                    self.ledger.append(
                        txn, session, "checkpoint.published", self._published_body(record)
                    )
                crash_point("record.commit")
                self.checkpoint_changed(session, name)
        except BaseException as exc:
            self._record_failure(session, name, exc, begin.seq)
            raise
        return record

    def _published_body(self, record: CheckpointRecord) -> dict[str, Any]:
        return {
            "name": record.name,
            "seq": record.seq,
            "logical_bytes": record.logical_bytes,
            "stored_bytes": record.stored_bytes,
            **event_file_names([f.name for f in record.files]),
        }

    def _record_failure(self, session: str, name: str, exc: BaseException,
                        begin_seq: int) -> None:
        try:
            self.ledger.record(session, "checkpoint.failed",
                               {"name": name, "reason": _reason(exc), "begin_seq": begin_seq})
        except Exception:  # the store itself may be what failed; the raise above says why
            pass

    def _require_lineage(self, session: str, lineage: str | None) -> None:
        """Under the session's lock, for a caller that names the session it means (a mount's
        directory): NoSuchSession when ``session`` is now another session of that name,
        removed and made again meanwhile (QA, thirty-fourth session). None: no check."""
        if lineage is not None and self.ledger.session(session).lineage != lineage:
            raise NoSuchSession(session=session)

    def delete_checkpoint(self, session: str, checkpoint: str, lineage: str | None = None
                          ) -> dict[str, Any]:
        """Delete a checkpoint's record (its chunks wait for gc); what was deleted.
        ``lineage``: the session the caller means (a mount's directory); NoSuchSession when
        the session by that name is another now, checked under its lock."""
        validate_name(session, "session name")
        validate_name(checkpoint, "checkpoint name")
        self.ledger.checkpoint(session, checkpoint)  # unknown: say so before a lock file is made
        with session_lock(self.store_path, session):
            self._require_lineage(session, lineage)
            self.ledger.checkpoint(session, checkpoint)  # and again, stable under the lock
            with self.store.env.begin(write=True) as txn:
                ev = self.ledger.delete_checkpoint(txn, session, checkpoint)
        self.checkpoint_changed(session, checkpoint)
        return dict(ev.body, session=session, event_seq=ev.seq)

    def checkpoint_record(self, session: str, checkpoint: str) -> CheckpointRecord:
        """The record of ``checkpoint``, the names checked first: '..' or '' is bad input,
        not a name that is absent."""
        validate_name(session, "session name")
        validate_name(checkpoint, "checkpoint name")
        return self.ledger.checkpoint(session, checkpoint)

    def open_file(self, session: str, checkpoint: str, filename: str,
                  record: CheckpointRecord | None = None):
        """A random-access reader (``.size``, ``.read``, ``.stream``) of one file of a
        checkpoint: a stored file, or one the checkpoint directory makes from its record
        (meta.json, domain.xml, transcript), so ``ksfs cat`` reads what the mount shows."""
        if record is None:  # else the caller's: the reader is then of exactly that record
            record = self.checkpoint_record(session, checkpoint)
        validate_name(filename, "file name")
        f = record.file(filename)
        if f is not None:
            return self.store.open_file(f.manifest)
        if filename in self.checkpoint_files(record):
            if filename == "transcript":  # (it may be large)
                return self.transcript_reader(record)
            return BytesReader(self.checkpoint_virtual_file(record, filename))
        raise NoSuchFile(what=f"file of checkpoint {session}/{checkpoint}", name=filename)

    def gone_error(self, session: str, checkpoint: CheckpointRecord, filename: str,
                   exc: KsfsError) -> KsfsError:
        """What a missing chunk in a read of ``checkpoint``'s file means: CheckpointGone when
        that checkpoint was deleted meanwhile (gc collected what only it held: not damage),
        else ``exc`` itself (damage: the checkpoint still names the chunk)."""
        if not isinstance(exc, ChunkMissing):
            return exc
        try:
            now = self.ledger.checkpoint(session, checkpoint.name)
        except NotFound:  # the checkpoint, or its whole session, is gone
            now = None
        # the same record still (a name taken again, even by a session made again with the
        # same seqs, holds other files or was made at another time)
        if now is not None and (now.seq, now.created, now.files) == (
                checkpoint.seq, checkpoint.created, checkpoint.files):
            return exc
        return CheckpointGone(what=f"file {filename!r}", checkpoint=checkpoint.name,
                              session=session)

    def references(self) -> dict[str, list[str]]:
        """Every manifest in use, with the checkpoint files that use it (for check and gc)."""
        refs: dict[str, list[str]] = {}
        for s in self.ledger.sessions(include_removed=True):
            for c in self.ledger.checkpoints(s.name):
                for f in c.files:
                    refs.setdefault(f.manifest, []).append(f"{s.name}/{c.name}/{f.name}")
        return refs

    def check(self, read_data: bool = False):
        return self.store.check(read_data=read_data, references=self.references())

    def gc(self) -> dict[str, Any]:
        """Collect the chunk store (unreferenced chunks, sparse packs), then the gateway's
        stored responses of lineages no session can replay from any more."""
        from ksfs.gateway import GatewayStore

        # Pass the method, not its result: the store lists live manifests only once it holds the
        # exclusive lock, so an import that commits while GC waits for the lock is not swept.
        result = dict(vars(self.store.gc(self.ledger.live_manifests)))
        freed, nbytes = GatewayStore(self.store, self.ledger).collect(
            self.ledger.replayable_lineages())
        result.update(gateway_responses_freed=freed, gateway_bytes_freed=nbytes)
        return result

    def set_budget(self, session: str, tokens: int | None = None,
                   usd: float | None = None) -> dict[str, Any]:
        """Replace the session's model-call budget (both None: none) and record budget.set."""
        self.ledger.session(session)
        if self.gateway is not None:
            self.gateway.set_budget(session, tokens=tokens, usd=usd)
        else:
            from ksfs.gateway import GatewayStore

            GatewayStore(self.store, self.ledger).set_budget(session, tokens=tokens, usd=usd)
        return self.usage(session)

    def stats(self) -> dict[str, Any]:
        figures = dict(self.store.stats())
        logical = 0
        count = 0
        for s in self.ledger.sessions(include_removed=True):
            for c in self.ledger.checkpoints(s.name):
                logical += c.logical_bytes
                count += 1
        figures["logical_bytes"] = logical
        figures["checkpoints"] = count
        figures["sessions"] = len(self.ledger.sessions())
        stored = figures.get("stored_bytes") or 0
        # (none without logical bytes: 0.0 for a store whose checkpoints all went before a gc
        # read as if nothing deduplicated)
        figures["dedup_ratio"] = round(logical / stored, 2) if stored and logical else None
        return figures


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM
        return "terminated" if isinstance(exc, Terminated) else "interrupted"
    return str(exc) or type(exc).__name__


def _tell(exc: BaseException, said: str) -> None:
    """Add what the user must know to a failure's message; a Ctrl-C or SIGTERM has none of
    its own to carry it (QA, eighteenth session: "aborted" alone), so it is logged (the
    command line writes it as a warning)."""
    if isinstance(exc, KsfsError):
        exc.message = f"{exc.message}; {said}"
        exc.args = (exc.message,)
    else:
        log.warning("%s: %s", _reason(exc), said)


class BytesReader:
    """A file made from a record, read like a stored one (the ``FileReader`` surface)."""

    # no manifest, and not None: a mount node made for a stored file must never take this
    # reader for it (nodes.StoredFile.open_reader compares manifests)
    manifest = ""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0:
            raise BadInput(f"cannot read {n} bytes at offset {offset}")
        return self.data[offset : offset + n]

    def stream(self, offset: int = 0, end: int | None = None) -> Iterator[list[bytes]]:
        yield [self.data[offset:end]]


class GuestFileReader:
    """A file inside a checkpoint's guest filesystem, read like a stored one a piece at a time
    (``ksfs cat S C transcript`` held the whole transcript three times over: 285 MB of
    memory for an 80 MB one)."""

    manifest = ""  # as BytesReader's
    PIECE = 1 << 20

    def __init__(self, fs: Any, ino: int, size: int) -> None:
        self.fs, self.ino, self.size = fs, ino, size

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0:
            raise BadInput(f"cannot read {n} bytes at offset {offset}")
        n = min(n, self.size - offset)
        return self.fs.read_ino(self.ino, offset, n) if n > 0 else b""

    def stream(self, offset: int = 0, end: int | None = None) -> Iterator[list[bytes]]:
        end = self.size if end is None else min(end, self.size)
        while offset < end:
            n = min(self.PIECE, end - offset)
            yield [self.fs.read_ino(self.ino, offset, n)]
            offset += n
