"""The files a session's domain is made of: its disk and its kernel and initrd, in its directory.

``session new`` takes a disk the user keeps; the session runs on its own copy. A raw disk or a
plain qcow2 is copied sparsely; a qcow2 that cannot be read in place or depends on other files
(compressed clusters, an external data file, a backing file) is converted into one
self-contained qcow2 instead, so the chain ksfs snapshots never leaves the session's directory.
Encrypted disks are refused. The direct-boot kernel and initrd are copied in too, and restores
and forks point the domain at the session's own copies (docs/vm.md). No libvirt here.
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import logging
import os
import shutil
import stat
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ksfs.errors import BadInput, Busy, NotFound, VMError
from ksfs.vm import domxml
from ksfs.vm.chain import (
    GUEST_DATA_UMASK,
    backing_chain,
    compressed_files,
    data_file_of,
    image_info,
    qemu_img,
)

log = logging.getLogger("ksfs.vm")

# os/<tag> of the domain XML -> the session directory's own copy
BOOT_NAMES = {"kernel": "kernel", "initrd": "initrd"}
CONVERT_TIMEOUT = 3600.0  # a cloud image expands its compressed clusters: a few GiB to write
# QEMU's image locking (block/file-posix.c): a process that holds permission bit N of a file
# has a shared OFD lock on byte 100 + N; WRITE is bit 1. Any QEMU that may write the file holds
# byte 101, whoever started it; a reader (qemu-img, a read-only disk) does not.
QEMU_WRITE_LOCK_BYTE = 101


@dataclass(frozen=True)
class DiskPlan:
    """How a session's disk is made from the user's file."""

    source: Path
    fmt: str  # the format of the session's copy: raw or qcow2
    convert: str | None  # why it is converted instead of copied (None: copied)


QCOW2_MAGIC = b"QFI\xfb"
FORMATS = ("raw", "qcow2")


def begins_like_qcow2(path: Path | str) -> bool:
    """Whether the file's first bytes are a qcow2 header's magic (False when unreadable)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(QCOW2_MAGIC)) == QCOW2_MAGIC
    except OSError:
        return False


def inspect_disk(path: Path | str, fmt: str | None = None) -> DiskPlan:
    """Check a disk given to ``session new``; BadInput for one ksfs cannot take.

    ``fmt``: its format when something states it (guest.json's ``disk_format``): then it is
    taken so, never probed, as qemu takes a disk whose format is given (a raw disk holds
    whatever its guest wrote, a qcow2 header naming a host file as backing file too). Only a
    disk nothing states the format of is probed. qcow2 images with compressed clusters, an
    external data file or a backing file are converted (``qemu-img convert -O qcow2``, which
    flattens the chain and expands the clusters); encrypted ones are refused.
    """
    path = Path(path)
    what = f"inspecting the disk {path}"
    if fmt is not None:
        if fmt not in FORMATS:
            raise BadInput(f"the disk format {fmt!r} is not one ksfs takes: raw or qcow2")
        if fmt == "qcow2" and not begins_like_qcow2(path):
            raise BadInput(f"the disk {path} is not a qcow2 image (its format is given as "
                           f"qcow2)")
    info = image_info(path, what, fmt)
    fmt = info["format"]
    data = data_file_of(info)
    for used in (path, data and path.parent / data):  # a relative data file: beside its image
        if used and written_by_another(used):
            raise Busy(f"the disk {path} is in use: a running QEMU may write {used} (it holds "
                       f"its write lock), so a copy would be torn; shut that machine down "
                       f"first, or take it under ksfs as it runs with `ksfs session adopt`")
    if fmt not in FORMATS:
        raise BadInput(f"the disk {path} is {fmt}; ksfs takes raw or qcow2 disks")
    if fmt == "raw":
        return DiskPlan(path, "raw", None)
    # fails clearly on a backing file that cannot be opened
    chain = backing_chain(path, what, "qcow2")
    for info in chain:
        if info.get("encrypted"):
            raise BadInput(f"the disk {path} is encrypted ({info['filename']}); ksfs cannot "
                           f"keep encrypted disks: decrypt it first (qemu-img convert)")
    if len(chain) > 1:
        return DiskPlan(path, "qcow2", f"it has a backing file ({chain[1]['filename']})")
    if data_file_of(chain[0]):
        return DiskPlan(path, "qcow2", f"it has an external data file "
                                       f"({data_file_of(chain[0])})")
    if compressed_files(path, what, chain, "qcow2"):
        return DiskPlan(path, "qcow2", "it has compressed clusters")
    return DiskPlan(path, "qcow2", None)


def written_by_another(path: Path) -> bool:
    """Whether a process holds QEMU's write lock on ``path`` (False when it cannot be told)."""
    return qemu_lock_held(path, QEMU_WRITE_LOCK_BYTE)


def qemu_lock_held(path: Path | str, byte: int) -> bool:
    """Whether a process holds a lock on ``byte`` of ``path`` (an OFD lock as QEMU takes
    them), False when it cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # qemu-img already named a missing file; an unreadable one fails later
    try:
        probe = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
        kind = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0]
        return kind != fcntl.F_UNLCK
    except OSError:
        return False  # a filesystem without OFD locks (some network ones): nothing to tell
    finally:
        os.close(fd)


def make_disk(plan: DiskPlan, dest: Path, what: str) -> None:
    """The session's own disk at ``dest``: a sparse copy, or a self-contained conversion."""
    if os.path.lexists(dest):
        raise VMError(f"{what}: {dest} already exists; refusing to overwrite it")
    if plan.convert is None:
        try:
            subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(plan.source),
                            str(dest)], check=True, capture_output=True, text=True,
                           umask=GUEST_DATA_UMASK)
        except subprocess.CalledProcessError as exc:
            raise VMError(f"{what}: copying {plan.source} failed: "
                          f"{exc.stderr.strip()[-500:]}") from exc
        return
    # No -c: the copy must be readable in place. No -o data_file, no -B: self-contained.
    # Run from the image's directory: QEMU 7.2 opens a relative data file from the current
    # directory (a relative backing file from the image's; newer QEMU does both that way).
    src = plan.source.resolve()
    qemu_img("convert", "-q", "-f", "qcow2", "-O", "qcow2", str(src), str(dest.resolve()),
             what=f"{what} (converting it: {plan.convert})", timeout=CONVERT_TIMEOUT,
             cwd=src.parent)
    info = image_info(dest, what, "qcow2")
    if info.get("backing-filename") or data_file_of(info):
        raise VMError(f"{what}: the converted copy {dest} still depends on another file")


def clear_planted(path: Path | str, session_dir: Path) -> None:
    """Remove what stands at ``path`` in the session's directory when it is no regular file
    (a symbolic link, a FIFO): libvirt, as root, appends the guest's console output to the
    file a console.log link names (security QA). Paths outside the directory are left."""
    path = Path(os.path.abspath(path))
    if not path.is_relative_to(Path(os.path.abspath(session_dir))):
        return
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            log.warning("removing %s: not a regular file of its own", path)
            os.unlink(path)


def copy_boot_file(src: Path, dest: Path, workdir: Path) -> None:
    """Put a kernel or initrd at ``dest`` (atomically): a hard link when ``src`` is another
    session's copy in the same store (those are never written in place), else a copy. A
    copy in the store is always a regular file: one that is a link (planted, naming a file
    root may read and the store's owner may not) is refused (security QA)."""
    tmp = dest.with_name(dest.name + ".part")
    tmp.unlink(missing_ok=True)
    in_store = Path(os.path.abspath(src)).is_relative_to(Path(os.path.abspath(workdir)))
    if in_store and not os.path.isfile(src) or in_store and os.path.islink(src):
        raise VMError(f"the copy {src} in the store is not a regular file (a link?): ksfs "
                      f"copies no file it names")
    try:
        linked = False
        if in_store and src.resolve().is_relative_to(workdir.resolve()):
            try:
                os.link(src, tmp)
                linked = True
            except OSError:
                pass
        if not linked:
            shutil.copyfile(src, tmp)
            tmp.chmod(0o644)  # QEMU (libvirt-qemu) reads it
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise VMError(f"copying {src} to {dest} failed: {exc.strerror or exc}") from exc


def own_boot_files(xml: str, session_dir: Path, workdir: Path, domain: str,
                   keep_outside: bool = False) -> str:
    """``xml`` with its kernel and initrd pointed at the session directory's own copies.

    A file the XML names that exists is copied (or linked) in when the session's copy is not
    already the same; one that is gone is replaced by the session's copy when there is one.
    ``keep_outside`` (an adopted domain): files that exist stay where the user keeps them.
    Raises VMError, before anything is stopped, when a named file is gone and the session has
    no copy of it.
    """
    paths = domxml.boot_files(xml)
    new: dict[str, str] = {}
    for tag, name in BOOT_NAMES.items():
        if tag not in paths:
            continue
        src, own = Path(paths[tag]), session_dir / name
        if src.is_file():
            if keep_outside or src == own:
                continue
            if not (own.is_file() and (os.path.samefile(src, own)
                                       or filecmp.cmp(src, own, shallow=False))):
                copy_boot_file(src, own, workdir)
        elif not own.is_file():
            raise VMError(f"the {tag} {src} of domain {domain} does not exist and the session "
                          f"has no copy of it; nothing was changed")
        new[tag] = str(own)
    return domxml.set_boot_files(xml, new) if new else xml


def gone_boot_file(xml: str, session_dir: Path) -> tuple[str, str] | None:
    """(tag, path) of a kernel or initrd ``xml`` names that is gone, with no copy of the
    session's to stand in for it (which ``own_boot_files`` would take), else None."""
    for tag, path in domxml.boot_files(xml).items():
        if not Path(path).is_file() and not (session_dir / BOOT_NAMES[tag]).is_file():
            return tag, path
    return None


def own_nvram(xml: str, session_dir: Path, domain: str) -> str:
    """``xml`` with a UEFI variable store of the session's own (``nvram.fd`` in its directory),
    a copy of the one ``xml`` names. A fork runs beside its parent: on one file both QEMUs
    would write the same EFI variables (QEMU's image locks share it), and `virsh undefine
    --nvram` of either would delete the other's. The running fork takes its variables from the
    memory image (QEMU migrates the flash's contents), so the copy matters for its cold boots.
    One the parent's file is gone: made from the definition's template by libvirt, as at a
    first boot."""
    path, template = domxml.nvram(xml)
    if path is None and template is None:
        return xml
    own = session_dir / "nvram.fd"
    if path is not None and Path(path).is_file():
        try:
            with open(path, "rb") as src, open(own, "xb") as dst:
                os.fchmod(dst.fileno(), 0o600)  # as libvirt makes it: the guest's own data
                shutil.copyfileobj(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
        except OSError as exc:
            raise VMError(f"copying the UEFI variables {path} of {domain} failed: "
                          f"{exc.strerror}") from exc
    elif template is None:
        raise VMError(f"the UEFI variable store {path} of {domain} does not exist and its "
                      f"definition names no template to make one from; nothing was changed")
    return domxml.set_nvram(xml, own)


def check_adoptable(target: str, source: str, domain: str, fmt: str) -> None:
    """Refuse, before anything is written, an adopted disk whose chain ksfs could not snapshot
    and read in place: encrypted, compressed clusters, or an external data file. (A backing
    chain is fine: an adopted disk stays where the user keeps it.) ``fmt``: its format as the
    domain's definition gives it, never probed."""
    # The domain as the user gives it: what ksfs cannot take is bad input (exit 2) and a disk
    # file that is not there is not found (3), as for `session new --disk` (QA, eighteenth
    # session: both were "VM errors", exit 10, the second as qemu-img's own failure).
    what = f"inspecting disk {target} of {domain}"
    how = ("; convert it first (qemu-img convert -O qcow2), or make a session from a copy of "
           "it with `ksfs session new --disk`")
    if not os.path.exists(source):
        raise NotFound(f"disk {target} of domain {domain} is {source}, which does not exist")
    chain = backing_chain(source, what, fmt)
    for info in chain:
        if info.get("encrypted"):
            raise BadInput(f"disk {target} of {domain} ({info['filename']}) is encrypted; ksfs "
                           f"cannot keep encrypted disks")
        if data_file_of(info):
            raise BadInput(f"disk {target} of {domain} ({info['filename']}) keeps its data in "
                           f"an external file ({data_file_of(info)}), which ksfs cannot read in "
                           f"place{how}")
    bad = compressed_files(source, what, chain, fmt)
    if bad:
        raise BadInput(f"disk {target} of {domain} ({bad[0]}) has compressed clusters, which "
                       f"ksfs cannot read in place{how}")


def check_start_files(xml: str, kept: set[str], from_memory: bool, label: str,
                      unchanged: str = "nothing was changed") -> None:
    """Refuse (NotFound), before a restore or fork stops or makes anything, a checkpoint whose
    definition names a host file that is gone: a cdrom or read-only image, the firmware. libvirt
    would fail only after the running machine was stopped (QA: a deleted ISO left it shut
    off). ``kept``: the disks the caller writes itself; ``label`` names the checkpoint."""
    for what, path in domxml.files_to_start(xml, kept, from_memory):
        if not os.path.exists(path):
            raise NotFound(f"{label} needs its {what} {path}, which does not exist; put it "
                           f"back there and try again ({unchanged})")
        if os.path.isdir(path):  # (QA, nineteenth session: found after the machine stopped)
            raise NotFound(f"{label} needs its {what} {path}, which is a directory now; put "
                           f"the file back there and try again ({unchanged})")
