"""Restore and fork: bring a checkpoint back to life, in its own session or as a new one.

Both materialize the checkpoint's disk and memory from the store into the VM controller, reconcile
the guest's transcript with the host log (one ``reconcile`` event) before the guest runs again,
and leave either their whole effect or a ``*.failed`` record: a restore saves the current state
first so nothing is lost, and a fork that cannot start is rolled back.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ksfs import progress
from ksfs.crashpoints import crash_point
from ksfs.errors import (
    AlreadyExists,
    BadInput,
    KsfsError,
    NoSuchCheckpoint,
    NotFound,
    NotPermitted,
)
from ksfs.keeper.locks import new_session_lock, session_lock
from ksfs.keeper.machine import MEMORY_FILE, checkpoint_label, domain_name_for, stored_disks
from ksfs.keeper.offline import _reason, _tell
from ksfs.model import (
    CheckpointRecord,
    Event,
    ForkPoint,
    SessionRecord,
    TranscriptInfo,
    validate_name,
)

log = logging.getLogger(__name__)


class RestoreVerbs:
    # --- restore and fork -------------------------------------------------------------------

    def _checkpoint_readers(self, record: CheckpointRecord, xml_disks: list) -> tuple[Any, dict]:
        """The checkpoint's memory (None for the disks of a stopped machine, which boot
        instead) and disks, each as a store file, keyed by disk target."""
        mem = record.file(MEMORY_FILE)
        names = stored_disks(record)
        if names is None:
            raise NotPermitted(f"the disks checkpoint {record.session}/{record.name} stored are "
                               f"not those its domain XML keeps (taken by a ksfs that also "
                               f"stored read-only disks): its files can be read (ksfs cat), "
                               f"not restored or forked")
        disks = {}
        for d in xml_disks:
            f = record.file(names[d.target])
            disks[d.target] = self.store.open_file(f.manifest)
        return (self.store.open_file(mem.manifest) if mem else None), disks

    def _xml_disks(self, record: CheckpointRecord) -> list:
        from ksfs.vm import domxml

        if not record.domain_xml:
            raise NotPermitted(f"checkpoint {record.session}/{record.name} has no domain XML")
        return domxml.disks(record.domain_xml)

    def _transcript_of(self, record: CheckpointRecord) -> tuple[TranscriptInfo | None, str | None]:
        try:
            from ksfs.guestfs import read_transcript

            fs = self.guest_fs(record)
            if fs is None:
                return None, "the checkpoint has no disk"
            return read_transcript(fs, self.transcript_path(record.session)), None
        except NotFound:
            return None, None  # no transcript file: the "missing" case
        except KsfsError as exc:
            return None, str(exc)

    def _reconcile_to(self, session: str, target: CheckpointRecord,
                      current_transcript_seq: int | None = None,
                      current: CheckpointRecord | None = None) -> Event:
        """Read the target's transcript from its disk and record the one ``reconcile`` event
        of bringing ``session`` to it. ``current``: the checkpoint of the state the machine
        leaves (the restore's save-first), whose transcript is compared with the target's to
        tell where the two timelines split."""
        from ksfs.ledger.reconcile import record_reconcile

        transcript, error = self._transcript_of(target)
        shared = None
        if current is not None and current_transcript_seq is not None and error is None \
                and transcript is not None:
            shared = self._shared_transcript_seq(current, target)
        with self.store.env.begin(write=True) as txn:
            return record_reconcile(self.ledger, txn, session, target, transcript, error,
                                    current_transcript_seq=current_transcript_seq,
                                    shared_transcript_seq=shared)

    def _shared_transcript_seq(self, current: CheckpointRecord, target: CheckpointRecord
                               ) -> int | None:
        """The seq of the last transcript line ``current``'s and ``target``'s disks have in
        common, the same bytes from the start of the file (a line's nonce tells two timelines
        apart from their first line on); -1 when they share no whole line; None when either
        cannot be read. Reads both as far as they agree, in pieces."""
        try:
            fa, fb = self.guest_fs(current), self.guest_fs(target)
            if fa is None or fb is None:
                return None
            path = self.transcript_path(current.session)
            ia, ib = fa.resolve(path), fb.resolve(path)
            n = min(fa.stat_ino(ia).size, fb.stat_ino(ib).size)
            shared, partial, off = -1, b"", 0
            while off < n:
                a = fa.read_ino(ia, off, min(TRANSCRIPT_PIECE, n - off))
                b = fb.read_ino(ib, off, len(a))
                k = min(len(a), len(b))
                same = k if a[:k] == b[:k] else next(i for i in range(k) if a[i] != b[i])
                whole, _, partial = (partial + a[:same]).rpartition(b"\n")
                seq = _last_seq(whole)
                if seq is not None:
                    shared = seq
                if same < len(a) or not a:
                    return shared  # they part here
                off += len(a)
            # One is all the other's beginning: a last line without its newline yet (a whole
            # entry, as read_transcript counts it) is the same line in both.
            seq = _last_seq(partial)
            return shared if seq is None else seq
        except KsfsError:
            return None

    def _reconciled_after(self, session: str, begin: Event, target: CheckpointRecord,
                          saved: CheckpointRecord | None) -> Event:
        """The ``reconcile`` event of the restore that ``begin`` opened: the one recorded
        already (an interruption can land between its commit and the caller's seeing it), else
        one recorded now."""
        for ev in self.ledger.events(session, since=begin.seq + 1):
            if ev.type == "reconcile":
                return ev
        return self._reconcile_to(session, target, saved.transcript_seq if saved else None,
                                  saved)

    def restore(self, session: str, checkpoint: str) -> dict[str, Any]:
        """Save the current state, then bring the machine back to ``checkpoint`` and run it."""
        validate_name(session, "session name")
        other, slash, name = checkpoint.partition("/") if isinstance(checkpoint, str) \
            else ("", "", "")
        if slash and other and name and "/" not in name:
            # (QA: "cannot contain '/'" alone, where diff takes OTHER/CHECKPOINT)
            raise BadInput(f"a restore brings {session} back to one of its own checkpoints, "
                           f"not {checkpoint!r}: `ksfs fork {other} {name} NEW` runs that one "
                           f"as a session of its own")
        validate_name(checkpoint, "checkpoint name")
        rec = self._machine(session)
        with session_lock(self.store_path, session), \
                self.activity.doing(session, "restore", checkpoint=checkpoint):
            return self._restore_locked(rec, checkpoint)

    def _restore_locked(self, rec: SessionRecord, checkpoint: str,
                        keep_stopped: bool = True, kept: Any = None) -> dict[str, Any]:
        """``keep_stopped``: a machine found shut off or crashed has its disks saved first (a
        checkpoint without memory), as a running one has its whole state: what it wrote since
        its last checkpoint is not thrown away. Recover, which saved them itself, says False and
        gives that save as ``kept``."""
        session = rec.name
        target = self.ledger.checkpoint(session, checkpoint)
        xml_disks = self._xml_disks(target)
        # Before this restore numbers and stages its files: settling a killed one removes
        # every file of the session that is not its chain.
        self._finish_killed_restore(rec)
        memory, disks = self._checkpoint_readers(target, xml_disks)
        self.vm.check_start_files(target.domain_xml, f"checkpoint {session}/{checkpoint}",
                                  memory is not None, session)
        state = self.vm.state(rec.domain)
        if state in ("crashed", "pmsuspended") and self.vm.settle_dead_or_asleep(rec.domain):
            # (QA, nineteenth session: "is running; its disks are not stopped" of a crashed
            # machine on_crash=preserve kept, or one suspended to RAM): stopped, or woken
            state = self.vm.state(rec.domain)
        if keep_stopped and state not in ("running", "paused") and (
                state != "absent" or self.vm.has_disk_files(session)):
            # (a machine undefined behind ksfs leaves its disk files, and what it wrote
            # since its last checkpoint in them: kept too, QA, eighteenth session)
            # QA (twelfth session): a shut-off machine's unsaved writes were lost here. Saved
            # before the staging starts, which reads nothing of the current chain.
            was = "gone" if state == "absent" else state
            progress.report(f"saving the disks of the {was} machine first")
            kept = self._save_stopped_disks(
                rec, f"disks of the {was} machine, kept before restore to {checkpoint}")
        t0 = time.monotonic()
        # Before anything is staged: a token file that cannot be written (a full disk) must
        # leave no staged files behind.
        facts = self.guest_facts(rec)
        # The target's files are written while the current state is saved: the save waits
        # mostly on QEMU and libvirt, the writing on the store's decompression.
        n = self.vm.reserve_restore(session)
        beside = progress.Beside()  # the save-first and the staging on one progress line

        def stage() -> Any:
            try:
                with progress.reporting(beside.second):
                    return self.vm.stage_restore(session, rec.domain, n, memory, disks)
            finally:
                beside.done()

        pool = ThreadPoolExecutor(1, thread_name_prefix="restore-stage")
        staging = pool.submit(contextvars.copy_context().run, stage)
        pool.shutdown(wait=False)  # the thread ends with its one job
        # Paused before its save-first and kept so until it is replaced: a snapshot runs the
        # guest again after it, and it went on writing its transcript and buying model calls
        # while the target was staged, work the save did not hold and the restore then threw
        # away uncounted (QA). A restore that fails with the old machine still there runs it.
        paused_here = None
        try:
            if state == "running":  # (inside: a failure here discards the staging too)
                paused_here = self.vm.pause(rec.domain, session)
            saved = kept
            if state in ("running", "paused"):
                # Not live: the machine is replaced right after, so a shorter whole save beats
                # a shorter pause, and the memory copy would compete with the staging.
                with progress.reporting(beside.first):
                    progress.report("saving the current state first")
                    saved = self._save_locked(rec, None,
                                              reason=f"before restore to {checkpoint}",
                                              live=False)
            t_saved = time.monotonic()
            begin = self.ledger.record(session, "restore.begin", {
                "checkpoint": checkpoint, "saved_as": saved.name if saved else None})
        except BaseException as exc:
            _discard(staging)
            if paused_here is not None:
                self._run_again(rec, paused_here)
            if isinstance(exc, KsfsError):
                # Said in the log (and so by reading `resume`) like a failure after the begin;
                # nothing of the machine was touched (QA: its save-first on a full disk left
                # `resume` telling an older outcome).
                with contextlib.suppress(KsfsError):
                    self.ledger.record(session, "restore.failed",
                                       {"checkpoint": checkpoint, "reason": _reason(exc)})
            raise
        reconciled = restored = None
        try:
            staged = staging.result()
            crash_point("restore.staged")
            t_staged = time.monotonic()
            progress.report("restoring the machine")
            restored = self.vm.restore(session, rec.domain, memory, disks,
                                       xml=target.domain_xml,
                                       checkpoint=checkpoint_label(rec.lineage, target),
                                       staged=staged,
                                       fw_cfg=facts)
            t1 = time.monotonic()
            crash_point("restore.reconcile")
            rec_ev = self._reconcile_to(session, target,
                                        saved.transcript_seq if saved else None, saved)
            reconciled = rec_ev  # from here the machine holds the target, paused
            t2 = time.monotonic()
            crash_point("restore.resume")
            self.vm.resume(rec.domain)
            if self._paused_by_user(session):
                # A restore runs the machine; say so, or recover would take it for the user's
                # pause still holding and leave it stopped after a later interrupted verb.
                self.ledger.record(session, "resume", {"domain": rec.domain,
                                                       "reason": f"restore to {checkpoint}"})
            steps = dict(restored.timings, save_first=t_saved - t0,
                         wait_for_materialize=t_staged - t_saved, reconcile=t2 - t1,
                         resume=time.monotonic() - t2)
            body = {"checkpoint": checkpoint, "begin_seq": begin.seq,
                    "reconcile_seq": rec_ev.seq, "seconds": round(time.monotonic() - t0, 3),
                    "steps": {k: round(v, 3) for k, v in steps.items()}}
            if memory is None:
                body["booted"] = True  # no memory: its disks were booted, not resumed
            done = self.ledger.record(session, "restore.done", body)
        except BaseException as exc:
            if reconciled is None and restored is not None and self._holds(rec, checkpoint):
                # QA (seventeenth session): Ctrl-C or SIGTERM while the target's transcript
                # was read left the machine on the target, logged restore.failed with no
                # reconcile; recover then ran it, a rollback the log never said.
                with contextlib.suppress(KsfsError):
                    reconciled = self._reconciled_after(session, begin, target, saved)
            if reconciled is not None and self._holds(rec, checkpoint):
                # QA (fifteenth session): a resume that failed after the machine came back
                # was logged restore.failed, while the machine held the target. It is done;
                # what failed is running it, said with the way on.
                self._record_done_but_paused(session, checkpoint, begin, reconciled, exc)
                raise
            if paused_here is not None:
                self._run_again(rec, paused_here)
            if saved is not None and state in ("running", "paused") \
                    and self._stopped_now(rec.domain):
                # The restore stopped the machine and could not start the checkpoint: say so,
                # and how to get back (recover would bring back the same checkpoint).
                _tell(exc, f"the machine was stopped for this restore and is left shut off: "
                           f"`ksfs restore {session} {saved.name}` brings back the state it "
                           f"was in")
            self.ledger.record(session, "restore.failed",
                               {"checkpoint": checkpoint, "reason": _reason(exc)})
            raise
        return {"session": session, "checkpoint": checkpoint, "seq": done.seq,
                "saved_as": saved.name if saved else None, "reconcile": rec_ev.body,
                "booted": memory is None}

    def _run_again(self, rec: SessionRecord, instance: int) -> None:
        """After a failed restore: run the machine this restore paused when it is still the
        same QEMU instance (not one the restore started). Never raises: the failure is the
        news."""
        try:
            self.vm.resume_instance(rec.domain, instance)
        except KsfsError as exc:
            log.warning("%s: could not run the machine again after the failed restore: %s",
                        rec.name, exc)

    def _holds(self, rec: SessionRecord, checkpoint: str) -> bool:
        """Whether the machine is paused on ``checkpoint``'s chain (a running one was resumed:
        what failed after that is no resume)."""
        try:
            return (self._holds_exactly(rec.name, checkpoint)
                    and self.vm.state(rec.domain) == "paused")
        except KsfsError:
            return False

    def _record_done_but_paused(self, session: str, checkpoint: str, begin: Any,
                                reconciled: Any, exc: BaseException) -> None:
        with contextlib.suppress(KsfsError):
            self.ledger.record(session, "restore.done", {
                "checkpoint": checkpoint, "begin_seq": begin.seq,
                "reconcile_seq": reconciled.seq, "resumed": False, "reason": _reason(exc)})
        _tell(exc, f"the machine is restored to {checkpoint} but left paused: "
                   f"`ksfs resume {session}` runs it")

    def _stopped_now(self, domain: str) -> bool:
        try:
            return self.vm.state(domain) not in ("running", "paused")
        except KsfsError:
            return False

    def fork(self, session: str, checkpoint: str, new: str, lineage: str | None = None,
             seq: int | None = None) -> SessionRecord:
        """A new session running from ``checkpoint`` in its own domain; the parent runs on.
        ``lineage`` and ``seq``: the checkpoint the caller means (a mount's directory);
        NoSuchCheckpoint when the one by that name is another now (deleted and taken again, or
        its session made again), checked under the parent's lock."""
        validate_name(session, "session name")
        validate_name(checkpoint, "checkpoint name")
        validate_name(new, "session name", new=True)
        self._refuse_taken_session(new)
        # what cannot be forked is said before any lock file is made (bad input changes nothing)
        record = self.ledger.checkpoint(session, checkpoint)
        self._xml_disks(record)
        # (with the parent: its copy of a kernel or initrd stands in for one gone; without
        # either, NotFound here as for a restore, not a VMError after fork.created: QA)
        self.vm.check_start_files(record.domain_xml, f"checkpoint {session}/{checkpoint}",
                                  record.file(MEMORY_FILE) is not None, session)
        domain = domain_name_for(new)
        if self.vm.exists(domain):  # (and again under the lock: one defined meanwhile)
            raise AlreadyExists(what="libvirt domain", name=domain)
        # The parent's lock too: while the fork reads the checkpoint, `rm` of it (and a gc
        # after) or `session rm` of the parent waits, instead of pulling its chunks or its
        # boot files out from under the fork. The parent's own verbs wait for the fork.
        with session_lock(self.store_path, session), \
                new_session_lock(self.store_path, new, self._session_made(new)), \
                self.activity.doing(session, "fork", checkpoint=checkpoint, session_new=new):
            parent = self.ledger.session(session)
            target = self.ledger.checkpoint(session, checkpoint)
            if (lineage is not None and parent.lineage != lineage) or \
                    (seq is not None and target.seq != seq):
                raise NoSuchCheckpoint(session=session, checkpoint=checkpoint)
            xml_disks = self._xml_disks(target)
            if self.vm.exists(domain):
                raise AlreadyExists(what="libvirt domain", name=domain)
            config = dict(parent.config)
            if "gateway_port" in config:  # its own port: the gateway tells sessions apart by it
                config["gateway_port"] = self.allocate_gateway_port()
            with self.store.env.begin(write=True) as txn:
                rec = self.ledger.create_session(
                    txn, new, domain=domain,
                    parent=ForkPoint(session, checkpoint, target.seq, parent.lineage),
                    config=config,
                )
            try:
                with self._undone_on_failure(new, domain):
                    memory, disks = self._checkpoint_readers(target, xml_disks)
                    progress.report("starting the fork")
                    self.vm.fork(new, domain, memory, disks, xml=target.domain_xml,
                                 lineage=rec.lineage,
                                 checkpoint=checkpoint_label(parent.lineage, target),
                                 fw_cfg=self.guest_facts(rec))
                    self._reconcile_to(new, target)
                    crash_point("fork.resume")
                    self.gateway_listens()
                    self.vm.resume(domain)
            except BaseException as exc:
                # The parent's log has this fork's fork.created; say it came to nothing.
                try:
                    self.ledger.record(session, "fork.failed", {
                        "checkpoint": checkpoint, "session": new, "lineage": rec.lineage,
                        "reason": _reason(exc)})
                except KsfsError:
                    pass  # a parent removed with its checkpoints kept: its log is closed
                raise
        return rec


TRANSCRIPT_PIECE = 1 << 20


def _last_seq(lines: bytes) -> int | None:
    """The seq of the last line of ``lines`` (newline-separated) that is a transcript entry
    (NUL runs a crash left stripped, as ksfs.guestfs.transcript reads them), or None."""
    for line in reversed(lines.split(b"\n")):
        line = line.strip(b"\0")
        if b"\0" in line:
            line = line.rsplit(b"\0", 1)[1]
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(entry, dict) and type(entry.get("seq")) is int:
            return entry["seq"]
    return None


def _discard(staging: Future) -> None:
    """Wait for a staging the restore will not use, and remove what it wrote."""
    try:
        staging.result().discard()
    except BaseException:  # noqa: BLE001 - it failed: it removed its own files
        pass
