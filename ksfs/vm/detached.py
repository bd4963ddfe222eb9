"""Disks detached from an adopted domain while ksfs's layers were on them.

A save leaves each disk running on an overlay in the session's directory (``DiskState.top``), so
the guest's writes since go there. A disk the user detaches (``virsh detach-disk``, live only
or not, or another file attached on its target, or the same file attached again) takes that
overlay out of the machine: left as it is, the next restore, ``recover`` or ``session rm``
deletes it with the session's other files, and the writes with it (QA, thirteenth session).
``hand_back`` gives each such layer back to the user before any of those:

- ``commit``: the user's file is as the last save left it (same inode, size and mtime) and no
  machine has it open: the layer is committed into it (``qemu-img commit``, which takes the
  image's write lock), as every save's finish does live.
- ``copy``: the disk ran on a base a restore wrote: base and layer are copied out beside the
  file the domain had when adopted (``disk.released.qcow2``, as ``session rm --release`` does).
- ``layer``: the user's file changed since (another machine wrote it, or it is attached again):
  committing would put old writes over newer ones, so the layer itself is moved out beside it
  (``disk.ksfs-layer.qcow2``, a qcow2 whose backing file is the user's) for the user to judge.

When the user's directory is gone (maybe a file system not mounted just now) the verb is
refused and nothing removed; ``session rm`` without ``--release`` drops the writes.

A definition that still names the layer (a detach of the running machine only) is pointed at
where its bytes went. Files are written under a temporary name and renamed when whole. Sessions
ksfs made are left as they are: their disks are ksfs's own. A layer is always one of ksfs's
qcow2 overlays, and qemu-img is told so (``-f qcow2``), never left to guess. No libvirt here.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ksfs.crashpoints import crash_point
from ksfs.errors import KsfsError, VMError
from ksfs.vm import domxml
from ksfs.vm.chain import chain_files, qemu_img
from ksfs.vm.release import inside, like_the_users, released_name
from ksfs.vm.restore import chain_file_set, file_id, same_file
from ksfs.vm.state import DiskState, file_stat
from ksfs.vm.steps import step

if TYPE_CHECKING:
    from ksfs.vm.controller import DomainController

log = logging.getLogger(__name__)

CONVERT_TIMEOUT = 3600.0


def _ids(paths: set[Path] | list[Path]) -> set[tuple[int, int]]:
    out = set()
    for p in paths:
        try:
            out.add(file_id(Path(p)))
        except OSError:
            pass  # not there: in no chain
    return out


def _chains(xml: str) -> set[Path]:
    """Every file of every disk chain ``xml`` names (unreadable: the top alone)."""
    out: set[Path] = set()
    for f, fmt in domxml.formatted_sources(xml):
        out |= chain_file_set(Path(f), fmt=fmt)
    return out


def hand_back(ctl: DomainController, session: str, domain: str,
              on_done: Callable[[str, dict[str, str]], None] | None = None
              ) -> dict[str, dict[str, str]]:
    """Give back the layer of every disk the session tracks that the machine no longer runs on
    (the definition, when it is not running); returns target -> {"how", "file"} (see the
    module), each also told to ``on_done`` as soon as it is done (a later disk may fail).
    Raises VMError, removing nothing of that disk, when one cannot be given back. Call it under
    the session's lock with no block job of ksfs's running (``settle_commits``)."""
    state = ctl.load_state(session)
    if not state.adopted or not state.disks or state.pending or not ctl.exists(domain):
        return {}  # (a killed restore's machine runs on files its state does not name yet)
    with step(domain, "reading its state"):
        running = ctl.lookup(domain).isActive()  # (shutting down or suspended: QEMU writes)
    live_xml = ctl.xml(domain) if running else ""
    if running and _all_attached(live_xml, state.disks):
        return {}  # the common case, without a qemu-img run per disk
    inactive_xml = ctl.xml(domain, inactive=True)
    used = _ids(_chains(live_xml if running else inactive_xml))
    sdir = ctl.session_dir(session)
    done: dict[str, dict[str, str]] = {}
    for target, ds in list(state.disks.items()):
        top = _top(ds, sdir, used)
        if top is not None and _ids([top]) & used:
            continue  # it runs on its layer (or the user attached ksfs's layer again)
        if top is None:
            if not _ids([Path(ds.root)]) & used and not inside(ds.root, sdir):
                del state.disks[target]  # the user's file, detached; nothing of ours on it
                ctl.save_state(session, state)
            continue
        where = _give_back(ctl, session, state, target, ds, top, sdir, domain, used)
        done[target] = where
        log.warning("disk %s of %s was detached with writes in ksfs's layer %s: %s (%s)",
                    target, domain, top, where["how"], where["file"])
        named = [d.target for d in domxml.disks(inactive_xml) if same_file(d.source, top)]
        if named:
            # A detach of the running machine only: the next boot must find the bytes (on
            # whichever target the definition has the layer).
            fmt = "qcow2" if where["how"] == "layer" else _fmt(state, target, ds, where)
            inactive_xml = domxml.set_disk_sources(
                inactive_xml, {t: (where["file"], fmt) for t in named})
            with step(domain, f"pointing the definition's disk at {where['file']}"):
                ctl.conn.defineXML(inactive_xml)
        if on_done is not None:
            on_done(target, where)
        del state.disks[target]
        ctl.save_state(session, state)
        # Only now, the bytes being where the event says: the session's files of it that no
        # chain of the machine uses.
        users = _ids([Path(f) for f, _fmt in state.origins.values()])  # never theirs
        for f in dict.fromkeys([str(top), *chain_file_set(top, fmt="qcow2")]):
            if inside(f, sdir) and not _ids([Path(f)]) & (used | users):
                Path(f).unlink(missing_ok=True)
    return done


def _all_attached(live_xml: str, tracked: dict[str, DiskState]) -> bool:
    """Every tracked disk's recorded top is what the running machine's XML says its target
    runs on (a state without tops, from before them, takes the long way)."""
    tops = {d.target: d.source for d in domxml.disks(live_xml)}
    return all(ds.top and tops.get(t) == ds.top for t, ds in tracked.items())


def _top(ds: DiskState, sdir: Path, used: set) -> Path | None:
    """The layer of ours the disk's writes since the last save are in: the top of the longest
    unused chain of the session's files on the recorded top (a save killed after its snapshot
    left a newer one above it), or on the root for a state from before tops were recorded. A
    chain through a file the machine uses is not one (a killed snapshot's leftover overlay on
    a disk still attached). None when there is none."""
    root = Path(ds.root)
    base = Path(ds.top) if ds.top else root
    if ds.top and not base.exists():
        base = root  # (committed and deleted by a finish killed before it recorded so)
    best: tuple[int, Path] | None = None
    for p in sdir.glob("*.qcow2"):
        if _ids([p]) & used:
            continue
        try:
            files = chain_files(p, f"reading the chain of {p.name}", "qcow2")  # ksfs's own
        except VMError:
            continue
        at = next((k for k, f in enumerate(files) if same_file(f, base)), None)
        if at is None or (base == root and at == 0) or _ids([Path(f) for f in files[:at]]) & used:
            continue
        if best is None or len(files) > best[0]:
            best = (len(files), p)
    if best is not None:
        return best[1]
    return base if ds.top and base != root and not same_file(base, root) else None


def _give_back(ctl: DomainController, session: str, state: Any, target: str, ds: DiskState,
               top: Path, sdir: Path, domain: str, used: set) -> dict[str, str]:
    root = Path(ds.root)
    what = f"handing back disk {target}, detached from {domain}"

    def intend(how: str, dest: Path | None = None) -> None:
        """Said before the work: a kill part way is then finished or cleaned up, not guessed."""
        ds.handing_back = {"how": how, "top": str(top)}
        if dest is not None:
            ds.handing_back.update(dest=str(dest), tmp=str(tmp_for(dest)))
        ctl.save_state(session, state)

    before = ds.handing_back or {}
    if before.get("top") == str(top) and before.get("dest") and Path(before["dest"]).exists():
        # killed after its copy was renamed into place: that copy is whole
        return {"how": before["how"], "file": before["dest"]}

    if inside(root, sdir):
        origin = state.origins.get(target)
        if origin is None:
            raise VMError(f"disk {target} was detached from {domain} while it ran on a disk a "
                          f"restore wrote, and ksfs has no record of the domain's own file for "
                          f"it: copy it out first (qemu-img convert {top} ...), then try again")
        dest = released_name(Path(origin[0]))
        _check_dir(dest, target, domain, top)
        intend("copy", dest)
        _write_whole(dest, lambda tmp: qemu_img(
            "convert", "-q", "-f", "qcow2", "-O", origin[1], str(top), str(tmp), what=what,
            timeout=CONVERT_TIMEOUT))
        like_the_users(state, {target: str(dest)})
        return {"how": "copy", "file": str(dest)}
    if not root.parent.is_dir():
        # (maybe a file system not mounted just now: its writes are not deleted for that)
        raise VMError(f"disk {target} was detached from {domain} with writes in ksfs's layer "
                      f"{top}, to be given back to {root}, but {root.parent} is gone: make it "
                      f"available again and try again (`ksfs session rm` drops them instead)")
    # A commit of this layer killed part way changed the file itself: it is done again (the
    # layer is whole), not taken for a change of the user's.
    again = (ds.handing_back or {}).get("how") == "commit" and \
        ds.handing_back.get("top") == str(top)  # type: ignore[union-attr]
    if (again or (ds.root_stat and file_stat(root) == ds.root_stat)) \
            and not _ids([root]) & used:
        intend("commit")
        try:
            qemu_img("commit", "-q", "-f", "qcow2", "-b", str(root), str(top), what=what,
                     timeout=CONVERT_TIMEOUT)
        # Another machine holds it (its write lock): not ours to write. Or no room (NoSpace):
        # what the commit wrote into it is in the layer too, which goes on top of it.
        except KsfsError as exc:
            log.warning("%s: committing into %s failed, moving the layer out: %s", what, root,
                        exc)
            ds.handing_back = None  # nothing written: no later run may take it for its own
            ctl.save_state(session, state)
        else:
            crash_point("vm.detached.commit")  # the file written, nothing recorded yet
            return {"how": "commit", "file": str(root)}
    # Changed since (or in use, or unknown): the layer itself, squashed into one file on root.
    try:
        order = chain_files(top, f"reading the chain of {top.name}", "qcow2")  # top first
    except VMError:
        order = [str(top)]  # (its backing file gone: the layer alone)
    ours = [Path(f) for f in order if inside(f, sdir) and not same_file(f, root)]
    if len(ours) > 1:
        qemu_img("commit", "-q", "-f", "qcow2", "-b", str(ours[-1]), str(top), what=what,
                 timeout=CONVERT_TIMEOUT)
    dest = _free_name(root, "ksfs-layer", ".qcow2")
    intend("layer", dest)
    _write_whole(dest, lambda tmp: shutil.copyfile(ours[-1] if ours else top, tmp))
    _mode_of(root, dest)
    return {"how": "layer", "file": str(dest)}


def _mode_of(origin: Path, path: Path) -> None:
    """A file handed back takes the mode and owner of the user's disk (ksfs's are 0600)."""
    try:
        st = origin.stat()
        os.chmod(path, st.st_mode & 0o777)
        if os.geteuid() == 0:
            os.chown(path, st.st_uid, st.st_gid)
    except OSError:
        pass  # the user's file is gone: ksfs's own mode stays


def _fmt(state: Any, target: str, ds: DiskState, where: dict[str, str]) -> str:
    if where["how"] == "copy":
        return state.origins[target][1]
    return ds.root_fmt


def _check_dir(dest: Path, target: str, domain: str, top: Path) -> None:
    if not dest.parent.is_dir():
        raise VMError(f"disk {target} was detached from {domain} with writes in ksfs's layer "
                      f"{top}, to be copied out to {dest}, but {dest.parent} is gone: make it "
                      f"again and try again (`ksfs session rm` drops them instead)")


def tmp_for(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.ksfs-part")


def _write_whole(dest: Path, write: Callable[[Path], object]) -> None:
    """Write ``dest`` through a temporary name beside it, so a kill leaves no partial file
    under a name the user would take for the whole (a leftover of a killed one goes first)."""
    tmp = tmp_for(dest)
    tmp.unlink(missing_ok=True)
    try:
        write(tmp)
        crash_point("vm.detached.copy")  # written under its temporary name
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _free_name(origin: Path, tag: str, suffix: str) -> Path:
    for k in range(1, 1000):
        cand = origin.with_name(f"{origin.stem}.{tag}{'' if k == 1 else f'-{k}'}{suffix}")
        if not os.path.lexists(cand):
            return cand
    raise VMError(f"no free name beside {origin}")
