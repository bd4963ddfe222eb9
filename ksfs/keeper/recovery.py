"""``recover``: after the daemon or the host died, finish or roll back what was half done.

For every live session: a ``checkpoint.begin`` with no ``published``/``failed`` after it gets a
``checkpoint.failed`` (its record never committed, so nothing is half visible; the frozen layers it
left stay in the chain and the next save reads them as changed), and an offline session that a
killed import made and nothing else used is removed, as the import would have removed it. A
``restore.begin`` with no end gets ``restore.done`` when the machine already holds the target (the
kill came after the controller's part), else ``restore.failed``, and if the machine is gone the
restore is run again. A fork whose machine never came up is rolled back, one whose machine came up
but was never defined is defined. A machine that is shut off is started again from the session's
last checkpoint when it has one, else booted. One ``recover`` event per session that needed
anything says what was done. The daemon runs this at start.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ksfs.errors import KsfsError, NotFound, RecordCorrupt, VMError
from ksfs.keeper.locks import drop_session_lock, session_lock
from ksfs.keeper.machine import MEMORY_FILE, label_name, parse_label
from ksfs.ledger import auto_checkpoint_name

OPENERS = {"checkpoint.begin": ("checkpoint.published", "checkpoint.failed"),
           "restore.begin": ("restore.done", "restore.failed")}
#: Events only a user's verb on the session writes: one after a ``session.removing`` means the
#: user went on with the session after that removal was cut short, and one after a restore's
#: ``restore.begin`` that it went on from the machine as it was. (Not the gateway's events, a
#: guest's model calls; nor those recover writes, nor a restore's own reconcile.)
USER_VERB_EVENTS = frozenset({"checkpoint.begin", "checkpoint.published", "restore.begin",
                              "restore.done", "pause", "resume", "fork.created"})
# What each scan of the log decodes (the ledger reads the others' types off their stored
# values): a log of 300,000 model calls is looked through in a fraction of its decoding time.
_OPEN_TYPES = frozenset({"checkpoint.begin", "restore.begin", *OPENERS["checkpoint.begin"],
                         *OPENERS["restore.begin"]})
_REMOVAL_TYPES = USER_VERB_EVENTS | {"session.removing", "session.remove_failed"}


def _user_verb(ev: Any) -> bool:
    # (a restore's own resume of a machine the user had paused names its restore: not one)
    return ev.type in USER_VERB_EVENTS and not (ev.type == "resume" and ev.body.get("reason"))


class Recovery:
    def _unfinished(self, session: str) -> list[Any]:
        """Begin events of this session that never got their end event. A checkpoint's end
        names its begin's seq (published: ``seq``; failed: ``begin_seq``), since an unnamed
        checkpoint's name is only known at its end (c_NNNN, or the next free c_NNNN when a user
        took that); logs written before failed events carried ``begin_seq`` are matched by name."""
        open_: dict[tuple[str, Any], Any] = {}
        for ev in self.ledger.events_of(session, _OPEN_TYPES):
            if ev.type == "checkpoint.begin":
                open_[("checkpoint", ev.seq)] = ev
            elif ev.type in OPENERS["checkpoint.begin"]:
                seq = ev.body.get("seq") if ev.type == "checkpoint.published" else \
                    ev.body.get("begin_seq")
                if seq is None:
                    name = ev.body.get("name")
                    seq = next((k[1] for k, b in open_.items() if k[0] == "checkpoint" and
                                (b.body.get("name") or f"c_{b.seq:04d}") == name), None)
                open_.pop(("checkpoint", seq), None)
            elif ev.type == "restore.begin":
                open_[("restore", ev.body.get("checkpoint"))] = ev
            elif ev.type in OPENERS["restore.begin"]:
                open_.pop(("restore", ev.body.get("checkpoint")), None)
        return sorted(open_.values(), key=lambda e: e.seq)

    def _made_by_a_killed_import(self, rec: Any) -> bool:
        """An offline session a killed import made (kill -9, a host crash) and nothing used
        since: no checkpoint, and its log only that import's begin and failure. An import
        that fails in its own process takes such a session back (QA, thirty-fourth session:
        after a kill -9 `session list` still showed it, "no checkpoint")."""
        if rec.parent is not None or self.ledger.checkpoint_names(rec.name):
            return False
        # only the events of these types are decoded: a long log of anything else is not
        events = list(self.ledger.events_of(
            rec.name, ("session.created", "checkpoint.begin", "checkpoint.failed")))
        if len(events) != self.ledger.last_seq(rec.name) + 1:  # (seqs from 0, gapless)
            return False  # something else happened in it
        kinds = [(ev.type, ev.body.get("source")) for ev in events]
        return bool(kinds) and kinds[0][0] == "session.created" and all(
            kind in (("checkpoint.begin", "import"), ("checkpoint.failed", None))
            for kind in kinds[1:]) and ("checkpoint.begin", "import") in kinds

    def recover(self) -> list[dict[str, Any]]:
        """What was done, per session that needed anything; ``failed`` marks a session that
        could not be brought back (the CLI then exits non-zero)."""
        report = []
        for name in self.ledger.session_names():
            with session_lock(self.store_path, name):
                # Read again under the lock: a session rm that finished while this waited for
                # it leaves nothing to mend, and one removed and made again is mended as it is
                # now, never by the record of the one before (review: 'could not recover: no
                # session named b', exit 10; a fork's rollback acting on the old record).
                try:
                    rec = self.ledger.session(name)
                except NotFound:
                    continue
                except RecordCorrupt as exc:  # the others are still mended (review: one
                    # damaged record stopped recover, and the mount's at start, for all)
                    report.append({"session": name, "actions": [f"could not recover: {exc}"],
                                   "failed": True})
                    continue
                if rec.removed is not None:
                    continue
                done: list[str] = []
                failed = False
                try:
                    self._recover_session(rec, done)
                except KsfsError as exc:
                    # One session that cannot be brought back must not stop the others; what
                    # was done for it before the failure is still reported.
                    done.append(f"could not recover: {exc}")
                    failed = True
            if done:
                if len(done) > 1 or not failed:
                    # Only what changed goes in the log: a look that failed (libvirt down)
                    # and did nothing is for the report alone, or every retry would add one.
                    self._record_recover(rec, done)
                report.append({"session": rec.name, "actions": done, "failed": failed})
        return report

    def _record_recover(self, rec: Any, done: list[str]) -> None:
        """The ``recover`` event goes in the session's log, or its parent's when it was a fork
        that recover rolled back (its own log went with it)."""
        try:
            self.ledger.session(rec.name)
        except NotFound:
            pass
        else:
            try:
                self.ledger.record(rec.name, "recover", {"actions": done})
            except KsfsError:
                pass  # removed (by recover too) with its checkpoints kept: its log is closed
            return
        if rec.parent is not None:
            try:
                self.ledger.record(rec.parent.session, "recover",
                                   {"actions": [f"fork {rec.name}: {a}" for a in done]})
            except KsfsError:
                pass  # the parent is gone or its log closed: the report is all that is left

    def _recover_session(self, rec: Any, actions: list[str]) -> list[str]:
        """Mend one session; what was done is appended to ``actions`` as it is done."""
        found = self._removal_scan(rec.name)  # (once: the log is read from its end for both)
        removing = found[0] if found is not None and found[1] is None else None
        abandoned = found if found is not None and found[1] is not None else None
        if abandoned is not None:
            # A plain `session rm` cut short, and the session used since (QA: a restore and a
            # save after a killed rm were deleted by the next recover, with the machine):
            # the user kept it. Said in its log, so no later removal or recover takes the old
            # intent up again; the session is mended below like any other.
            begun, used = abandoned
            self.ledger.record(rec.name, "session.remove_failed", {
                "reason": f"abandoned: the session was used after its removal was cut short "
                          f"({used.type} at seq {used.seq})",
                "removing_seq": begun.seq, "abandoned_at": used.seq})
            actions.append(f"removal begun at seq {begun.seq} not finished: the session was "
                           f"used after it ({used.type} at seq {used.seq}); removal abandoned")
        if removing is not None:
            # `session rm` was killed part way: finish it rather than bring the machine back.
            keep = bool(removing.body.get("keep_checkpoints"))
            release = removing.body.get("release")
            self._remove_locked(rec, keep, release)
            if not keep:
                drop_session_lock(self.store_path, rec.name)
            actions.append("removal begun at seq {} finished{}{}".format(
                removing.seq, " (checkpoints kept)" if keep else "",
                " (machine released)" if release is not None else ""))
            return actions
        restore_to = None
        for ev in self._unfinished(rec.name):
            name = ev.body.get("name") or auto_checkpoint_name(
                ev.seq, set(self.ledger.checkpoint_names(rec.name)))
            if ev.type == "checkpoint.begin":
                self.ledger.record(rec.name, "checkpoint.failed",
                                   {"name": name, "reason": "interrupted (recovered)",
                                    "begin_seq": ev.seq})
                actions.append(f"checkpoint {name} begun at seq {ev.seq} marked failed")
            elif self._finish_restore(rec, ev):
                actions.append(f"restore to {ev.body.get('checkpoint')} begun at seq {ev.seq} "
                               "had brought the machine back: finished")
            else:
                target = ev.body.get("checkpoint")
                self.ledger.record(rec.name, "restore.failed",
                                   {"checkpoint": target, "reason": "interrupted (recovered)",
                                    "begin_seq": ev.seq})
                went_on = self._went_on_after(rec.name, ev.seq)
                if went_on is None:
                    restore_to = target
                    actions.append(f"restore to {target} begun at seq {ev.seq} marked failed")
                else:
                    # The user resumed, saved or restored after it (QA: a restore killed
                    # before it touched the machine, then resume and a save; recover sent the
                    # machine back to the killed restore's old target, not to that save).
                    restore_to = None
                    actions.append(f"restore to {target} begun at seq {ev.seq} marked failed "
                                   f"(the session went on after it: {went_on.type} at seq "
                                   f"{went_on.seq})")
        if not rec.domain:
            if self._made_by_a_killed_import(rec):
                self._forget_new_session(rec.name)
                actions.append("made by an import that never finished, and holding nothing: "
                               "removed")
            return actions
        # under the session lock: no verb of it is running
        # before a detached disk's layer looks like a leftover
        for target, where in self._hand_back_detached(rec).items():
            actions.append(f"disk {target}, detached with writes in ksfs's layer, handed back "
                           f"({where['how']} into {where['file']})")
        freed = self.vm.drop_leftovers(rec.name, rec.domain)
        if freed:
            actions.append(f"{freed} bytes a killed verb left in the session's files removed")
        state = self.vm.state(rec.domain)  # a failure here: "could not recover"
        if state in ("crashed", "pmsuspended") and self.vm.settle_dead_or_asleep(rec.domain):
            # a crashed machine kept by on_crash=preserve: stopped (then its disks are saved
            # and it is restored below); one suspended to RAM: woken (QA, nineteenth session)
            actions.append(f"machine was {state}: " + (
                "woken" if state == "pmsuspended" else "its QEMU, kept after the crash, stopped"))
            state = self.vm.state(rec.domain)
        if state in ("running", "paused") and self.vm.persist(rec.name, rec.domain):
            actions.append("machine was only a transient domain (a fork killed before its "
                           "define): defined")
        if state in ("running", "paused") and self._unreconciled_fork(rec):
            # A fork killed after its machine came up, before its first reconcile: the guest
            # runs from the fork point, which its log must say before it runs on.
            point = f"{rec.parent.session}/{rec.parent.checkpoint}"
            # (that very checkpoint: one that took its name since is another machine's state)
            target = self._fork_point(rec)
            if target is None:
                actions.append(f"fork of {point} had no reconcile, and that checkpoint is gone "
                               "(or its name is another's now): not reconciled")
            else:
                ev = self._reconcile_to(rec.name, target)
                actions.append(f"fork of {point} had no reconcile: reconciled "
                               f"({ev.body.get('outcome')})")
        if state == "paused" and self.vm.paused_on_io_error(rec.domain):
            # Resumed, it would pause again at its next write (QA): left for the user to mend.
            actions.append(f"machine is paused on a disk I/O error (a full disk?): left paused; "
                           f"`ksfs resume {rec.name}` runs it once that is mended")
            return actions
        if state == "paused" and not self._paused_by_user(rec.name):
            # A verb killed while the machine was paused (a save's last copy, a restore or fork
            # not yet resumed) must not leave it stopped. A restore killed after libvirt loaded
            # the image holds the target's state already; a snapshot of a machine paused by an
            # incoming migration fails in QEMU, so resume rather than redo the restore.
            self.vm.resume(rec.domain)
            if restore_to:
                actions.append(f"machine was left paused by the restore to {restore_to}: "
                               "resumed")
                return actions
            actions.append("machine was left paused by an interrupted verb: resumed")
            return actions
        if state in ("running", "paused"):
            return actions
        if rec.parent is not None and not self.ledger.checkpoint_names(rec.name) \
                and state == "absent":
            # A fork whose machine never came up: roll it back.
            with self.store.env.begin(write=True) as txn:
                self.ledger.remove_session(txn, rec.name)
            self.checkpoint_changed(rec.name, None)
            self.vm.remove_files(rec.name)
            self.drop_token_file(rec.lineage)
            drop_session_lock(self.store_path, rec.name)
            try:  # the parent's log has its fork.created: say it came to nothing
                self.ledger.record(rec.parent.session, "fork.failed", {
                    "checkpoint": rec.parent.checkpoint, "session": rec.name,
                    "lineage": rec.lineage, "reason": "interrupted (recovered)"})
            except KsfsError:
                pass  # a parent removed with its checkpoints kept: its log is closed
            actions.append("fork never started: rolled back")
            return actions
        if state == "absent" and self._adopted(rec.name):
            # The user's own domain, undefined by the user: not made again behind their back
            # at the daemon's start (`ksfs restore` still brings it back when asked).
            actions.append("adopted domain is gone: not made again (ksfs restore would)")
            return actions
        target = restore_to or self._last_good(rec.name)
        if target:
            # What the restore below would refuse is refused first: saving the disks each
            # time and then failing made a checkpoint per run (QA: a cdrom image deleted).
            record = self.ledger.checkpoint(rec.name, target)
            if record.domain_xml:
                self.vm.check_start_files(record.domain_xml,
                                          f"checkpoint {rec.name}/{target}",
                                          record.file(MEMORY_FILE) is not None, rec.name)
        kept = None
        if target and (state != "absent" or self.vm.has_disk_files(rec.name)):
            # What the machine wrote since that checkpoint is on its disks: kept first, or
            # the machine is left as it is (a restore would delete it). A machine undefined
            # behind ksfs leaves its disk files too, as `restore` knows (QA, 18th session).
            was = "gone" if state == "absent" else state
            try:
                kept = self._save_stopped_disks(
                    rec, f"disks of the machine found {was}, kept before recover restores "
                         f"{target}")
            except KsfsError as exc:
                # not brought back: the session is reported failed (recover exits 10)
                raise VMError(f"machine was {was}; its disks could not be saved, so it was "
                              f"not restored to {target}: {exc}") from None
            actions.append(f"disks of the {was} machine saved as checkpoint {kept.name} "
                           "(no memory)")
        if target:
            # (saved just above: the restore's begin and reconcile name that save, so the
            # transcript lines the machine wrote after the target are said rolled back)
            self._restore_locked(rec, target, keep_stopped=False, kept=kept)
            was = "gone" if state == "absent" else state
            actions.append(f"machine was {was}: restored to checkpoint {target}")
        elif state != "absent":
            self.vm.resume(rec.domain, fw_cfg=self.guest_facts(rec))
            actions.append(f"machine was {state}: started")
        else:
            actions.append("machine is gone and no checkpoint can bring it back")
        return actions

    def _finish_killed_restore(self, rec: Any) -> None:
        """Finish (or let settle drop) a restore whose controller part was cut short, when one
        is pending; call it under the session's lock."""
        if not rec.domain or not self.vm.restore_pending(rec.name):
            return
        for ev in self._unfinished(rec.name):
            if ev.type == "restore.begin" and self._finish_restore(rec, ev):
                return
        self.vm.settle_restore(rec.name, rec.domain)  # not the machine's: dropped

    def _finish_restore(self, rec: Any, begin: Any) -> bool:
        """A restore killed after the controller had brought the machine back (its chain root
        holds the target, the domain exists) is finished, not failed: reconciled if it was not
        yet, resumed, and ``restore.done`` recorded."""
        target = begin.body.get("checkpoint")
        if not rec.domain or not target:
            return False
        # Not caught: a settle that could not look (libvirt down) must not let the restore be
        # marked failed while it may have taken effect; the session is reported failed instead.
        self.vm.settle_restore(rec.name, rec.domain)
        try:
            # (the very checkpoint: one that had its name before is not the restore's)
            if not self._holds_exactly(rec.name, target) \
                    or self.vm.state(rec.domain) not in ("running", "paused"):
                return False
            record = self.ledger.checkpoint(rec.name, target)
        except (KsfsError, NotFound):
            return False
        saved = None
        if begin.body.get("saved_as"):
            with contextlib.suppress(NotFound):
                saved = self.ledger.checkpoint(rec.name, begin.body["saved_as"])
        rec_ev = self._reconciled_after(rec.name, begin, record, saved)
        if self.vm.state(rec.domain) == "paused" and not self._paused_by_user(rec.name):
            self.vm.resume(rec.domain)
        self.ledger.record(rec.name, "restore.done", {
            "checkpoint": target, "begin_seq": begin.seq, "reconcile_seq": rec_ev.seq,
            "recovered": True})
        return True

    def _removal_begun(self, session: str) -> Any:
        """The ``session.removing`` event of a removal that was killed and is still to be
        finished: the session is still listed, no ``session.remove_failed`` (a removal that
        failed and said so, after which the session is the user's again) came after it, and,
        for a plain removal, no event of a user's verb on the session either (USER_VERB_EVENTS:
        the user went on with it, see ``_removal_abandoned``). A release (``--release``) cut
        short is finished whatever came after: its disks may be the user's files already.
        Other events after it (a model call the guest finished as it went) do not count. Read
        from the end of the log back to the last removal event."""
        found = self._removal_scan(session)
        return found[0] if found is not None and found[1] is None else None

    def _removal_abandoned(self, session: str) -> tuple[Any, Any] | None:
        """(the ``session.removing``, the first later event of a user's verb) of a plain
        removal cut short that the user went on from, not yet said abandoned; else None."""
        found = self._removal_scan(session)
        return found if found is not None and found[1] is not None else None

    def _removal_scan(self, session: str) -> tuple[Any, Any] | None:
        used = None
        for ev in self.ledger.events_backward(session, types=_REMOVAL_TYPES):
            if ev.type == "session.remove_failed":
                return None
            if ev.type == "session.removing":
                if ev.body.get("release") is not None:
                    return ev, None
                return ev, used
            if _user_verb(ev):
                used = ev  # (going back: the first one after the removal, at the end)
        return None

    def _went_on_after(self, session: str, seq: int) -> Any:
        """The last event of a user's verb after ``seq`` (the machine went on from what it was
        then), or None."""
        for ev in self.ledger.events_backward(session, types=USER_VERB_EVENTS):
            if ev.seq <= seq:
                return None
            if _user_verb(ev):
                return ev
        return None

    def _unreconciled_fork(self, rec: Any) -> bool:
        """A fork whose log has no reconcile yet (a fork writes it before its machine runs)."""
        if rec.parent is None:
            return False
        return not any(ev.type == "reconcile" for ev in self.ledger.events(rec.name))

    def _adopted(self, session: str) -> bool:
        first = self.ledger.event(session, 0)
        return first is not None and first.type == "session.adopted"

    def _paused_by_user(self, session: str) -> bool:
        """True when the session's last pause/resume event is a ``pause`` (read from the end
        of the log back)."""
        for ev in self.ledger.events_backward(session, types=("pause", "resume")):
            if ev.type in ("pause", "resume"):
                return ev.type == "pause"
        return False

    def _last_good(self, session: str) -> str | None:
        """The checkpoint to bring a dead machine back to: the one its disks last were at (its
        chain root's: the last save, or the checkpoint a restore went to; or a save or restore
        the ledger has after it, whose record in the chain was cut short), so a machine that
        was restored to an earlier checkpoint is not put back on the timeline the user left
        (the restore's save-first is newer), even one without memory (then booted); else the
        newest with memory of the session."""
        # The whole label (its lineage and seq), not the name alone: a checkpoint that took
        # the name since (rm base; import base) is not where the disks are (review of QA 5:
        # recover chose such an import and failed on its missing domain XML).
        label = getattr(self.vm, "held_label", self.vm.holds_checkpoint)(session)
        held, parsed = label_name(label), parse_label(label)
        since, found = 0, None
        if parsed is not None and parsed[0] == session:
            _, name, lineage, seq = parsed
            record, owner = self._labelled(session, name)  # (record None: deleted since)
            if lineage is not None and lineage == owner:
                since = seq + 1  # saves after it count even when it is gone or renamed
                if record is not None and record.seq == seq:
                    found = record
            elif lineage is None and record is not None:  # an older label: by name
                found, since = record, record.seq + 1
        # A save published after it whose layers were never folded into the root (a flatten
        # that failed, or was cut off with the machine): the machine ran on from that save,
        # not from the root's checkpoint, and going back there would lose it (QA). So does a
        # restore done since. The newest of them that still exists.
        later: list[str] = []
        if since or not held:
            for ev in self.ledger.events_of(session, ("checkpoint.published", "restore.done"),
                                            since):
                if ev.type == "checkpoint.published" and ev.body.get("name"):
                    later.append(ev.body["name"])
                elif ev.type == "restore.done" and ev.body.get("checkpoint"):
                    later.append(ev.body["checkpoint"])
        for name in reversed(later):
            try:
                record = self.ledger.checkpoint(session, name)
            except NotFound:
                continue
            if record.domain_xml:  # an import has no machine to restore (QA)
                return record.name
        if found is not None and found.domain_xml:
            return found.name
        for name in reversed(self.ledger.checkpoint_names(session)):
            record = self.ledger.checkpoint(session, name)
            if record.domain_xml and record.file(MEMORY_FILE) is not None:
                return name
        return None
