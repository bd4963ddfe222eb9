"""Disk image chains on the host: qemu-img maps, random-access reads of a frozen chain, overlays.

A frozen layer is read through its whole backing chain with ``qemu-img map`` of the chain (which
file, at which host offset, holds each guest range) and plain ``pread`` on those files, so an
incremental checkpoint reads only the clusters it needs and never converts a whole image.
Must never write to a layer it reads, and never import libvirt (that is controller.py's job).

Must never let qemu-img guess the format of an image whose format is known (``fmt``: the
domain XML's driver type, the format ksfs recorded for a file it made, guest.json's
``disk_format``): a raw disk holds whatever its guest writes, and a guest that writes a qcow2
header naming a host file as its backing file into its raw disk would have that host file read
as its disk (QA: a checkpoint stored it, and a restore gave it to the guest). ``fmt=None``
probes, for a file nothing states the format of. Overlays ksfs makes record their backing
file's format (``-F``), so nothing below them is probed either.
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import stat
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ksfs import progress
from ksfs.errors import NoSpace, VMError

ZERO_BLOCK = 1 << 20
# Files ksfs makes that hold a guest's bytes (disks, overlays, memory images) are its owner's
# alone: libvirt's dynamic ownership hands each to QEMU's user while QEMU runs, so QEMU needs
# no group or other bits, and other local users must not read a machine's disk or memory.
GUEST_DATA_UMASK = 0o077


def qemu_img(*args: str, what: str, timeout: float = 120, cwd: Path | None = None) -> str:
    """Run qemu-img; a failure is a VMError naming ``what``."""
    try:
        res = subprocess.run(["qemu-img", *args], capture_output=True, text=True,
                             timeout=timeout, cwd=cwd, umask=GUEST_DATA_UMASK)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VMError(f"{what}: qemu-img could not run ({exc})") from exc
    if res.returncode != 0:
        err = "; ".join(line.strip() for line in res.stderr.splitlines() if line.strip())
        if "No space left on device" in err or "Disk quota exceeded" in err:
            raise NoSpace(path=cwd or args[-1], why=f"{what}: qemu-img {args[0]}: {err[-300:]}")
        raise VMError(f"{what}: qemu-img {args[0]} failed: {err[-500:]}")  # one line
    return res.stdout


def format_args(fmt: str | None) -> list[str]:
    """``-f FMT`` for a qemu-img command on an image whose format is known; nothing (a probe)
    only when nothing states it."""
    return [] if fmt is None else ["-f", fmt]


def image_info(path: Path | str, what: str = "reading image info",
               fmt: str | None = None) -> dict:
    """qemu-img info of a file alone (force-shared: the running QEMU may hold it open)."""
    return json.loads(qemu_img("info", "-U", *format_args(fmt), "--output=json", str(path),
                               what=what))


def backing_chain(path: Path | str, what: str = "reading backing chain",
                  fmt: str | None = None) -> list[dict]:
    """[top, its backing, ...] as qemu-img info --backing-chain reports them; ``fmt``: the
    top's format (see the module)."""
    out = qemu_img("info", "-U", *format_args(fmt), "--backing-chain", "--output=json",
                   str(path), what=what)
    return json.loads(out)


def chain_files(path: Path | str, what: str = "reading backing chain",
                fmt: str | None = None) -> list[str]:
    """The files of ``path``'s chain, top first, as their headers name them."""
    return [c["filename"] for c in backing_chain(path, what, fmt)]


def data_file_of(info: dict) -> str | None:
    """The external data file of a qcow2 (``-o data_file=``) from its qemu-img info, if any."""
    return ((info.get("format-specific") or {}).get("data") or {}).get("data-file")


def compressed_files(path: Path | str, what: str, chain: list | None = None,
                     fmt: str | None = None) -> list[str]:
    """The files of ``path``'s chain holding compressed (or encrypted) clusters: data that
    ``qemu-img map`` gives no host offset for, so it cannot be read in place. ``chain``: its
    ``backing_chain``, when the caller has it already; ``fmt``: the top's format."""
    chain = backing_chain(path, what, fmt) if chain is None else chain
    raw = json.loads(qemu_img("map", "-U", *format_args(fmt), "--output=json", str(path),
                              what=what, timeout=600))
    depths = sorted({e.get("depth", 0) for e in raw
                     if e.get("data") and not e.get("zero", False) and e.get("offset") is None})
    return [chain[min(d, len(chain) - 1)]["filename"] for d in depths]


def create_overlay(path: Path, backing: Path | str, backing_fmt: str, what: str,
                   cluster_size: int = 65536) -> None:
    """A new qcow2 overlay; refuses a path that exists (qemu-img would overwrite it, and a
    file in the way may be a layer some machine still runs on)."""
    if os.path.lexists(path):
        raise VMError(f"{what}: {path} already exists; refusing to overwrite it")
    qemu_img("create", "-q", "-f", "qcow2", "-o", f"cluster_size={cluster_size}",
             "-F", backing_fmt, "-b", str(backing), str(path), what=what)


@dataclass(frozen=True)
class Extent:
    start: int
    length: int
    depth: int
    data: bool
    offset: int | None  # host offset in the file at ``depth``; None for zeros


class ChainSource:
    """The guest-visible bytes of a frozen image: ``.size`` and ``.pread(offset, n)``.

    Built from one ``qemu-img map`` of the full chain at ``top``; the chain must not change while
    this is read (the controller guarantees that until ``finish``). ``fmt``: the format of
    ``top`` (never probed when known: an adopted raw disk is the frozen top of its first save,
    and its guest writes its first bytes). Thread-safe.
    """

    def __init__(self, top: Path, what: str = "mapping frozen disk",
                 fmt: str | None = None, held: set[tuple[int, int]] | None = None) -> None:
        # ``held``: the file_key of every file the running machine's QEMU has open; a
        # chain file read must be one of them (see _fd). None: no machine to compare with.
        self.held = held
        self.what = what
        chain = backing_chain(top, what, fmt)
        self.files = [Path(c["filename"]) for c in chain]
        self.formats = [c["format"] for c in chain]
        self.size = int(chain[0]["virtual-size"])
        for c in chain:
            data_file = data_file_of(c)
            if data_file:  # qemu-img map's offsets are then offsets into that other file
                raise VMError(f"{what}: {c['filename']} keeps its data in an external file "
                              f"({data_file}), which ksfs cannot read in place")
        raw = json.loads(qemu_img("map", "-U", *format_args(fmt), "--output=json", str(top),
                                  what=what))
        self.extents = [
            Extent(e["start"], e["length"], e.get("depth", 0),
                   bool(e.get("data")) and not e.get("zero", False) and e.get("present", True),
                   e.get("offset"))
            for e in raw
        ]
        for e in self.extents:
            if e.data and e.offset is None:
                raise VMError(f"{what}: {self.files[min(e.depth, len(self.files) - 1)]} has "
                              f"compressed or encrypted clusters, which ksfs cannot read in place")
        self._starts = [e.start for e in self.extents]
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def changed_since(self, base_depth: int) -> list[tuple[int, int]]:
        """Guest ranges allocated (data or zero) in any layer above depth ``base_depth``."""
        out: list[tuple[int, int]] = []
        for e in self.extents:
            if e.depth < base_depth:
                if out and out[-1][0] + out[-1][1] == e.start:
                    out[-1] = (out[-1][0], out[-1][1] + e.length)
                else:
                    out.append((e.start, e.length))
        return out

    def _fd(self, depth: int) -> int:
        with self._lock:
            fd = self._fds.get(depth)
            if fd is None:
                fd = os.open(self.files[depth], os.O_RDONLY | os.O_CLOEXEC)
                if self.held is not None and file_key(os.fstat(fd)) not in self.held:
                    os.close(fd)
                    # A name in the chain that no longer names what the machine runs on: a
                    # link or another file put in its place (security QA F3: root's save read
                    # any file so planted into the user's checkpoint)
                    raise VMError(f"{self.what}: {self.files[depth]} is not the file the "
                                  "machine runs on (it was replaced, or a link put in its "
                                  "place): nothing of it is read")
                self._fds[depth] = fd
            return fd

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0:
            raise VMError("negative read of a frozen disk")
        end = min(offset + n, self.size)
        parts: list[bytes] = []
        pos = offset
        i = max(bisect.bisect_right(self._starts, pos) - 1, 0)
        while pos < end:
            e = self.extents[i]
            take = min(end, e.start + e.length) - pos
            if take <= 0:
                i += 1
                continue
            if e.data:
                assert e.offset is not None
                buf = os.pread(self._fd(e.depth), take, e.offset + (pos - e.start))
                if len(buf) < take:  # a raw file shorter than its virtual size reads as zeros
                    buf += bytes(take - len(buf))
                parts.append(buf)
                self.bytes_read += take
            else:
                parts.append(bytes(take))
            pos += take
            i += 1
        return b"".join(parts)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def files_held_by(domain: str) -> set[tuple[int, int]] | None:
    """The file_key of every file the QEMU process of the running ``domain`` has open, by
    libvirt's pid file (the system daemon's, else the session daemon's); None when there is
    no such process to look at."""
    for run in ("/run/libvirt/qemu", os.path.expanduser("~/.cache/libvirt/qemu/run")):
        try:
            pid = int(Path(run, f"{domain}.pid").read_text().strip())
            names = os.listdir(f"/proc/{pid}/fd")
        except (OSError, ValueError):
            continue
        held = set()
        for name in names:
            try:  # (follows the descriptor's magic link: the open file, in any namespace)
                st = os.stat(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue  # closed meanwhile
            held.add(file_key(st))
        return held
    return None


def file_key(st: os.stat_result) -> tuple[int, int]:
    """What names one open file across processes: (st_dev, st_ino), or for a block device its
    device number (QEMU in libvirt's mount namespace opens its own /dev's node of it)."""
    if stat.S_ISBLK(st.st_mode):
        return (-1, st.st_rdev)
    return (st.st_dev, st.st_ino)


def materialize(reader: object, path: Path, what: str, block: int = ZERO_BLOCK,
                steps: progress.Steps | None = None) -> int:
    """Write a reader's bytes (``.size``, ``.read(offset, n)``) to ``path``, sparse, fsynced.

    All-zero blocks are skipped so the file stays sparse. Returns the bytes written; ``steps``
    counts the bytes gone through (holes too).
    """
    size = int(reader.size)  # type: ignore[attr-defined]
    written = 0
    zero = bytes(block)
    tmp = path.with_name(path.name + ".part")
    try:
        tmp.unlink(missing_ok=True)  # a killed run's leftover keeps its mode through O_TRUNC
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "wb") as f:
            pos = 0
            while pos < size:
                n = min(block, size - pos)
                buf = reader.read(pos, n)  # type: ignore[attr-defined]
                if len(buf) != n:
                    raise VMError(f"{what}: short read at offset {pos} ({len(buf)} of {n} bytes)")
                if buf != (zero if n == block else zero[:n]):
                    f.seek(pos)
                    f.write(buf)
                    written += n
                pos += n
                if steps is not None:
                    steps.add(n)
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # exit 9 / ENOSPC, as a save's is (QA)
            raise NoSpace(path=path, why=f"{what}: {exc.strerror}") from exc
        raise VMError(f"{what}: writing {path} failed: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written
