"""Restore a checkpoint into its own domain, or fork it into a new domain beside the parent.

Both materialize each disk from its reader into a new sparse base file with a fresh qcow2 overlay
on top (so the next snapshot is incremental against this checkpoint), materialize the memory
save image, and restore it paused with ``virDomainRestoreFlags``. A restore passes the updated
XML as libvirt's ``dxml``; a fork rewrites the XML in the save image's own header (new name,
UUID, MACs, disks, log, lineage), since libvirt refuses a dxml that changes the UUID. A
checkpoint without memory (the disks of a machine found stopped) is booted paused from its disks
and XML instead. The caller resumes. Must never touch the parent of a fork, nor files outside
the session's directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import libvirt

from ksfs import progress
from ksfs.crashpoints import crash_point
from ksfs.errors import AlreadyExists, VMError
from ksfs.vm import domxml, files, saveimage
from ksfs.vm.chain import create_overlay, materialize
from ksfs.vm.state import DiskState, Restored, SessionState, load_state
from ksfs.vm.steps import step

if TYPE_CHECKING:
    from ksfs.vm.controller import DomainController

log = logging.getLogger(__name__)


def _materialize_all(ctl: DomainController, session: str, domain: str, n: int,
                     memory: object | None, disks: dict[str, object]
                     ) -> tuple[Path | None, dict[str, Path], dict[str, Path]]:
    """Write memory and disks into the session's directory: (memory, bases, overlays); no
    memory file when ``memory`` is None.

    Each file is written by its own thread: the readers (store files) are thread-safe, and
    hashing and decompression in the store release the GIL. Touches no state.json, so it may
    run beside a save of the same session (``stage``). The memory file is not named ``*.save``:
    a snapshot clears those from staging as leftovers of a dead process.
    """
    d = ctl.session_dir(session)
    mem = ctl.staging_dir(session) / f"restore-{n}.image" if memory is not None else None
    bases = {t: d / f"{domxml_safe(t)}-base-{n}.raw" for t in disks}
    overlays = {t: d / f"{domxml_safe(t)}-{n}.qcow2" for t in disks}
    jobs = [(memory, mem, f"materializing the memory image of {domain}")] if mem else []
    jobs += [(reader, bases[t], f"materializing disk {t} of {domain}")
             for t, reader in disks.items()]
    made: list[Path] = []  # overlays created here: a file that was in the way is not ours
    steps = progress.Steps("writing the checkpoint's memory and disks",
                           sum(int(r.size) for r, _, _ in jobs))  # type: ignore[attr-defined]
    try:
        with ThreadPoolExecutor(max_workers=min(len(jobs), 4)) as pool:
            futures = [pool.submit(materialize, r, p, what, steps=steps) for r, p, what in jobs]
            for f in futures:
                f.result()
        for target, base in bases.items():
            create_overlay(overlays[target], base, "raw",
                           f"creating the overlay of {target} of {domain}", ctl.cluster_size)
            made.append(overlays[target])
        if mem is not None:
            saveimage.read_header(mem)  # fail here, clearly, on a damaged memory image
    except BaseException:
        for p in (mem, *bases.values(), *made):
            if p is not None:
                p.unlink(missing_ok=True)
        raise
    return mem, bases, overlays


def domxml_safe(target: str) -> str:
    if not target or "/" in target or target.startswith("."):
        raise VMError(f"bad disk target name {target!r}")
    return target


def _check_disks(xml: str, disks: dict[str, object], domain: str) -> None:
    wanted = {d.target for d in domxml.disks(xml)}
    if set(disks) != wanted:
        raise VMError(f"the checkpoint of {domain} has disks {sorted(wanted)} but "
                      f"{sorted(disks)} were given")


def _session_files_except(ctl: DomainController, session: str, keep: set[Path]) -> list[Path]:
    """The session's disk files (``*.qcow2``, ``*.raw``, and ``*.raw.part``: a materialized
    file a killed restore or fork never finished) other than those in ``keep``, told apart by
    device and inode: the paths in ``keep`` may spell the store another way (a symlink, a bind
    mount) than this process does. Nothing when a file to keep cannot be looked at."""
    try:
        kept = {file_id(p) for p in keep}
    except OSError:
        return []
    d = ctl.session_dir(session)
    out = []
    for p in list(d.glob("*.qcow2")) + list(d.glob("*.raw")) + list(d.glob("*.raw.part")):
        try:
            if file_id(p) not in kept:
                out.append(p)
        except OSError:
            pass  # gone meanwhile, or not to be looked at: kept
    return out


@dataclass
class Staged:
    """A checkpoint's memory and disks written out for a restore that has not happened yet."""

    n: int
    memory: Path | None  # None: a checkpoint without memory, booted from its disks
    bases: dict[str, Path]  # disk target -> materialized base
    overlays: dict[str, Path]
    seconds: float

    def discard(self) -> None:
        for p in (self.memory, *self.bases.values(), *self.overlays.values()):
            if p is not None:
                p.unlink(missing_ok=True)


def reserve(ctl: DomainController, session: str) -> int:
    """Spend a file number for a restore's files (state.json: call it from the verb's thread)."""
    state = ctl.load_state(session)
    n = state.next_number()
    ctl.save_state(session, state)
    return n


def stage(ctl: DomainController, session: str, domain: str, n: int, memory: object | None,
          disks: dict[str, object]) -> Staged:
    """Materialize a restore's files under number ``n`` (from ``reserve``). Safe to run on
    another thread while the same session saves, so a restore's save-first and its
    materialization overlap."""
    t0 = time.monotonic()
    mem, bases, overlays = _materialize_all(ctl, session, domain, n, memory, disks)
    return Staged(n, mem, bases, overlays, time.monotonic() - t0)


def restore(ctl: DomainController, session: str, domain: str, memory: object | None,
            disks: dict[str, object], xml: str | None, checkpoint: str | None,
            staged: Staged | None = None,
            fw_cfg: dict[str, str | Path] | None = None) -> Restored:
    if staged is None:
        staged = stage(ctl, session, domain, reserve(ctl, session), memory, disks)
    state = ctl.load_state(session)
    try:
        # A domain undefined behind ksfs's back is made again from the checkpoint's XML.
        dom = ctl.lookup(domain) if ctl.exists(domain) else None
    except BaseException:
        staged.discard()
        raise
    n, mem, bases, overlays = staged.n, staged.memory, staged.bases, staged.overlays
    timings = {"materialize": staged.seconds}
    old_stopped = False
    uuid = None  # the UUID the machine will have: only a domain of it is undone on failure
    try:
        new_xml = _start_xml(mem, xml, domain)
        _check_disks(new_xml, bases, domain)
        new_xml = domxml.set_disk_sources(
            new_xml, {t: (str(p), "qcow2") for t, p in overlays.items()})
        if fw_cfg is not None:
            # (a checkpoint taken before tokens went by file has its token as text)
            new_xml = domxml.set_fw_cfg(new_xml, fw_cfg)
        new_xml = domxml.append_console_logs(new_xml)
        if (console := domxml.console_log_path(new_xml)) is not None:
            files.clear_planted(console, ctl.session_dir(session))
        # Before anything is stopped: the kernel and initrd QEMU boots from are the session's
        # own (a checkpoint's XML may name a parent's copy or a guest directory since gone).
        new_xml = files.own_boot_files(new_xml, ctl.session_dir(session), ctl.workdir, domain,
                                       keep_outside=state.adopted)
        persistent = False
        if dom is not None:
            with step(domain, "reading its UUID"):
                uuid = dom.UUIDString()
                # QA (fifteenth session): a domain undefined behind ksfs's back while it ran
                # is transient; restored as it was, its next stop would lose it.
                persistent = bool(dom.isPersistent())
            if state.uuid and uuid != state.uuid and not state.adopted:
                raise VMError(f"domain {domain} (UUID {uuid}) is not the machine of session "
                              f"{session} (UUID {state.uuid}): it was defined outside ksfs; "
                              f"undefine or rename it, then restore again")
        else:
            # the UUID the session's machine had (a fork's checkpoint XML holds its parent's,
            # which libvirt refuses while the parent runs)
            uuid = state.uuid or domxml.uuid_of(new_xml)
        state.uuid = uuid
        if domxml.uuid_of(new_xml) != uuid or domxml.domain_name(new_xml) != domain:
            # A checkpoint of another domain (a parent's): take this domain's identity, keeping
            # everything else, and put it in the header, as libvirt checks the UUID there.
            root = ET.fromstring(new_xml)
            root.find("name").text = domain  # type: ignore[union-attr]
            root.find("uuid").text = uuid  # type: ignore[union-attr]
            new_xml = ET.tostring(root, encoding="unicode")
            if mem is not None:
                saveimage.rewrite_xml(mem, new_xml)
        files.check_start_files(new_xml, set(overlays), mem is not None,
                                f"checkpoint {checkpoint or domain}",
                                "the machine was not stopped")
        # Before the machine is touched: once libvirt runs these files, a restore killed before
        # it recorded them is finished by recover (settle), not left half known.
        label = checkpoint or f"restore-{n}"
        state.pending = {"label": label, "bases": {t: str(p) for t, p in bases.items()},
                         "overlays": {t: str(p) for t, p in overlays.items()}}
        ctl.save_state(session, state)
        crash_point("vm.restore")
        t1 = time.monotonic()
        with step(domain, "stopping the running machine for a restore"):
            if dom is not None and dom.isActive():
                dom.destroy()
        # From here a running domain of this UUID is one this restore started, even before
        # _start_paused returns (QA: Ctrl-C inside virDomainRestoreFlags left the new machine
        # running on the files removed below, and recover resumed it there).
        old_stopped = True
        t2 = time.monotonic()
        _start_paused(ctl, domain, mem, new_xml, dxml=new_xml)
        crash_point("vm.restore.started")  # (where a Ctrl-C lands after libvirt's restore)
        crash_point("vm.restore.define")
        t3 = time.monotonic()
        if not persistent:
            with step(domain, "defining the restored machine again"):
                ctl.conn.defineXML(new_xml)
        own = {t: p for t, p in domxml.boot_files(new_xml).items()
               if Path(p).parent == ctl.session_dir(session)}
        _redefine(ctl, domain, overlays, own, ctl.session_dir(session), fw_cfg)
        timings.update(destroy=t2 - t1, restore=t3 - t2, redefine=time.monotonic() - t3)
    except BaseException:
        if old_stopped or dom is None:
            # A machine started on the files removed below would run on deleted files that no
            # save can read: stop it (the old one was stopped already; its definition and
            # chain are untouched, so recover brings it back). One made again goes entirely;
            # never a user's domain that took the name meanwhile (its start failed for it).
            with contextlib.suppress(libvirt.libvirtError):
                now = ctl.conn.lookupByName(domain)
                if now.UUIDString() == uuid:
                    now.destroy()
                    if dom is None:
                        now.undefine()
        for p in (*bases.values(), *overlays.values()):
            p.unlink(missing_ok=True)
        if state.pending is not None:
            state.pending = None
            with contextlib.suppress(OSError):
                ctl.save_state(session, state)
        raise
    finally:
        if mem is not None:
            mem.unlink(missing_ok=True)
    _take_new_chain(ctl, session, state, bases, overlays, label, new_xml)
    return Restored(domain, session, {t: str(p) for t, p in bases.items()}, label, timings)


def _take_new_chain(ctl: DomainController, session: str, state: SessionState,
                    bases: dict[str, Path], overlays: dict[str, Path], label: str,
                    xml: str) -> None:
    """Record the restored chain roots as the session's disks and remove every other file of
    the session (the old chain, leftovers of restores that died staging) but those the
    restored machine's other disks (``xml``) run on."""
    old_roots = {Path(ds.root) for ds in state.disks.values()}
    state.disks = {t: DiskState(str(p), "raw", label, top=str(overlays[t]))
                   for t, p in bases.items()}
    state.pending = None
    ctl.save_state(session, state)
    keep = set(bases.values()) | set(overlays.values())
    ours = {str(p) for p in overlays.values()}
    for f, fmt in domxml.formatted_sources(xml):
        if f not in ours:  # an older ksfs layered read-only disks: such a layer is in use
            # (only files that are there: one to keep that cannot be looked at keeps all)
            keep |= {p for p in chain_file_set(Path(f), fmt=fmt) if p.exists()}
    # memory images of restores that died staging (verbs on a session are serialized)
    for p in ctl.staging_dir(session).glob("restore-*.image*"):
        p.unlink(missing_ok=True)
    for p in _session_files_except(ctl, session, keep):
        if state.adopted and any(same_file(p, own) for own in _users_disks(state, old_roots)):
            continue  # an adopted disk in our directory is still the user's
        p.unlink(missing_ok=True)


def _users_disks(state: SessionState, old_roots: set[Path]) -> set[Path]:
    """The files of an adopted session that are the user's own disks: those it had when it
    was adopted. A session adopted by a ksfs that did not record them: the old roots, but
    not one a restore made (named ``<target>-base-<n>.raw``), which a later restore must
    remove (QA: each restore left the previous one's whole disk copy behind)."""
    if state.origins:
        return {Path(f) for f, _fmt in state.origins.values()}
    return {r for r in old_roots if not re.fullmatch(r".+-base-\d+\.raw", r.name)}


def chain_file_set(top: Path, strict: bool = False, fmt: str | None = None) -> set[Path]:
    """The files of the qcow2/raw chain whose top is ``top`` in format ``fmt`` (just ``top``
    when it cannot be read: a file in doubt is kept; with ``strict`` the VMError is raised)."""
    from ksfs.vm.chain import chain_files

    try:
        return {Path(f) for f in chain_files(top, "reading a disk chain", fmt)} | {top}
    except VMError:
        if strict:
            raise
        return {top}


def files_in_use(ctl: DomainController, domain: str, strict: bool = False
                 ) -> tuple[set[Path], str]:
    """Every file of the domain's live and defined disk chains, and its live XML ("" when it
    is not running). The domain must exist. A chain that cannot be read counts as its top
    alone, or with ``strict`` raises VMError."""
    dom = ctl.lookup(domain)
    live_xml = ""
    with step(domain, "reading the disks it runs on"):
        xmls = [dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)]
        if dom.isActive():
            live_xml = dom.XMLDesc(0)
            xmls.append(live_xml)
    in_use: set[Path] = set()
    for x in xmls:
        kept = {d.source for d in domxml.disks(x)}
        # every disk's, kept or not: an older ksfs layered read-only disks too
        for f, fmt in domxml.formatted_sources(x):
            if f in kept:
                in_use |= chain_file_set(Path(f), strict, fmt)
            else:  # a cdrom's image may be gone: no use of a file that is not there
                in_use |= {p for p in chain_file_set(Path(f), fmt=fmt) if p.exists()}
    return in_use, live_xml


def unused_disk_files(ctl: DomainController, session: str, domain: str) -> list[Path]:
    """Disk files in the session's directory that neither the domain's chains nor the
    session's state name: what a restore or fork killed while it wrote the target's files
    (before it recorded them as pending), or the old layers of a chain a killed verb had
    replaced, left. Nothing when a restore is pending (settle decides about its files) or the
    domain is gone (its state's roots are what it will be made again from), the session has no
    state yet (a fork or session new killed early: recover rolls it back), libvirt still runs a
    job on the domain (a snapshot a killed save began may be opening its overlay), or any file
    in use cannot be looked at. Files are told apart by device and inode, not by path: the
    store may be reached by another spelling (a symlink, a bind mount) than the one the domain
    and the state were written with."""
    state = load_state(ctl._state_path(session))
    if state is None or state.pending or not ctl.exists(domain):
        return []
    try:
        if _job_running(ctl, domain):
            return []
        in_use, _ = files_in_use(ctl, domain, strict=True)
    except VMError:
        return []  # a chain it cannot read: no file is known to be unused
    own = {Path(f) for f, _fmt in state.origins.values()}  # an adopted domain's, kept
    return _session_files_except(ctl, session,
                                 in_use | own | {Path(ds.root) for ds in state.disks.values()})


def same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def file_id(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _job_running(ctl: DomainController, domain: str) -> bool:
    dom = ctl.lookup(domain)
    with step(domain, "asking whether a job runs on it"):
        if not dom.isActive():
            return False  # no QEMU, no job
        if dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE:
            return True
        return any(dom.blockJobInfo(d.target, 0) for d in domxml.disks(dom.XMLDesc(0)))


def settle(ctl: DomainController, session: str, domain: str) -> str | None:
    """Finish the controller's part of a restore killed after it handed its files to libvirt:
    when the machine runs on the pending overlays, they become the session's chain (and the
    persistent definition's), and the checkpoint label is returned; a pending restore the
    machine does not run on is dropped with its files. None when nothing was pending."""
    state = ctl.load_state(session)
    pending = state.pending
    if not pending:
        return None
    bases = {t: Path(p) for t, p in pending["bases"].items()}
    overlays = {t: Path(p) for t, p in pending["overlays"].items()}
    running_on = None
    live_xml = ""
    in_use: set[Path] = set()
    if ctl.exists(domain):
        in_use, live_xml = files_in_use(ctl, domain)
        if live_xml:
            running_on = {d.target: d.source for d in domxml.disks(live_xml)}
    if running_on is None or set(running_on) != set(overlays) or not all(
            same_file(running_on[t], overlays[t]) for t in overlays):
        # Not (or no longer: a save has layered on it since) exactly the restore's files:
        # what no chain uses goes, and the session's state stays as the save left it.
        try:  # by device and inode (see _session_files_except); none when in doubt
            in_ids = {file_id(p) for p in in_use}
        except OSError:
            in_ids = None
        for p in (*bases.values(), *overlays.values()):
            with contextlib.suppress(OSError):
                if in_ids is not None and file_id(p) not in in_ids:
                    p.unlink()
        state.pending = None
        ctl.save_state(session, state)
        return None
    own = {t: p for t, p in domxml.boot_files(live_xml).items()
           if same_file(Path(p).parent, ctl.session_dir(session))}
    _redefine(ctl, domain, overlays, own, ctl.session_dir(session))
    _take_new_chain(ctl, session, state, bases, overlays, pending["label"], live_xml)
    return pending["label"]


def _start_xml(mem: Path | None, xml: str | None, domain: str) -> str:
    """The XML a checkpoint starts from: the one given, else its save image's."""
    if xml:
        return xml
    if mem is None:
        raise VMError(f"a checkpoint of {domain} without memory needs its domain XML to boot")
    return saveimage.read_header(mem).xml


def _start_paused(ctl: DomainController, domain: str, mem: Path | None, xml: str,
                  dxml: str | None) -> None:
    """Start the machine paused: from its memory image (with ``dxml``, else the image's own
    XML), else booted from its disks with ``xml`` (an inactive persistent domain of that name
    and UUID takes it as its live definition)."""
    if mem is not None:
        progress.report("loading the memory image into the machine")
        with step(domain, "restoring from the memory image"):
            ctl.conn.restoreFlags(str(mem), dxml, libvirt.VIR_DOMAIN_SAVE_PAUSED)
    else:
        progress.report("booting the checkpoint's disks (it has no memory)")
        with step(domain, "booting from the checkpoint's disks (it has no memory)"):
            ctl.conn.createXML(xml, libvirt.VIR_DOMAIN_START_PAUSED)


def _redefine(ctl: DomainController, domain: str, overlays: dict[str, Path],
              boot: dict[str, str] | None, session_dir: Path,
              fw_cfg: dict[str, str | Path] | None = None) -> None:
    """Point the persistent definition at the new disks (and the session's own kernel and
    initrd, and its fw_cfg entries: a token given as text before they went by file must not
    come back at a cold boot) too, so a cold boot finds them, and give it the restored
    machine's set of disks:
    one hot-plugged after the checkpoint would name a file the restore deletes (QA). The
    machine runs by now: a definition libvirt refuses with the disks matched (a re-added
    disk's address taken since) is retried without their addresses, then made as before."""
    dom = ctl.lookup(domain)
    with step(domain, "updating the persistent definition"):
        if not dom.isPersistent():
            return
        secure = libvirt.VIR_DOMAIN_XML_SECURE
        inactive = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE | secure)
        running = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_MIGRATABLE | secure) \
            if dom.isActive() else None
        sources = {t: (str(p), "qcow2") for t, p in overlays.items()}

        def stale(path: str) -> bool:
            return Path(path).resolve().is_relative_to(session_dir.resolve())

        tries = [domxml.match_disks(inactive, running, stale, keep) for keep in (True, False)] \
            if running else []
        tries.append(inactive)  # as before: only the restored disks pointed anew
        for n, xml in enumerate(tries):
            xml = domxml.set_disk_sources(xml, sources)
            if boot:
                xml = domxml.set_boot_files(xml, boot)
            if fw_cfg is not None:
                xml = domxml.set_fw_cfg(xml, fw_cfg)
            try:
                ctl.conn.defineXML(xml)
                return
            except libvirt.libvirtError as exc:
                if n == len(tries) - 1:
                    raise
                log.warning("libvirt refused the definition of %s with its disks matched to "
                            "the restored machine's (%s); trying the next way", domain,
                            exc.get_error_message())


def fork(ctl: DomainController, new_session: str, new_domain: str, memory: object | None,
         disks: dict[str, object], xml: str | None, lineage: str | None,
         checkpoint: str | None, fw_cfg: dict[str, str | Path] | None = None) -> Restored:
    if ctl.exists(new_domain):
        raise AlreadyExists(what="domain", name=new_domain)
    if load_state(ctl.session_dir(new_session) / "state.json") is not None:
        raise AlreadyExists(what="session machine", name=new_session)
    d = ctl._make_session_dir(new_session)
    state = SessionState(new_domain)
    n = state.next_number()
    t0 = time.monotonic()
    try:
        mem, bases, overlays = _materialize_all(ctl, new_session, new_domain, n, memory, disks)
    except BaseException:
        ctl.remove_files(new_session)
        raise
    dom = None
    try:
        src_xml = _start_xml(mem, xml, new_domain)
        _check_disks(src_xml, disks, new_domain)
        log = d / "console.log" if domxml.console_log_path(src_xml) else None
        if log is not None:
            files.clear_planted(log, d)
        new_xml = domxml.rename_for_fork(src_xml, new_domain, log,
                                         new_session if lineage is None else lineage, d)
        if str(domxml.SOCKET_DIR) in new_xml:  # a socket path too long for its directory
            domxml.SOCKET_DIR.mkdir(mode=0o700, exist_ok=True)
        new_xml = domxml.set_disk_sources(
            new_xml, {t: (str(p), "qcow2") for t, p in overlays.items()})
        # The fork's own kernel and initrd (linked from its parent's copies in the store), so
        # it keeps booting whatever becomes of the parent or the guest directory.
        new_xml = files.own_boot_files(new_xml, d, ctl.workdir, new_domain)
        new_xml = files.own_nvram(new_xml, d, new_domain)
        files.check_start_files(new_xml, set(overlays), mem is not None,
                                f"checkpoint {checkpoint or new_domain}")
        if fw_cfg is not None:
            new_xml = domxml.set_fw_cfg(new_xml, fw_cfg)
        if mem is not None:
            saveimage.rewrite_xml(mem, new_xml)
        # Written before the domain exists, so a fork killed between its restore and its
        # define leaves a machine recover can define and the next save can use.
        label = checkpoint or f"fork-{n}"
        state.uuid = domxml.uuid_of(new_xml)
        state.disks = {t: DiskState(str(p), "raw", label) for t, p in bases.items()}
        ctl.save_state(new_session, state)
        crash_point("vm.fork")
        t1 = time.monotonic()
        _start_paused(ctl, new_domain, mem, new_xml, dxml=None)  # the header's, rewritten
        crash_point("vm.fork.started")
        with step(new_domain, "looking up the fork"):
            dom = ctl.conn.lookupByName(new_domain)
        t2 = time.monotonic()
        crash_point("vm.fork.define")
        with step(new_domain, "defining the fork persistently"):
            ctl.conn.defineXML(new_xml)
    except BaseException:
        if dom is None and state.uuid:
            # QA (eighteenth session): Ctrl-C just as libvirt's restore returned left the
            # fork's machine paused on the files removed below, and with state.json gone
            # nothing of ksfs would remove it. Found by the UUID recorded for it (never a
            # user's domain that took the name meanwhile).
            with contextlib.suppress(libvirt.libvirtError):
                now = ctl.conn.lookupByName(new_domain)
                if now.UUIDString() == state.uuid:
                    dom = now
        if dom is not None:
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
            with contextlib.suppress(libvirt.libvirtError):
                dom.undefine()
        ctl.remove_files(new_session)
        raise
    finally:
        if mem is not None:
            mem.unlink(missing_ok=True)
    timings = {"materialize": t1 - t0, "restore": t2 - t1, "redefine": time.monotonic() - t2}
    return Restored(new_domain, new_session, {t: str(p) for t, p in bases.items()}, label,
                    timings)
