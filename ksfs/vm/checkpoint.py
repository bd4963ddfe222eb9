"""Taking a checkpoint of a running domain: atomic external snapshot, then finish or abort.

``snapshot`` freezes disk, memory and device state of one instant (libvirt external snapshot,
ATOMIC and NO_METADATA, memory to a staging file, every disk to a new overlay) and hands the
frozen chain over as random-access sources. ``finish`` commits the frozen layers into the chain's
root (never the active overlay), so the next frozen layer holds exactly the next interval's
writes. Any failure leaves the guest as it was (running, or paused), removes partial files and
raises VMError. A guest paused before its snapshot stays paused; see ``_repause`` for what QEMU
7.2 needs for that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from xml.sax.saxutils import quoteattr

import libvirt

from ksfs import progress
from ksfs.crashpoints import crash_point
from ksfs.errors import KsfsError, NotRunning, StoppedWhileSaved, VMError
from ksfs.vm import domxml, saveimage
from ksfs.vm.chain import ChainSource, chain_files, create_overlay, files_held_by
from ksfs.vm.state import DiskState, Frozen, FrozenDisk, SessionState, file_stat
from ksfs.vm.steps import step

if TYPE_CHECKING:
    from ksfs.vm.controller import DomainController

log = logging.getLogger(__name__)

COMMIT_TIMEOUT = 600.0
# A live snapshot copies memory while the guest runs; a guest that dirties memory faster than
# the copy would keep it going for ever, so after this long the guest is paused and the copy
# ends with what is left (libvirt allows a suspend inside a snapshot job for this).
LIVE_COPY_LIMIT = 3.0
PAUSE_POLL = 0.005
# How often the meter asks libvirt how far the memory copy is, for a caller's progress.
PROGRESS_POLL = 0.25
# QEMU's refusal of a migration (so a memory snapshot) while it is in run state "postmigrate".
STALE_POSTMIGRATE = "paused due to previous migration"


class _PauseMeter:
    """Measures how long the guest is really paused inside the snapshot call, by polling its
    state: the call's wall time overstates the pause of a live snapshot several times."""

    def __init__(self, dom: libvirt.virDomain, live: bool,
                 on_freeze: Callable[[], None] | None = None) -> None:
        self.dom = dom
        self.live = live
        self.on_freeze = on_freeze
        self.first: float | None = None
        self.last: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pause-meter", daemon=True)
        self.forced = False
        self.sink = progress.current()  # the meter's thread reports for the caller's verb
        self._next_report = 0.0

    def __enter__(self) -> _PauseMeter:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.t1 = time.monotonic()
        if self.first is None and exc[0] is None:
            # No poll saw the pause (a live copy's last pause can be shorter than a poll): it
            # was just before the call returned, so the caller's note taken now is the nearest
            # (QA: 3 saves in 9 left frozen_seq empty and reconcile fell back to the begin).
            self._frozen()

    def _run(self) -> None:
        while not self._done.wait(PAUSE_POLL):
            try:
                paused = self.dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED
            except libvirt.libvirtError:
                continue
            now = time.monotonic()
            if self.sink is not None and now >= self._next_report:
                self._next_report = now + PROGRESS_POLL
                self._report_copy()
            if paused:
                if self.first is None:
                    self.first = now
                    self._frozen()
                self.last = now
            if (self.live and not self.forced and self.first is None
                    and now - self.t0 > LIVE_COPY_LIMIT and self._still_copying()):
                self.forced = True
                with contextlib.suppress(libvirt.libvirtError):
                    self.dom.suspend()

    def _report_copy(self) -> None:
        try:
            stats = self.dom.jobStats()
        except libvirt.libvirtError:
            return
        # memory_processed counts the bytes sent (zero pages are not), so how far the copy is
        # is what is no longer remaining; remaining is 0 for a moment before the copy starts.
        total, left = stats.get("memory_total"), stats.get("memory_remaining")
        if total and left is not None and (left or stats.get("memory_processed")):
            progress.report("copying the machine's memory", total - left, total,
                            sink=self.sink)

    def _still_copying(self) -> bool:
        """Memory is still being copied (not a pause too short for the polls, already over)."""
        try:
            stats = self.dom.jobStats()
        except libvirt.libvirtError:
            return True  # no figures: better one forced pause than a copy without end
        # UNBOUNDED while the job runs (memory_remaining is 0 for a moment at its start, then
        # counts down); NONE before it starts, COMPLETED once QEMU stopped the guest.
        return (stats.get("type") == libvirt.VIR_DOMAIN_JOB_UNBOUNDED
                and stats.get("memory_remaining", 1) > 0)

    def _frozen(self) -> None:
        if self.on_freeze is not None:
            try:
                self.on_freeze()
            except Exception:  # noqa: BLE001 - the caller's note must not break the snapshot
                log.exception("on_freeze callback failed")

    @property
    def paused_s(self) -> float:
        """The pause seen, to within one poll; the whole call (an upper bound) when no poll saw
        the guest paused (a pause shorter than a poll, or state queries held up by libvirt)."""
        if self.first is None or self.last is None or not self.live:
            # (not live: paused for the whole memory copy, while libvirt's job held up most
            # state queries, so the polls saw one instant of it: QA)
            return self.t1 - self.t0
        return min(self.last - self.first + PAUSE_POLL, self.t1 - self.t0)


def _snapshot_xml(memory: Path, overlays: dict[str, Path], skip: list[str]) -> str:
    disks = "".join(
        f"<disk name={quoteattr(t)} snapshot='external' type='file'><driver type='qcow2'/>"
        f"<source file={quoteattr(str(p))}/></disk>"
        for t, p in overlays.items()
    )
    disks += "".join(f"<disk name={quoteattr(t)} snapshot='no'/>" for t in skip)
    return (f"<domainsnapshot><memory snapshot='external' file={quoteattr(str(memory))}/>"
            f"<disks>{disks}</disks></domainsnapshot>")


def _other_disks(xml: str, kept: set[str]) -> list[str]:
    """Targets of disks that are not ours to snapshot (cdroms, floppies, read-only disks: all
    but ``kept``)."""
    import xml.etree.ElementTree as ET

    out = []
    for disk in ET.fromstring(xml).iterfind("devices/disk"):
        target = disk.find("target")
        if target is not None and target.get("dev") not in kept:
            out.append(target.get("dev"))
    return out


def snapshot(ctl: DomainController, session: str, domain: str, live: bool = True,
             on_freeze: Callable[[], None] | None = None) -> Frozen:
    settle_commits(ctl, session, domain)  # what a killed save folded into the roots
    state = ctl.load_state(session)
    dom = ctl.lookup(domain)
    if not dom.isActive():
        raise NotRunning(session=session)
    with step(domain, "reading the definition before a snapshot"):
        st, reason = dom.state()
        # A pause QEMU made on a failed write (a full disk) is nobody's to keep: after the
        # snapshot the guest is run again, as a running one is, and QEMU retries the write and
        # pauses it again if the disk still fails. Kept as a pause, it outlived the error (CI,
        # thirty-fourth session: a restore's save-first on a full disk freed its own space, the
        # write went through, and the machine stayed paused until a recover).
        was_paused = st == libvirt.VIR_DOMAIN_PAUSED and \
            reason != libvirt.VIR_DOMAIN_PAUSED_IOERROR
        live_xml = dom.XMLDesc(0)
    disks = domxml.disks(live_xml)
    n = state.next_number()
    ctl.save_state(session, state)  # the number is spent even if this snapshot fails
    d = ctl.session_dir(session)
    # Verbs on one session are serialized, so any memory image still in staging was left by a
    # process that died mid-checkpoint: nothing will ever read it.
    staging = ctl.staging_dir(session)
    for stale in staging.glob("*.save"):
        stale.unlink(missing_ok=True)
    memory = staging / f"memory-{n}.save"
    overlays = {disk.target: d / f"{disk.target}-{n}.qcow2" for disk in disks}
    skip = [t for t in _other_disks(live_xml, set(overlays)) if t]
    flags = (libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC
             | libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_NO_METADATA)
    if live:
        flags |= libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_LIVE
    try:
        crash_point("vm.snapshot.take")  # nothing made yet but a number spent
        meter = _take(ctl, dom, domain, disks, memory, overlays, skip, flags, live, on_freeze,
                      was_paused)
    except VMError as exc:
        if not (was_paused and STALE_POSTMIGRATE in str(exc)):
            down = False
            with contextlib.suppress(VMError):  # (libvirt's own words then stand)
                down = went_down(dom, domain)
            if down:
                raise StoppedWhileSaved(session=session) from exc
            raise
        # An earlier snapshot of this paused guest was never followed by _repause (ksfs
        # before it, or a process killed right after libvirt returned): the failed call's
        # cleanup has just run it, so QEMU is plainly paused again and the snapshot can work.
        log.warning("snapshot of paused %s found QEMU still in its post-migration state; "
                    "reactivated it and took the snapshot again", domain)
        meter = _take(ctl, dom, domain, disks, memory, overlays, skip, flags, live, on_freeze,
                      was_paused)
    # The guest writes to the new overlays from now on, whatever becomes of this save (an
    # aborted one leaves its frozen layer in the chain): vm.detached must know where.
    for target, ds in state.disks.items():
        if target in overlays:
            ds.top = str(overlays[target])
    ctl.save_state(session, state)
    try:
        crash_point("vm.snapshot")
        # A guest powering off as its snapshot is taken: libvirt may say the snapshot worked
        # with no memory image written, or with one holding a guest past its power-off request,
        # which QEMU then acts on and a restored machine never sees (QA, nineteenth and
        # twentieth sessions).
        if went_down(dom, domain):
            raise StoppedWhileSaved(session=session)
        # The XML libvirt stored in the image itself: exactly what a restore of it starts from.
        xml = saveimage.read_header(memory).xml
        frozen_disks, base = _frozen_chain(state, disks, files_held_by(domain))
    except BaseException:
        memory.unlink(missing_ok=True)
        raise
    return Frozen(session, domain, f"snap-{n}", memory, xml, frozen_disks, base,
                  meter.paused_s, meter.t1 - meter.t0, meter.forced, live=live)


def went_down(dom: libvirt.virDomain, domain: str) -> bool:
    """The machine stopped or is stopping: shut off, shutting down, crashed, or paused by its
    guest's power-off or crash (QEMU waiting for libvirt to act on it)."""
    with step(domain, "reading its state after the snapshot"):
        if not dom.isActive():
            return True
        st, reason = dom.state()
    return st in (libvirt.VIR_DOMAIN_SHUTDOWN, libvirt.VIR_DOMAIN_SHUTOFF,
                  libvirt.VIR_DOMAIN_CRASHED) or (
        st == libvirt.VIR_DOMAIN_PAUSED and reason in (libvirt.VIR_DOMAIN_PAUSED_SHUTTING_DOWN,
                                                      libvirt.VIR_DOMAIN_PAUSED_CRASHED))


def stopped(ctl: DomainController, session: str, domain: str,
            xml_if_gone: str | None = None) -> Frozen:
    """The disks of a domain that is not running (shut off, crashed), as a Frozen without
    memory: nothing writes them, so its chain is read as it is. Nothing is committed or
    removed here; what the caller does next (a restore) replaces the chain anyway.

    A domain that is gone (undefined behind ksfs) with its files still in the session's
    directory: the disks are the overlays the machine last ran on (``DiskState.top``), and the
    Frozen carries ``xml_if_gone`` (the last checkpoint's definition); VMError without it."""
    if not ctl.exists(domain):
        return _gone(ctl, session, domain, xml_if_gone)
    settle_commits(ctl, session, domain)
    state = ctl.load_state(session)
    dom = ctl.lookup(domain)
    with step(domain, "reading the definition of a stopped machine"):
        if dom.isActive():
            raise VMError(f"domain {domain} is running; its disks are not stopped")
        xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_SECURE)
    frozen_disks, base = _frozen_chain(state, domxml.disks(xml))
    return Frozen(session, domain, "stopped", None, xml, frozen_disks, base)


def _gone(ctl: DomainController, session: str, domain: str, xml: str | None) -> Frozen:
    state = ctl.load_state(session)
    disks = []
    for target, ds in state.disks.items():
        top, fmt = ds.running_file
        if not os.path.exists(top):
            raise VMError(f"the machine of session {session} is gone and so is its disk "
                          f"{target} ({top}): nothing of it to save")
        disks.append(domxml.DiskInfo(target, top, fmt, ()))
    if xml is None or not disks:
        raise VMError(f"domain {domain} is gone: its disks cannot be read without a "
                      f"definition")
    frozen_disks, base = _frozen_chain(state, disks)
    return Frozen(session, domain, "stopped", None, xml, frozen_disks, base)


def _frozen_chain(state: SessionState, disks: list[domxml.DiskInfo],
                  held: set[tuple[int, int]] | None = None
                  ) -> tuple[list[FrozenDisk], str | None]:
    """Each disk's frozen chain as a source, and the one checkpoint their changed ranges are
    relative to (None, and every disk read whole, when the disks disagree or none has one).
    On failure the sources opened so far are closed."""
    frozen_disks: list[FrozenDisk] = []
    try:
        for disk in disks:
            frozen_disks.append(_frozen_disk(disk, state.disks.get(disk.target), held))
    except BaseException:
        for fd in frozen_disks:
            fd.source.close()
        raise
    bases = {state.disks[d.target].base_checkpoint if d.target in state.disks else None
             for d in frozen_disks}
    base = bases.pop() if len(bases) == 1 else None
    if base is None:
        for fd in frozen_disks:
            fd.changed = None
    return frozen_disks, base


def _frozen_disk(disk: domxml.DiskInfo, tracked: object,
                 held: set[tuple[int, int]] | None = None) -> FrozenDisk:
    top = disk.source
    # (in the format the definition gives it: the first save of an adopted raw disk has that
    # disk itself as its frozen top, and a probe would read what its guest wrote as a header)
    source = ChainSource(Path(top), f"mapping frozen disk {disk.target}", disk.fmt, held)
    names = [str(f) for f in source.files]
    root = getattr(tracked, "root", None)
    # (the root below at least one layer: a root that became the top itself, pivoted by an
    # active block commit outside ksfs, has taken writes no layer records)
    known = root is not None and root in names[1:]
    if not known:
        # A disk we do not track yet (or whose root left the chain): the top is its own root,
        # and nothing says what it holds, so the whole image must be read.
        root = top
    depth = names.index(root)
    changed = None
    if known and getattr(tracked, "base_checkpoint", None) is not None:
        changed = source.changed_since(depth)
    return FrozenDisk(disk.target, source.size, source, changed, top, root, names[:depth])


def _current_tops(ctl: DomainController, domain: str) -> set[Path]:
    try:
        return {Path(p) for p in ctl.disk_files(domain).values()}
    except VMError:
        return set()


def _take(ctl: DomainController, dom: libvirt.virDomain, domain: str,
          disks: list[domxml.DiskInfo], memory: Path, overlays: dict[str, Path], skip: list[str],
          flags: int, live: bool, on_freeze: Callable[[], None] | None,
          was_paused: bool) -> _PauseMeter:
    """Make the overlays (unless libvirt makes them) and take the snapshot; on failure remove
    what this call made and leave the guest as it was (running, or plainly paused)."""
    made: list[Path] = []  # overlays this call created, the only ones it may delete
    if ctl.cluster_size != 65536:
        try:
            for disk in disks:
                create_overlay(overlays[disk.target], disk.source, disk.fmt,
                               f"creating the overlay of {disk.target} of {domain}",
                               ctl.cluster_size)
                made.append(overlays[disk.target])
        except KsfsError:  # (NoSpace too: qemu-img on a full disk)
            for path in made:
                path.unlink(missing_ok=True)
            raise
        flags |= libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_REUSE_EXT
    meter = _PauseMeter(dom, live, on_freeze)
    try:
        with meter, step(domain, "taking the external snapshot"):
            dom.snapshotCreateXML(_snapshot_xml(memory, overlays, skip), flags)
    except KsfsError:
        # ATOMIC: libvirt rolled the disks back; drop whatever files it left behind. (NoSpace
        # too, which a full disk gives: it left an overlay per failed save behind, and a
        # guest the snapshot paused was not run again: QA.)
        memory.unlink(missing_ok=True)
        for path in overlays.values():
            if path.exists() and path not in _current_tops(ctl, domain):
                path.unlink(missing_ok=True)
        with contextlib.suppress(VMError):
            _restore_run_state(dom, domain, was_paused)
        raise
    try:
        _restore_run_state(dom, domain, was_paused)
    except KsfsError:
        memory.unlink(missing_ok=True)
        raise
    return meter


def _restore_run_state(dom: libvirt.virDomain, domain: str, was_paused: bool) -> None:
    """Leave the guest as the snapshot found it: running, or (paused before) paused."""
    if was_paused:
        _repause(dom, domain)
        return
    # A snapshot must never leave a running guest paused.
    with contextlib.suppress(libvirt.libvirtError):
        if dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED:
            dom.resume()


def _repause(dom: libvirt.virDomain, domain: str) -> None:
    """Bring a guest that was paused before its memory snapshot back to a plain pause.

    libvirt writes the memory of a snapshot by migrating to a file, and resumes the guest
    after it only if it was running. QEMU ends such a migration in run state "postmigrate"
    with every block node inactive (handed over to a destination that does not exist): a
    block commit then fails ("Block node is read-only") and so does the next memory snapshot
    ("Can't migrate the vm that was paused due to previous migration"). QEMU 10.0 added QMP
    blockdev-set-active to re-activate them while paused; in QEMU 7.2 only "cont" does, so resume
    and at once pause again: the guest runs a few milliseconds *after* the instant the
    checkpoint holds, and stays paused."""
    with step(domain, "re-activating the disks of a paused guest after its snapshot"):
        try:
            if dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED:
                dom.resume()
        finally:
            # Whatever happened, the guest must not be left running: the pause is the user's.
            if dom.isActive() and dom.state()[0] != libvirt.VIR_DOMAIN_PAUSED:
                dom.suspend()


def finish(ctl: DomainController, frozen: Frozen, checkpoint: str | None) -> None:
    if frozen.finished:
        return
    state = ctl.load_state(frozen.session)
    dom = ctl.lookup(frozen.domain)
    frozen.close()
    crash_point("vm.flatten")
    try:
        tops = ctl.disk_files(frozen.domain)  # the overlays the snapshot put the disks on
    except VMError:
        tops = {}
    for disk in frozen.disks:
        tracked = state.disks.get(disk.target)
        if tracked is None or tracked.root != disk.root:
            depth = [str(f) for f in disk.source.files].index(disk.root)
            tracked = state.disks[disk.target] = DiskState(disk.root, disk.source.formats[depth])
            if state.origins and not Path(disk.root).resolve().is_relative_to(
                    ctl.session_dir(frozen.session).resolve()):
                # A disk attached since the adoption is the user's too: a release after a
                # restore copies it out beside this file, as it does the first ones. (Not in
                # a session adopted before origins were recorded: there the old roots are
                # what is the user's, see restore._users_disks.)
                state.origins[disk.target] = [disk.root, tracked.root_fmt]
        label = checkpoint or frozen.token
        if disk.layers:
            # Said before the commit: once QEMU has folded the layers into the root, the root
            # holds this checkpoint, and a process killed before it records that would leave
            # the old label on it, so every later save would miss what these layers held
            # (settle_commits finishes the record from the chain).
            tracked.committing = {"label": label, "layers": list(disk.layers)}
            ctl.save_state(frozen.session, state)
            _commit(ctl, dom, frozen, disk)
            crash_point("vm.flatten.done")  # folded into the root, not yet recorded
            tracked.committing = None
        tracked.base_checkpoint = label
        tracked.top = tops.get(disk.target)
        tracked.root_stat = file_stat(tracked.root)  # after the commit, the last write ksfs makes
        # Saved per disk: should a later disk's commit fail, this one's root already holds the
        # new checkpoint, and its next changed ranges must be counted from it. (A failed commit
        # leaves its layers in the chain, so they are counted again next time: still correct.)
        ctl.save_state(frozen.session, state)
    frozen.memory_path.unlink(missing_ok=True)
    frozen.finished = True


def settle_commits(ctl: DomainController, session: str, domain: str) -> bool:
    """Finish the record of commits a killed finish() began (DiskState.committing): when its
    layers have left the disk's chain, the root holds the checkpoint they froze and takes its
    label; while they are still in the chain the old label stays right (the layers above the
    root still hold every change since it, and the next finish commits them). A commit job
    still running is waited for first. True when the state changed."""
    state = ctl.load_state(session)
    open_commits = {t: ds for t, ds in state.disks.items() if ds.committing}
    if not open_commits:
        return False
    dom = ctl.lookup(domain)
    with step(domain, "reading its disks"):
        active = dom.isActive()
    tops = {d.target: d for d in domxml.disks(ctl.xml(domain))}
    for target, ds in open_commits.items():
        chain = None
        if target in tops:
            if active:
                with step(domain, f"waiting for the block job on {target}"):
                    _wait_for_block_job(dom, domain, target, f"a block job on {target}")
            # as the qcow2 headers say (a stopped domain's definition may not list its
            # backing chain)
            with contextlib.suppress(VMError):
                chain = chain_files(tops[target].source, f"reading the chain of {target}",
                                    tops[target].fmt)
        if chain is None or ds.root not in chain[1:]:
            # cannot tell (a disk gone, a chain unreadable, or the root no longer below a
            # layer: something outside ksfs pivoted it): the next save reads the whole disk
            ds.base_checkpoint = None
        elif not any(layer in chain for layer in ds.committing["layers"]):
            ds.base_checkpoint = ds.committing["label"]
        ds.committing = None
    ctl.save_state(session, state)
    return True


def _wait_for_block_job(dom: libvirt.virDomain, domain: str, target: str, what: str,
                        abort: bool = False) -> None:
    """Wait up to COMMIT_TIMEOUT for the block job on ``target`` to end; past it, abort the job
    (with ``abort``) and raise VMError saying ``what`` did not finish."""
    deadline = time.monotonic() + COMMIT_TIMEOUT
    while dom.blockJobInfo(target, 0):
        if time.monotonic() > deadline:
            if abort:
                with contextlib.suppress(libvirt.libvirtError):
                    dom.blockJobAbort(target, 0)
            raise VMError(f"{what} of domain {domain} did not finish in {COMMIT_TIMEOUT:.0f} s")
        time.sleep(0.01)


def _commit(ctl: DomainController, dom: libvirt.virDomain, frozen: Frozen,
            disk: FrozenDisk) -> None:
    """Block-commit the frozen layers of one disk into its root and wait for the job."""
    name = frozen.domain
    with step(name, f"committing {disk.target} into {Path(disk.root).name}"):
        dom.blockCommit(disk.target, disk.root, disk.top, 0, 0)
        _wait_for_block_job(dom, name, disk.target, f"committing {disk.target}", abort=True)
    chain = _chain_files(ctl, name, disk.target)
    if any(layer in chain for layer in disk.layers):
        raise VMError(f"committing {disk.target} of domain {name} failed: the frozen layer is "
                      f"still in its backing chain")
    session_dir = str(ctl.session_dir(frozen.session))
    for layer in disk.layers:
        # Only files ksfs made (in the session's directory) are ever deleted.
        if layer.startswith(session_dir + "/"):
            Path(layer).unlink(missing_ok=True)


def _chain_files(ctl: DomainController, domain: str, target: str) -> list[str]:
    for disk in domxml.disks(ctl.xml(domain)):
        if disk.target == target:
            return [disk.source, *disk.backing]
    return []


def abort(ctl: DomainController, frozen: Frozen) -> None:
    """Drop the memory image; the frozen layers stay in the chain until the next finish."""
    if frozen.finished:
        return
    frozen.close()
    with contextlib.suppress(OSError):
        if frozen.memory_path is not None:
            frozen.memory_path.unlink(missing_ok=True)
    frozen.finished = True
