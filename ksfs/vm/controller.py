"""DomainController: create or adopt libvirt domains, and run, pause and remove them.

The only libvirt user in ksfs (with checkpoint.py and restore.py beside it). Every libvirt or
subprocess failure leaves here as a VMError naming the domain and the step. ``workdir/<session>/``
holds a session's disk files, staging files, console log and state.json; the controller never
touches files outside it except an adopted domain's own disks (see docs/vm.md), and never
touches domains it was not asked about. Must never import the store, the ledger, trio or click.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import libvirt

from ksfs.errors import AlreadyExists, BadInput, KsfsError, NotFound, NotRunning, VMError
from ksfs.model import validate_name
from ksfs.regularfile import not_a_directory
from ksfs.vm import domxml, files
from ksfs.vm.probe import domain_type
from ksfs.vm.state import DiskState, Frozen, Restored, SessionState, load_state, save_state
from ksfs.vm.steps import step

if TYPE_CHECKING:
    from ksfs.vm.restore import Staged

log = logging.getLogger("ksfs.vm")

# A connection not heard from for this long is asked whether libvirtd still answers before it
# is used (one cheap round trip). Counted from the last answer, not the last use: a caller that
# uses the connection every half second would otherwise never have it checked, and its first
# verb after a libvirtd restart failed ("Broken pipe"). A restart takes longer than this.
CONN_CHECK_S = 0.25

_STATES = {
    libvirt.VIR_DOMAIN_NOSTATE: "nostate",
    libvirt.VIR_DOMAIN_RUNNING: "running",
    libvirt.VIR_DOMAIN_BLOCKED: "running",
    libvirt.VIR_DOMAIN_PAUSED: "paused",
    libvirt.VIR_DOMAIN_SHUTDOWN: "shutdown",
    libvirt.VIR_DOMAIN_SHUTOFF: "shutoff",
    libvirt.VIR_DOMAIN_CRASHED: "crashed",
    libvirt.VIR_DOMAIN_PMSUSPENDED: "pmsuspended",
}


MAX_CMDLINE = 2047  # bytes of a kernel command line on x86 (COMMAND_LINE_SIZE 2048, NUL)


class DomainController:
    """One libvirt connection and a work directory of per-session files.

    Invariant: a session's machine runs on a chain ``root <- [frozen layers] <- active overlay``
    per disk, every file of which but an adopted root lives in ``workdir/<session>/``.
    Callers serialize verbs on one session; verbs on different sessions may run at once.
    """

    def __init__(self, uri: str = "qemu:///system", workdir: Path | str = "/var/lib/ksfs/vm",
                 domain_type_cache: Path | None = None, cluster_size: int = 4096) -> None:
        # Overlay cluster size: the granularity of a checkpoint's changed ranges. 4 KiB (a guest
        # filesystem block) lets a save read about what the guest wrote; with 64 KiB (qcow2's
        # default, the store's chunk) each scattered 4 KiB write costs a 64 KiB read. Sizes
        # other than 64 KiB mean we make the overlays and hand them to libvirt with REUSE_EXT.
        if cluster_size & (cluster_size - 1) or not 512 <= cluster_size <= 2 << 20:
            raise VMError(f"overlay cluster size {cluster_size} is not a power of two in "
                          f"512 B .. 2 MiB")
        self.cluster_size = cluster_size
        self.uri = uri
        self.workdir = Path(workdir)
        self._type_cache = domain_type_cache or self.workdir / "domain-type.json"
        self._conn: libvirt.virConnect | None = None
        self._checked = 0.0  # when the connection was last known to answer
        self._domain_type: str | None = None

    # --- plumbing ----------------------------------------------------------------------------

    @property
    def conn(self) -> libvirt.virConnect:
        now = time.monotonic()
        if self._conn is not None and now - self._checked > CONN_CHECK_S:
            # isAlive() says yes on a socket libvirtd closed when it restarted (no event loop
            # runs to notice): ask it something, else the next verb fails with "Broken pipe"
            # (QA: the first verb after a libvirtd restart, through a running mount).
            try:
                self._conn.getLibVersion()
                self._checked = now
            except libvirt.libvirtError:
                self.close()
        if self._conn is None or not self._conn.isAlive():
            try:
                self._conn = libvirt.open(self.uri)
            except libvirt.libvirtError as exc:
                raise VMError(f"cannot connect to libvirt at {self.uri}: "
                              f"{exc.get_error_message()} (is libvirtd running? "
                              f"tools/start-libvirt starts it)") from exc
            self._checked = now
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._conn.close()
            self._conn = None

    @property
    def domain_type(self) -> str:
        if self._domain_type is None:
            self._domain_type = domain_type(self._type_cache)
        return self._domain_type

    def session_dir(self, session: str) -> Path:
        d = self.workdir / validate_name(session, "session name")
        return d

    def _make_session_dir(self, session: str) -> Path:
        d = self.session_dir(session)
        if d.is_symlink():
            # A machine's disks and memory would be written wherever it points, and its
            # removal would leave them there (QA, fifteenth session). (vm/ itself may be a
            # link the user made to put machines on another disk.)
            raise VMError(f"{d} is a symbolic link: a session's machine files are kept only "
                          "in a directory of its own; nothing was changed")
        staging = self.staging_dir(session)
        staging.mkdir(parents=True, exist_ok=True)
        # QEMU runs as libvirt-qemu: it must be able to reach the files in here. A vm/ that
        # is a link is the user's choice of place, and its mode theirs (security QA F11: a
        # store's vm -> /root had root's `session new` make /root 0755).
        for p in (self.workdir, d, staging):
            if not p.is_symlink():
                p.chmod(0o755)
        return d

    def staging_dir(self, session: str) -> Path:
        """The session's directory for memory images, refused when it is a link or no
        directory (security QA F10: a staging -> elsewhere link had root's saves write memory
        images there, delete the ``*.save`` files it held, and make it 0755). Whether it
        exists is the caller's business: a glob of one that is not there finds nothing."""
        staging = self.session_dir(session) / "staging"
        try:
            shape = not_a_directory(staging)
        except OSError as exc:
            raise VMError(f"cannot look at {staging}: {exc.strerror or exc}") from exc
        if shape:
            raise VMError(f"{staging} is {shape}: a session's memory images are kept only in a "
                          "directory of its own; remove it (ksfs makes it again); nothing was "
                          "changed")
        return staging

    def _state_path(self, session: str) -> Path:
        return self.session_dir(session) / "state.json"

    def load_state(self, session: str) -> SessionState:
        state = load_state(self._state_path(session))
        if state is None:
            raise VMError(f"session {session!r} has no machine under {self.workdir}")
        return state

    def save_state(self, session: str, state: SessionState) -> None:
        with step(state.domain, "saving controller state"):
            save_state(self._state_path(session), state)

    def lookup(self, domain: str) -> libvirt.virDomain:
        with step(domain, "looking up"):
            return self.conn.lookupByName(domain)

    def exists(self, domain: str) -> bool:
        try:
            self.conn.lookupByName(domain)
            return True
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return False
            raise VMError(f"looking up domain {domain} failed: {exc.get_error_message()}") from exc

    # --- creating and adopting ---------------------------------------------------------------

    def create(self, session: str, domain_name: str, kernel: Path | str,
               initrd: Path | str | None,
               disk: Path | str | files.DiskPlan, memory_mib: int = 256, vcpus: int = 1,
               cmdline: str | Callable[[files.DiskPlan], str] = "console=ttyS0 panic=-1 quiet",
               extra_cmdline: str = "",
               fw_cfg: dict[str, str | Path] | None = None) -> str:
        """Copy ``disk`` into the session's directory, define and start a direct-boot domain.
        ``disk`` may be the plan ``files.inspect_disk`` made of it already.

        The kernel command line gets ``ksfs.lineage=<session>`` unless it names a lineage;
        ``cmdline`` may be a function of the session's copy of the disk (its plan), asked once
        the copy is made. Returns the domain name.
        """
        if self.exists(domain_name):
            raise AlreadyExists(what="domain", name=domain_name)
        # BadInput (encrypted, not raw/qcow2) before any file
        plan = disk if isinstance(disk, files.DiskPlan) else files.inspect_disk(disk)
        d = self._make_session_dir(session)
        fmt = plan.fmt
        copy = d / f"vda-0.{fmt}"
        files.make_disk(plan, copy, f"making the disk of {domain_name}")
        # The domain names no file outside the session's directory: the guest's kernel and
        # initrd may move or go, and restores and forks boot QEMU from them again.
        # (no initrd: a kernel that mounts its root itself)
        boot = {"kernel": Path(kernel), **({"initrd": Path(initrd)} if initrd else {})}
        for tag, src in boot.items():
            boot[tag] = d / files.BOOT_NAMES[tag]
            files.copy_boot_file(src.resolve(), boot[tag], self.workdir)
        if callable(cmdline):
            cmdline = cmdline(files.DiskPlan(copy, fmt, None))
        full = " ".join(x for x in (cmdline, extra_cmdline) if x)
        if "ksfs.lineage=" not in full:
            full = domxml.set_cmdline_arg(full, "ksfs.lineage", session)
        if (size := len(full.encode())) > MAX_CMDLINE:
            # x86's COMMAND_LINE_SIZE with its NUL: past it the kernel boots nothing, silently
            # (QA, nineteenth session)
            raise BadInput(f"the kernel command line would be {size} bytes with "
                           f"ksfs's own parameters ({extra_cmdline or 'ksfs.lineage'}); the "
                           f"kernel takes at most {MAX_CMDLINE}")
        xml = domxml.new_domain_xml(domain_name, self.domain_type, boot["kernel"],
                                    boot.get("initrd"), copy, fmt, memory_mib, vcpus, full,
                                    d / "console.log")
        if fw_cfg:
            xml = domxml.set_fw_cfg(xml, fw_cfg)
        files.clear_planted(d / "console.log", d)
        self.save_state(session, SessionState(domain_name, {"vda": DiskState(str(copy), fmt)},
                                              uuid=domxml.uuid_of(xml)))
        with step(domain_name, "defining"):
            dom = self.conn.defineXML(xml)
        try:
            with step(domain_name, "starting"):
                dom.create()
        except KsfsError:  # (NoSpace too: a full disk is said so, not as a VMError)
            with contextlib.suppress(libvirt.libvirtError):
                dom.undefine()
            raise
        return domain_name

    def adopt(self, session: str, domain_name: str, start: bool = True) -> str:
        """Take an existing domain with file-backed raw or qcow2 disks; its XML is kept as is.

        A shut-off domain is started when ``start`` is true. The adopted disks stay where they
        are: snapshots put overlays in the session's directory on top of them, and finishing a
        checkpoint commits into them (as ``virsh blockcommit`` would).
        """
        dom = self.lookup(domain_name)
        with step(domain_name, "reading the definition"):
            xml = dom.XMLDesc(0)
            persistent = dom.isPersistent()
            # what the next boot runs: a running domain's definition may differ from its
            # live XML (review: a <transient/> disk or writable floppy only there was adopted,
            # and failed the first save or fork after a restart)
            defined = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE) if persistent else xml
        if not persistent:
            # (QA, eighteenth session) libvirt forgets a transient domain when it stops, and
            # a release would hand back a machine that vanishes at its next shutdown.
            raise BadInput(f"domain {domain_name} is transient (started without a definition): "
                           f"ksfs adopts defined domains; `virsh dumpxml {domain_name} > "
                           f"{domain_name}.xml && virsh define {domain_name}.xml` defines it")
        try:
            disks = domxml.disks(xml)
            for each in (xml, defined):
                domxml.disks(each)
                domxml.refuse_unkept_writable(each)
        except VMError as exc:
            # a block, network or shareable disk, or a writable floppy: the domain given is
            # not one ksfs can keep, which is the caller's input, not a fault of the machine
            # (QA, eighteenth session)
            raise BadInput(str(exc)) from None
        if not disks:
            raise BadInput(f"domain {domain_name} has no writable file-backed disk to keep")
        for dev in dict.fromkeys(domxml.transient_disks(xml) + domxml.transient_disks(defined)):
            raise BadInput(f"disk {dev} of domain {domain_name} is transient (<transient/>): "
                           f"QEMU drops its writes when the machine stops and libvirt takes no "
                           f"snapshot of it, so ksfs could save none; remove <transient/> from "
                           f"it (virsh edit {domain_name}) or detach it")
        for disk in disks:
            if disk.fmt not in ("raw", "qcow2"):
                raise BadInput(f"disk {disk.target} of {domain_name} is {disk.fmt}; ksfs keeps "
                               f"raw or qcow2 disks")
            files.check_adoptable(disk.target, disk.source, domain_name, disk.fmt)
        self._make_session_dir(session)
        state = SessionState(domain_name, {d.target: DiskState(d.source, d.fmt) for d in disks},
                             adopted=True,
                             origins={d.target: [d.source, d.fmt] for d in disks},
                             uuid=dom.UUIDString())
        self.save_state(session, state)
        if start and not dom.isActive():
            with step(domain_name, "starting"):
                dom.create()
        return domain_name

    # --- checkpoints (checkpoint.py and restore.py) ------------------------------------------

    def snapshot(self, session: str, domain: str, live: bool = True,
                 on_freeze: Callable[[], None] | None = None) -> Frozen:
        """Atomic external snapshot with memory; see ksfs.vm.checkpoint.snapshot.

        ``live`` (the default): copy memory while the guest runs and pause it only for the last
        dirty pages and the disk switch (tens of ms; after LIVE_COPY_LIMIT s of copying the
        guest is paused so the copy ends). ``live=False`` pauses the guest for the whole memory
        save (docs/performance.md compares them). ``on_freeze`` is called (on another thread)
        when the guest is first seen paused: the instant its checkpoint holds.
        """
        from ksfs.vm.checkpoint import snapshot

        return snapshot(self, session, domain, live=live, on_freeze=on_freeze)

    def stopped(self, session: str, domain: str, xml_if_gone: str | None = None) -> Frozen:
        """The disks of a domain that is not running (or gone, with ``xml_if_gone``), to be
        saved before anything replaces them; see ksfs.vm.checkpoint.stopped. Close it
        (``Frozen.close``) when done."""
        from ksfs.vm.checkpoint import stopped

        return stopped(self, session, domain, xml_if_gone)

    def has_disk_files(self, session: str) -> bool:
        """Whether every disk the session's state tracks still has the file the machine last
        ran on (a machine undefined behind ksfs leaves them)."""
        state = load_state(self._state_path(session))
        return bool(state and state.disks) and all(
            Path(ds.running_file[0]).exists() for ds in state.disks.values())

    def went_down(self, domain: str) -> bool:
        """Whether the machine stopped or is stopping (shut off, shutting down, crashed, gone):
        a save checks it before it publishes, since a guest that powered off during its
        snapshot can leave a memory image that never finishes powering off when restored."""
        from ksfs.vm.checkpoint import went_down

        if not self.exists(domain):
            return True
        return went_down(self.lookup(domain), domain)

    def finish(self, frozen: Frozen, checkpoint: str | None = None) -> None:
        """Commit the frozen layers into their root and drop the memory staging file."""
        from ksfs.vm.checkpoint import finish

        finish(self, frozen, checkpoint)

    def abort(self, frozen: Frozen) -> None:
        """Best-effort cleanup of a checkpoint whose ingest failed; the guest keeps running."""
        from ksfs.vm.checkpoint import abort

        abort(self, frozen)

    def restore(self, session: str, domain: str, memory: object, disks: dict[str, object],
                xml: str | None = None, checkpoint: str | None = None,
                staged: Staged | None = None,
                fw_cfg: dict[str, str | Path] | None = None) -> Restored:
        """Bring ``domain`` back to a checkpoint, paused; see ksfs.vm.restore.restore.

        ``staged``: its files already written by ``stage_restore`` (then memory and disks are
        not read again). ``fw_cfg``: the session's entries now, in place of the checkpoint's."""
        from ksfs.vm.restore import restore

        return restore(self, session, domain, memory, disks, xml, checkpoint, staged, fw_cfg)

    def hand_back_detached(self, session: str, domain: str,
                           on_done: Callable[[str, dict[str, str]], None] | None = None
                           ) -> dict[str, dict[str, str]]:
        """Give the user back each disk of an adopted domain detached while ksfs's layers were
        on it (their writes committed into the user's file, or copied out beside it); see
        ksfs.vm.detached. Returns target -> {"how", "file"}, each told to ``on_done`` as it
        is done; VMError when one cannot be."""
        from ksfs.vm.checkpoint import settle_commits
        from ksfs.vm.detached import hand_back

        if not self.exists(domain) or load_state(self._state_path(session)) is None:
            return {}
        settle_commits(self, session, domain)  # a killed save's commit ends first
        return hand_back(self, session, domain, on_done)

    def check_start_files(self, xml: str, label: str, from_memory: bool,
                          session: str | None = None) -> None:
        """NotFound when a checkpoint (``label``: "checkpoint S/C") with definition ``xml``
        names a host file that is gone (a cdrom image, a read-only disk, the firmware; with
        ``session``, the machine it restores, a kernel or initrd of which that session has
        no copy either): asked before anything is saved or stopped for its restore or fork."""
        files.check_start_files(xml, {d.target for d in domxml.disks(xml)}, from_memory,
                                label)
        gone = files.gone_boot_file(xml, self.session_dir(session)) if session else None
        if gone is not None:
            # QA (seventeenth session): found only by the restore itself, after its save-first
            raise NotFound(f"{label} needs its {gone[0]} {gone[1]}, which does not exist, nor "
                           f"does the session's copy of it; put it back there and try again "
                           f"(nothing was changed)")

    def restore_pending(self, session: str) -> bool:
        """A restore's files were handed to libvirt and not yet recorded (see settle)."""
        state = load_state(self._state_path(session))
        return state is not None and state.pending is not None

    def settle_restore(self, session: str, domain: str) -> str | None:
        """Finish the controller's part of a restore killed after libvirt took its files; see
        ksfs.vm.restore.settle. Returns the checkpoint label it finished, if any."""
        from ksfs.vm.restore import settle

        return settle(self, session, domain)

    def reserve_restore(self, session: str) -> int:
        """A file number for ``stage_restore``; call it from the verb's own thread."""
        from ksfs.vm.restore import reserve

        return reserve(self, session)

    def stage_restore(self, session: str, domain: str, n: int, memory: object,
                      disks: dict[str, object]) -> Staged:
        """Write a checkpoint's files for a later ``restore``; may run beside a save."""
        from ksfs.vm.restore import stage

        return stage(self, session, domain, n, memory, disks)

    def fork(self, new_session: str, new_domain: str, memory: object, disks: dict[str, object],
             xml: str | None = None, lineage: str | None = None,
             checkpoint: str | None = None,
             fw_cfg: dict[str, str | Path] | None = None) -> Restored:
        """Start a checkpoint as a new domain beside its parent, paused; see restore.fork."""
        from ksfs.vm.restore import fork

        return fork(self, new_session, new_domain, memory, disks, xml, lineage, checkpoint,
                    fw_cfg)

    # --- running, pausing, removing ----------------------------------------------------------

    def pause(self, domain: str, session: str | None = None) -> int:
        """Pause a running domain; returns its QEMU instance's id (see resume_instance)."""
        dom = self.lookup(domain)
        # (QA, nineteenth session: a crashed machine kept by on_crash=preserve, or one
        # suspended to RAM, is active too, and was said paused)
        st = dom.state()[0] if dom.isActive() else None
        if st not in (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_BLOCKED,
                      libvirt.VIR_DOMAIN_PAUSED):
            raise NotRunning(session=session or domain, state=_STATES.get(st, "shutoff"))
        if st != libvirt.VIR_DOMAIN_PAUSED:
            with step(domain, "pausing"):
                dom.suspend()
        return dom.ID()

    def resume_instance(self, domain: str, instance: int) -> bool:
        """Run the domain again if it is still the paused QEMU instance ``instance`` (a domain
        destroyed and started again, or restored, has a new id). Whether it was run."""
        dom = self.lookup(domain)
        with step(domain, "running the machine again"):
            if not dom.isActive() or dom.ID() != instance \
                    or dom.state()[0] != libvirt.VIR_DOMAIN_PAUSED:
                return False
            dom.resume()
        return True

    def resume(self, domain: str, fw_cfg: dict[str, str | Path] | None = None) -> None:
        """Run a paused domain; start a shut-off one, with its definition's ksfs fw_cfg entries
        set to ``fw_cfg`` first when given (a definition from before the guest token went by
        file holds it as text, which a start would put on QEMU's command line)."""
        dom = self.lookup(domain)
        try:
            with step(domain, "resuming"):
                if not dom.isActive():
                    if fw_cfg is not None and dom.isPersistent():
                        xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE
                                          | libvirt.VIR_DOMAIN_XML_SECURE)
                        new_xml = domxml.set_fw_cfg(xml, fw_cfg)
                        if domxml.fw_cfg(xml) != domxml.fw_cfg(new_xml):
                            self.conn.defineXML(new_xml)
                    dom.create()
                elif (st := dom.state()[0]) == libvirt.VIR_DOMAIN_PAUSED:
                    dom.resume()
                elif st == libvirt.VIR_DOMAIN_PMSUSPENDED:
                    dom.pMWakeup()
                elif st == libvirt.VIR_DOMAIN_CRASHED:
                    dom.destroy()  # the crashed guest's QEMU, kept by on_crash=preserve
                    dom.create()
        except VMError:
            # libvirt finishes a job whose client died (a start, a snapshot's resume): between
            # our look and our call it may have run the machine already, which is what we want.
            with step(domain, "reading its state after a failed resume"):
                running = dom.isActive() and dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
            if not running:
                raise

    def settle_dead_or_asleep(self, domain: str) -> str | None:
        """A domain active but not running the guest is made plain: a crashed one kept by
        ``on_crash=preserve`` is destroyed (its QEMU holds a dead guest; the disks stay as the
        crash left them, and the caller treats it as shut off), one suspended to RAM is woken
        (it runs on from its memory). Returns "crashed" or "pmsuspended" when it did so."""
        dom = self.lookup(domain)
        with step(domain, "reading its state"):
            st = dom.state()[0] if dom.isActive() else None
        if st == libvirt.VIR_DOMAIN_CRASHED:
            with step(domain, "stopping the crashed machine"):
                dom.destroy()
            return "crashed"
        if st == libvirt.VIR_DOMAIN_PMSUSPENDED:
            with step(domain, "waking the machine suspended to RAM"):
                dom.pMWakeup()
            deadline = time.monotonic() + 10
            while dom.state()[0] == libvirt.VIR_DOMAIN_PMSUSPENDED and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            return "pmsuspended"
        return None

    def state(self, domain: str) -> str:
        """running, paused, shutoff, crashed, ... or "absent" when no such domain exists."""
        try:
            st = self.conn.lookupByName(domain).state()[0]
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return "absent"
            raise VMError(f"reading the state of {domain} failed: "
                          f"{exc.get_error_message()}") from exc
        return _STATES.get(st, "unknown")

    def paused_on_io_error(self, domain: str) -> bool:
        """Whether QEMU paused the machine because a disk write failed (a full disk: libvirt's
        default error policy stops the guest rather than fail its writes)."""
        try:
            st, reason = self.conn.lookupByName(domain).state()
        except libvirt.libvirtError:
            return False
        return st == libvirt.VIR_DOMAIN_PAUSED and reason == libvirt.VIR_DOMAIN_PAUSED_IOERROR

    def holds_checkpoint(self, session: str) -> str | None:
        """The checkpoint label every disk's chain root holds (the last finished save, restore
        or fork), or None when they differ or nothing is known."""
        state = load_state(self._state_path(session))
        labels = {d.base_checkpoint for d in state.disks.values()} if state else set()
        return labels.pop() if len(labels) == 1 else None

    def persist(self, session: str, domain: str) -> bool:
        """Define a running domain ksfs made that libvirt holds only as transient (a fork killed
        between its restore and its define): it would vanish with the next libvirtd restart.
        Returns True when it defined it. Adopted domains are left as the user keeps them."""
        if load_state(self._state_path(session)) is None or self.load_state(session).adopted:
            return False
        dom = self.lookup(domain)
        with step(domain, "defining a transient domain persistently"):
            if not dom.isActive() or dom.isPersistent():
                return False
            self.conn.defineXML(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_SECURE))
        return True

    def transient(self, domain: str) -> bool:
        """True for a domain libvirt holds without a definition: gone once it stops."""
        dom = self.lookup(domain)
        with step(domain, "reading whether it is defined"):
            return not dom.isPersistent()

    def xml(self, domain: str, inactive: bool = False) -> str:
        flags = libvirt.VIR_DOMAIN_XML_SECURE
        if inactive:
            flags |= libvirt.VIR_DOMAIN_XML_INACTIVE
        with step(domain, "reading the definition"):
            return self.lookup(domain).XMLDesc(flags)

    def release_plan(self, session: str, domain: str) -> dict[str, dict[str, Any]]:
        """How each disk of an adopted domain leaves the session's files; see vm.release."""
        from ksfs.vm.release import plan

        return plan(self, session, domain)

    def release(self, session: str, domain: str,
                disks: dict[str, dict[str, Any]]) -> dict[str, str]:
        """Hand an adopted domain back on its own disk files, defined and in its state."""
        from ksfs.vm.release import release

        return release(self, session, domain, disks)

    def handed_back(self, session: str, disks: dict[str, dict[str, Any]]) -> list[str]:
        """The disks of a release plan already handed back (a release cut short part way)."""
        from ksfs.vm.release import handed_back

        return handed_back(self, session, disks)

    def destroy_and_undefine(self, domain: str, session: str | None = None,
                             made: bool = False) -> bool:
        """Stop the domain if it runs and remove its definition; absent domains are fine.

        Given ``session``, a domain of that name whose UUID is not the one the session's
        state recorded is not the session's machine (a user's, defined while ksfs's was being
        made or after it went): it is left alone, with a warning. So is a domain the session
        recorded no UUID of: ksfs records the UUID before it defines, so a session with none
        never had a machine of that name, or its state.json is gone or was written by someone
        else (security QA F4: a store's owner who took the UUID out of it and named another
        domain in the ledger had root's `session rm` destroy and undefine that domain). Its
        owner learns no UUID from the store: libvirt keeps domain definitions root's. ``made``
        is kept for the callers undoing a session that never started. Returns whether a
        domain was removed."""
        try:
            dom = self.conn.lookupByName(domain)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return False
            raise VMError(f"looking up {domain} failed: {exc.get_error_message()}") from exc
        state = None
        if session is not None:
            state = load_state(self._state_path(session))
            recorded = state.uuid if state is not None else None
            with step(domain, "reading its UUID"):
                actual = dom.UUIDString()
            if recorded != actual:
                log.warning("domain %s (UUID %s) is not the machine ksfs made for session %s "
                            "(%s): left as it is (`virsh destroy` and `virsh undefine` it if "
                            "it is yours to remove)", domain, actual, session,
                            f"UUID {recorded}" if recorded else
                            "none was defined" if made else "it recorded no UUID")
                return False
        with step(domain, "destroying"):
            if dom.isActive():
                dom.destroy()
        try:
            persistent = dom.isPersistent()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return True  # it was transient (a fork killed before its define): gone now
            raise VMError(f"looking up {domain} failed: {exc.get_error_message()}") from exc
        with step(domain, "undefining"):
            if persistent:
                # A domain with libvirt snapshot or checkpoint metadata (virt-manager's) is
                # otherwise refused, after it was destroyed. A UEFI domain's NVRAM file (its
                # boot entries) is kept: an adopted domain's is the user's file, and ksfs
                # deletes no file of the user's (QA, twelfth session; not tried here: no OVMF).
                dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                                  | libvirt.VIR_DOMAIN_UNDEFINE_KEEP_NVRAM
                                  | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                                  | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA)
        if state is not None and not state.adopted and not made:
            self._remove_qemu_logs(domain)  # (a failed start keeps its log: it says why)
        return True

    def _remove_qemu_logs(self, domain: str) -> None:
        """Delete libvirt's log of a domain ksfs made (QEMU's command line and messages,
        ``DOMAIN.log`` and its rotations), which libvirt keeps after the domain is gone: one
        per session ever made, never read again (review). An adopted domain's is left: the
        user's machine may come back under that name."""
        if self.uri.startswith("qemu:///system"):
            logs = Path("/var/log/libvirt/qemu")
        elif self.uri.startswith("qemu:///session"):
            logs = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
                / "libvirt" / "qemu" / "log"
        else:
            return  # another host's files
        for f in logs.glob(glob.escape(domain) + ".log*"):
            if f.name == f"{domain}.log" or f.name[len(domain) + 4:].lstrip(".").isdigit():
                try:
                    f.unlink()
                except OSError as exc:
                    log.warning("cannot remove libvirt's log %s: %s", f, exc.strerror or exc)

    def drop_leftovers(self, session: str, domain: str | None = None) -> int:
        """Delete what a killed verb of the session left that nothing will read: memory images
        in staging (a save's, a restore's), half-materialized ``*.part`` files and, given the
        session's domain, disk files none of its chains uses (restore.unused_disk_files).
        Call it holding the session's lock (no verb of it running). Returns the bytes given
        back."""
        from ksfs.vm.checkpoint import settle_commits
        from ksfs.vm.restore import unused_disk_files

        d = self.session_dir(session)
        freed = 0
        if domain and self.exists(domain) and load_state(self._state_path(session)):
            try:  # before the labels say where the disks are (the next snapshot does it too)
                settle_commits(self, session, domain)
            except VMError as exc:
                log.warning("could not settle the commits of %s yet: %s", session, exc)
        unused = unused_disk_files(self, session, domain) if domain else []
        staging = self.staging_dir(session)
        for p in [*staging.glob("*.save"), *staging.glob("restore-*.image*"),
                  *d.glob("*.part"), *unused]:
            try:
                size = p.stat().st_blocks * 512
                p.unlink()
                freed += size
            except FileNotFoundError:
                pass
            except OSError as exc:  # left for the next save or restore, which clear it too
                log.warning("cannot remove leftover %s: %s", p, exc.strerror or exc)
        return freed

    def remove_files(self, session: str, keep_boot: bool = False) -> None:
        """Delete ``workdir/<session>/`` (its overlays, staging, log and state).

        ``keep_boot``: leave the session's kernel and initrd, which its kept checkpoints' domain
        XML names, so that forks of those checkpoints still boot.
        """
        d = self.session_dir(session)
        if d.is_symlink():  # never made so by ksfs: not followed, nor its state.json read
            d.unlink()
            return
        from ksfs.vm.detached import tmp_for

        with contextlib.suppress(VMError):  # a killed hand-back's copy beside a user's disk
            for ds in (load_state(self._state_path(session)) or SessionState("")).disks.values():
                where = ds.handing_back if isinstance(ds.handing_back, dict) else {}
                tmp, dest = where.get("tmp"), where.get("dest")
                if not (isinstance(tmp, str) and isinstance(dest, str)):
                    continue
                # only the name ksfs gives it (security QA F2: root's `session rm` deleted
                # any file a state.json named here, the user's store being theirs to write)
                if tmp == str(tmp_for(Path(dest))):
                    Path(tmp).unlink(missing_ok=True)
        if not keep_boot:
            shutil.rmtree(d, ignore_errors=True)
            return
        boot = set(files.BOOT_NAMES.values())
        for entry in d.iterdir() if d.is_dir() else ():
            if entry.name in boot and entry.is_file():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def console_log(self, session: str) -> Path | None:
        """The serial console log of the session's domain, if it logs to a file."""
        state = load_state(self._state_path(session))
        default = self.session_dir(session) / "console.log"
        if state is None:
            return default if default.exists() else None
        try:
            path = domxml.console_log_path(self.xml(state.domain))
        except VMError:
            path = None
        if path:
            return Path(path)
        return default if default.exists() else None

    def disk_files(self, domain: str) -> dict[str, str]:
        """target -> current top file of each file-backed disk."""
        return {d.target: d.source for d in domxml.disks(self.xml(domain))}

    def chain_files(self, domain: str) -> set[Path]:
        """Every file of every disk chain the domain runs on or is defined on (cdroms and
        read-only disks too), as the images' headers name them (a chain that cannot be read:
        its top alone). Asks nothing of the disks but their files: a disk ksfs cannot keep
        is for ``adopt`` to refuse."""
        from ksfs.vm.restore import chain_file_set

        xmls = {self.xml(domain), self.xml(domain, inactive=True)}
        return {f for x in xmls for src, fmt in domxml.formatted_sources(x)
                for f in chain_file_set(Path(src), fmt=fmt)}
