"""Handing an adopted domain back to its user: ``session rm --release``.

The domain stays defined and in its state (running, paused or shut off); only the files ksfs
put into its disk chains leave them. Each disk ends on one file outside the session's
directory:

- ``commit``: the chain's root is still the user's own disk (no restore since the adoption):
  ksfs's layers are committed into it, as every save already does with its frozen layer. A
  running machine does it live (an active block commit, then a pivot).
- ``copy``: the root is a file ksfs made (a restore wrote the checkpoint's disk into the
  session's directory): the whole disk is copied to a new file beside the disk the domain had
  when it was adopted (``disk.released.qcow2`` for ``disk.qcow2``), in that disk's format. A
  running machine does it live (a block copy, then a pivot). The user's old disk file is left
  as it is: it holds the machine as it was before the restore.

``plan`` decides (before anything changes, so the keeper can record it first); ``release``
carries a plan out, and carries out the same plan again after a kill part way: a disk whose
chain already holds no file of the session is done, a block job found running is the killed
release's own and is finished, a copy's destination not yet in the chain is its partial output.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import quoteattr

import libvirt

from ksfs.crashpoints import crash_point
from ksfs.errors import BadInput, KsfsError, VMError
from ksfs.vm import domxml
from ksfs.vm.chain import chain_files, qemu_img
from ksfs.vm.restore import chain_file_set
from ksfs.vm.steps import step

if TYPE_CHECKING:
    from ksfs.vm.controller import DomainController

JOB_TIMEOUT = 3600.0  # a copy of a large disk under TCG load; each second is polled
CONVERT_TIMEOUT = 3600.0


def inside(path: str | Path, directory: Path) -> bool:
    return Path(path).resolve().is_relative_to(directory.resolve())


def _chain(disk: domxml.DiskInfo) -> list[str]:
    """The files of the chain a disk runs on, its top read in the format its driver gives."""
    return chain_files(disk.source, f"reading the chain of {disk.source}", disk.fmt)


def _disks(xml: str) -> dict[str, domxml.DiskInfo]:
    return {d.target: d for d in domxml.disks(xml)}


RELEASED = re.compile(r"\.released(-\d+)?$")  # the stem of a copy a release made


def released_name(origin: Path) -> Path:
    """``disk.qcow2`` -> ``disk.released.qcow2`` (``-2``, ``-3``, ... when taken); a disk that
    is itself a released copy (adopted again) gives the next number, not a longer name."""
    stem, suffix = RELEASED.sub("", origin.stem), origin.suffix
    for k in range(1, 1000):
        tag = "released" if k == 1 else f"released-{k}"
        cand = origin.with_name(f"{stem}.{tag}{suffix}")
        if not cand.exists() and not cand.is_symlink():
            return cand
    raise VMError(f"no free name for the released copy of {origin}")


def plan(ctl: DomainController, session: str, domain: str) -> dict[str, dict[str, Any]]:
    """target -> {"how": "commit" | "copy", "dest": file, "fmt": format} for each disk whose
    chain holds a file of the session's directory. Refuses (VMError; BadInput for a domain
    gone) what it cannot hand back, before anything changes."""
    state = ctl.load_state(session)
    if not state.adopted:
        raise VMError(f"domain {domain} was made by ksfs, not adopted: there is no disk of the "
                      f"user's to hand it back on")
    if not ctl.exists(domain):
        raise BadInput(f"domain {domain} is gone (undefined outside ksfs): nothing to hand back; "
                       f"`ksfs restore {session} CHECKPOINT` brings it back first, or `ksfs "
                       f"session rm {session}` forgets the session")
    sdir = ctl.session_dir(session)
    xml = ctl.xml(domain)
    for tag, path in domxml.boot_files(xml).items():
        if inside(path, sdir):
            raise VMError(f"domain {domain} boots from ksfs's copy of its {tag} ({path}); "
                          f"point it at your own {tag} (virsh edit) first")
    kept = {d.source for d in domxml.disks(xml)}
    for f, fmt in domxml.formatted_sources(xml):
        if f not in kept and any(inside(g, sdir) for g in chain_file_set(Path(f), fmt=fmt)):
            raise VMError(f"a read-only disk or cdrom of domain {domain} runs on {f}, a layer "
                          f"an older ksfs made; point it back at its own file (virsh edit, "
                          f"with the domain shut off) first")
    out: dict[str, dict[str, Any]] = {}
    for disk in domxml.disks(xml):
        chain = _chain(disk)
        if not any(inside(f, sdir) for f in chain):
            continue
        ds = state.disks.get(disk.target)
        if ds is None:
            raise VMError(f"disk {disk.target} of {domain} runs on ksfs's files but ksfs has no "
                          f"record of it")
        if not inside(ds.root, sdir):
            out[disk.target] = {"how": "commit", "dest": ds.root, "fmt": ds.root_fmt}
            continue
        origin = state.origins.get(disk.target)
        if origin is None:
            raise VMError(f"disk {disk.target} of {domain} runs on a disk a restore wrote, and "
                          f"this session was adopted by a ksfs that did not record where the "
                          f"domain's own disk was: copy it out with `ksfs cat` first")
        out[disk.target] = {"how": "copy", "dest": str(released_name(Path(origin[0]))),
                            "fmt": origin[1]}
    return out


def release(ctl: DomainController, session: str, domain: str,
            disks: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Carry out ``plan``'s ``disks``; returns target -> the file each disk now runs on. A
    domain that is gone is left gone (nothing to hand back)."""
    from ksfs.vm.checkpoint import settle_commits
    from ksfs.vm.state import load_state

    if not ctl.exists(domain):
        return {}
    sdir = ctl.session_dir(session)
    if load_state(ctl._state_path(session)) is None:
        # The session's files are gone: a release killed after it handed the machine back
        # and removed them. Nothing is left to do but to check it.
        _check_released(ctl, domain, sdir)
        return ctl.disk_files(domain)
    settle_commits(ctl, session, domain)  # a killed save's commit job ends first
    dom = ctl.lookup(domain)
    with step(domain, "reading its state"):
        active = dom.isActive()
    tops = _disks(ctl.xml(domain))
    try:
        for target, how in disks.items():
            if target not in tops:
                raise VMError(f"domain {domain} has no disk {target} any more")
            if active:
                _finish_job(dom, domain, target)  # a killed release's own job
                tops[target] = _disks(ctl.xml(domain))[target]
            if any(inside(f, sdir) for f in _chain(tops[target])):
                if active:
                    _live(dom, domain, target, how, tops[target])
                else:
                    _offline(ctl, domain, target, how, tops[target])
                crash_point("vm.release.disk")
    except BaseException:
        # A disk handed back before the failure (or the Ctrl-C) is the user's already: said
        # so in the state, given the user's mode, defined (QA, eighteenth session: kept as
        # the session's, the next save copied it out again as a detached disk, and its file
        # stayed 0600). The removal stays open for the rest (keeper.remove_session).
        with contextlib.suppress(KsfsError, libvirt.libvirtError, OSError):
            _record_handed_back(ctl, session, domain, sdir, active)
        raise
    done = _record_handed_back(ctl, session, domain, sdir, active)
    _check_released(ctl, domain, sdir)
    return done


def _record_handed_back(ctl: DomainController, session: str, domain: str, sdir: Path,
                        active: bool) -> dict[str, str]:
    """What each disk runs on now (a killed or failed release's job may have ended on its own
    file), every disk's, those an earlier attempt handed back too; the disks that run on no
    file of the session's leave its state and get the user's mode, and a running domain is
    defined on them."""
    disks = _disks(ctl.xml(domain))
    done = {t: d.source for t, d in disks.items()}
    state = ctl.load_state(session)
    like_the_users(state, done)
    for target in [t for t in state.disks if t in done]:
        if not any(inside(f, sdir) for f in _chain(disks[target])):
            # handed back: the user's now, whatever becomes of the rest of the release (QA:
            # after one that failed later, recover took these for detached disks and copied
            # them out again)
            del state.disks[target]
    ctl.save_state(session, state)
    if active:
        _define_released(ctl, domain, done)
    return done


def handed_back(ctl: DomainController, session: str, disks: dict[str, Any]) -> list[str]:
    """The disks of a release plan no longer the session's (handed back), sorted."""
    from ksfs.vm.state import load_state

    state = load_state(ctl._state_path(session))
    return sorted(t for t in disks if state is None or t not in state.disks)


def _live(dom: libvirt.virDomain, domain: str, target: str, how: dict[str, Any],
          top: domxml.DiskInfo) -> None:
    dest = how["dest"]
    if how["how"] == "commit":
        with step(domain, f"committing {target} into {dest}"):
            dom.blockCommit(target, dest, None, 0, libvirt.VIR_DOMAIN_BLOCK_COMMIT_ACTIVE)
    else:
        # not in any chain (the caller saw none of its files there): a killed copy's output
        Path(dest).unlink(missing_ok=True)
        disk = (f"<disk type='file'><source file={quoteattr(dest)}/>"
                f"<driver type={quoteattr(how['fmt'])}/></disk>")
        with step(domain, f"copying {target} to {dest}"):
            # TRANSIENT_JOB: libvirt refuses a copy of a persistent domain's disk without it;
            # the pivot still updates the persistent definition.
            dom.blockCopy(target, disk, None, libvirt.VIR_DOMAIN_BLOCK_COPY_TRANSIENT_JOB)
    try:
        crash_point("vm.release.job")
        _finish_job(dom, domain, target)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) or failed before the pivot: the job is taken back,
        # not left mirroring (it would refuse every later save), and a copy's half-written
        # file goes; the disk stays on the session's chain, which still holds everything.
        with contextlib.suppress(libvirt.libvirtError):
            if dom.blockJobInfo(target, 0):
                dom.blockJobAbort(target, 0)
        if how["how"] == "copy":
            with contextlib.suppress(libvirt.libvirtError, VMError, OSError):
                if str(dest) not in _chain(_top_of(dom, target)):  # not pivoted to
                    Path(dest).unlink(missing_ok=True)
        raise


def like_the_users(state: Any, done: dict[str, str]) -> None:
    """A copy takes the mode and owner of the disk the domain had when adopted (ksfs makes
    its files 0600, root's): it is the user's file from now on."""
    for target, path in done.items():
        origin = state.origins.get(target)
        if origin is None or path == origin[0] or not RELEASED.search(Path(path).stem):
            continue  # the user's own file (or one they chose since): left as it is
        with contextlib.suppress(OSError):
            st = os.stat(origin[0])
            os.chmod(path, stat.S_IMODE(st.st_mode))
            if os.geteuid() == 0:
                os.chown(path, st.st_uid, st.st_gid)


def _top_of(dom: libvirt.virDomain, target: str) -> domxml.DiskInfo:
    return _disks(dom.XMLDesc(0))[target]


def _finish_job(dom: libvirt.virDomain, domain: str, target: str) -> None:
    """Wait until the block job on ``target`` (an active commit or a copy) is ready, pivot to
    its result and wait for it to be gone; nothing when no job runs."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        with step(domain, f"reading the block job on {target}"):
            info = dom.blockJobInfo(target, 0)
        if not info:
            return
        if time.monotonic() > deadline:
            raise VMError(f"the block job on {target} of domain {domain} did not finish in "
                          f"{JOB_TIMEOUT:.0f} s")
        if info.get("end", 0) and info.get("cur") == info.get("end"):
            try:
                dom.blockJobAbort(target, libvirt.VIR_DOMAIN_BLOCK_JOB_ABORT_PIVOT)
            except libvirt.libvirtError as exc:
                if "not ready" not in (exc.get_error_message() or ""):
                    raise VMError(f"switching {target} of domain {domain} to its released "
                                  f"file failed: {exc.get_error_message()}") from exc
        time.sleep(0.05)


def _offline(ctl: DomainController, domain: str, target: str, how: dict[str, Any],
             top: domxml.DiskInfo) -> None:
    dest = how["dest"]
    if how["how"] == "commit":
        # commits every layer between top and dest into dest
        qemu_img("commit", "-q", "-f", top.fmt, "-b", dest, top.source,
                 what=f"committing {target} into {dest}", timeout=CONVERT_TIMEOUT)
    else:
        Path(dest).unlink(missing_ok=True)  # a killed copy's output (no chain holds it)
        qemu_img("convert", "-q", "-f", top.fmt, "-O", how["fmt"], top.source, dest,
                 what=f"copying {target} to {dest}", timeout=CONVERT_TIMEOUT)
    xml = domxml.set_disk_sources(ctl.xml(domain, inactive=True), {target: (dest, how["fmt"])})
    with step(domain, f"defining it on {dest}"):
        ctl.conn.defineXML(xml)


def _define_released(ctl: DomainController, domain: str, done: dict[str, str]) -> None:
    """A pivot updates the persistent definition too (libvirt 9); where it did not, define
    the files the disks run on, so that the next start does not look for the session's."""
    inactive = ctl.xml(domain, inactive=True)
    defined = {d.target: d.source for d in domxml.disks(inactive)}
    fmts = {d.target: d.fmt for d in domxml.disks(ctl.xml(domain))}
    stale = {t: (f, fmts[t]) for t, f in done.items() if defined.get(t) != f}
    if stale:
        with step(domain, "defining it on its released disks"):
            ctl.conn.defineXML(domxml.set_disk_sources(inactive, stale))


def _check_released(ctl: DomainController, domain: str, sdir: Path) -> None:
    """Neither the running machine nor its definition may name a file of the session's
    directory any more: the caller deletes that directory next."""
    for xml in {ctl.xml(domain), ctl.xml(domain, inactive=True)}:
        for f in domxml.file_sources(xml):  # cdroms and read-only disks too
            if inside(f, sdir):
                raise VMError(f"domain {domain} still names {f} after its release")
        for disk in domxml.disks(xml):
            if not Path(disk.source).exists():
                raise VMError(f"disk {disk.target} of domain {domain} names {disk.source}, "
                              "which does not exist, after its release")
            # (unreadable: the top alone)
            for f in chain_file_set(Path(disk.source), fmt=disk.fmt):
                if inside(f, sdir):
                    raise VMError(f"disk {disk.target} of domain {domain} still uses {f} after "
                                  f"its release")
