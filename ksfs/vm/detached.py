"""Disks detached from an adopted domain while ksfs's layers were on them.

A save leaves each disk running on an overlay in the session's directory, so the guest's writes
since go there. A disk the user detaches (``virsh detach-disk``, or another disk attached on its
target) takes that overlay out of every chain the domain names: left as it is, the next restore,
``recover`` or ``session rm`` deletes it with the session's other files, and the writes with it
(QA, thirteenth session). ``hand_back`` gives each such disk back to the user before any of
those: its layers are committed into the user's file (``qemu-img commit``, as every save's
finish does live), or, when the disk runs on a base a restore wrote, copied out beside the
file the domain had when adopted (``disk.released.qcow2``, as ``session rm --release`` does).
Sessions ksfs made are left as they are: their disks are ksfs's own. No libvirt here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ksfs.errors import VMError
from ksfs.vm.chain import chain_files, qemu_img
from ksfs.vm.release import _like_the_users, _released_name
from ksfs.vm.restore import _file_id, files_in_use

if TYPE_CHECKING:
    from ksfs.vm.controller import DomainController

log = logging.getLogger(__name__)

CONVERT_TIMEOUT = 3600.0


def _ids(paths: set[Path]) -> set[tuple[int, int]]:
    out = set()
    for p in paths:
        try:
            out.add(_file_id(p))
        except OSError:
            pass  # not there: in no chain
    return out


def hand_back(ctl: DomainController, session: str, domain: str) -> dict[str, dict[str, str]]:
    """Give back every disk the session tracks that the domain (live or defined) no longer
    runs on; returns target -> {"how": "commit" | "copy", "file": where its bytes are now}.
    Raises VMError, removing nothing, when a disk cannot be handed back. Call it under the
    session's lock with no block job of ksfs's running (after ``settle_commits``)."""
    state = ctl.load_state(session)
    if not state.adopted or not state.disks or state.pending or not ctl.exists(domain):
        return {}  # (a killed restore's machine runs on files its state does not name yet)
    if _all_attached(ctl, domain, state.disks):
        return {}  # (the common case, without a qemu-img run per disk)
    in_use, _ = files_in_use(ctl, domain, strict=True)
    used = _ids(in_use)
    sdir = ctl.session_dir(session)
    detached = {t: ds for t, ds in state.disks.items() if not _ids({Path(ds.root)}) & used}
    if not detached:
        return {}
    ours = [p for p in sdir.glob("*.qcow2") if not _ids({p}) & used]
    done: dict[str, dict[str, str]] = {}
    for target, ds in detached.items():
        root = Path(ds.root)
        chains = {}
        for p in ours:
            try:
                files = chain_files(p, f"reading the chain of {p.name}")
            except VMError:
                continue
            if any(_same(f, root) for f in files[1:]):
                chains[p] = files
        inside = root.resolve().is_relative_to(sdir.resolve())
        if not chains and (not inside or not root.exists()):
            del state.disks[target]  # nothing of it in our directory: the user's file is whole
            ctl.save_state(session, state)
            continue
        top = max(chains, key=lambda p: len(chains[p])) if chains else root
        what = f"handing back disk {target}, detached from {domain}"
        if not inside:
            qemu_img("commit", "-q", "-b", str(root), str(top), what=what,
                     timeout=CONVERT_TIMEOUT)
            done[target] = {"how": "commit", "file": str(root)}
        else:
            origin = state.origins.get(target)
            if origin is None:
                raise VMError(f"disk {target} was detached from {domain} while it ran on a "
                              f"disk a restore wrote, and ksfs has no record of the domain's "
                              f"own file for it: copy it out first (qemu-img convert {top} "
                              f"...), then try again")
            dest = _released_name(Path(origin[0]))
            try:
                qemu_img("convert", "-q", "-O", origin[1], str(top), str(dest), what=what,
                         timeout=CONVERT_TIMEOUT)
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
            _like_the_users(state, {target: str(dest)})
            done[target] = {"how": "copy", "file": str(dest)}
        log.warning("disk %s of %s was detached with writes in ksfs's layers: %s into %s",
                    target, domain, done[target]["how"], done[target]["file"])
        del state.disks[target]
        ctl.save_state(session, state)
        # Only now: its bytes are in the user's file. Only files of the session's directory
        # that no chain of the domain uses (the base a restore wrote included: copied out).
        for f in dict.fromkeys([str(top), *chains.get(top, [])]):
            if Path(f).resolve().is_relative_to(sdir.resolve()) and not _ids({Path(f)}) & used:
                Path(f).unlink(missing_ok=True)
    return done


def _all_attached(ctl: DomainController, domain: str, tracked: dict) -> bool:
    """Every tracked disk's root is in the chain the running machine's XML records for its
    target (libvirt lists a running disk's backing chain)."""
    from ksfs.vm import domxml

    if ctl.state(domain) not in ("running", "paused"):
        return False
    chains = {d.target: (d.source, *d.backing) for d in domxml.disks(ctl.xml(domain))}
    return all(ds.root in chains.get(t, ()) for t, ds in tracked.items())


def _same(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
