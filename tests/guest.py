"""Shared helpers for tests that boot the ksfs test guest under a real libvirtd.

    from guest import ensure_guest, require_libvirt, unique_domain, vm_workdir, wait_for_counter

``ensure_guest()`` builds the guest once (tools/build-guest into KSFS_GUEST_DIR, default
/var/cache/ksfs/guest; fast when already built, serialized by a file lock). ``libvirt_ready()``
starts libvirtd/virtlogd with tools/start-libvirt when their sockets are absent and says whether a
connection works. Console and transcript helpers read what the guest prints and writes. Nothing
here ever touches a domain whose name it did not make.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUEST_DIR = Path(os.environ.get("KSFS_GUEST_DIR", "/var/cache/ksfs/guest"))
URI = os.environ.get("KSFS_LIBVIRT_URI", "qemu:///system")
BOOT_TIMEOUT = float(os.environ.get("KSFS_BOOT_TIMEOUT", "180"))
COUNTER = re.compile(r"ksfs-counter (\d+)")


def ensure_guest(out: Path | None = None) -> Path:
    """Build the test guest if needed and return its directory (holding guest.json)."""
    out = Path(out or GUEST_DIR)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        res = subprocess.run([str(ROOT / "tools" / "build-guest"), "--out", str(out)],
                             capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"tools/build-guest failed: {res.stderr.strip()[-2000:]}")
    return out


def guest_config(out: Path | None = None) -> dict:
    """guest.json of the built guest: kernel, initrd, disk, memory_mib, cmdline."""
    return json.loads((ensure_guest(out) / "guest.json").read_text())


def libvirt_ready() -> bool:
    """Start the daemons when their sockets are absent; True when qemu:///system answers."""
    if shutil.which("virsh") is None or shutil.which("qemu-system-x86_64") is None:
        return False
    subprocess.run([str(ROOT / "tools" / "start-libvirt")], capture_output=True, timeout=120)
    res = subprocess.run(["virsh", "-c", URI, "version"], capture_output=True, timeout=60)
    return res.returncode == 0


def require_libvirt() -> None:
    """Skip the calling test (module) when libvirt truly cannot run here."""
    if not libvirt_ready():
        pytest.skip("libvirtd or QEMU is not available on this machine")


def unique_domain(prefix: str = "ksfs-test") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def vm_workdir() -> Path:
    """A fresh controller work directory QEMU (user libvirt-qemu) can reach. Caller removes it."""
    base = Path(os.environ.get("KSFS_VM_TMP", "/var/tmp"))
    d = Path(tempfile.mkdtemp(prefix="ksfs-vmtest-", dir=base))
    d.chmod(0o755)
    return d


def undefine_quietly(name: str) -> None:
    """Destroy and undefine one domain by name, whatever state it is in (for finalizers)."""
    subprocess.run(["virsh", "-c", URI, "destroy", name], capture_output=True, timeout=120)
    subprocess.run(["virsh", "-c", URI, "undefine", "--nvram", name], capture_output=True,
                   timeout=120)
    subprocess.run(["virsh", "-c", URI, "undefine", name], capture_output=True, timeout=120)


def counters(log: Path, start: int = 0) -> list[int]:
    """Every ``ksfs-counter N`` the guest printed on its console after byte ``start``."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for m in COUNTER.finditer(text)]


def settled_size(log: Path, quiet: float = 0.5, timeout: float = 30) -> int:
    """The size of ``log`` once it has not grown for ``quiet`` seconds: a console's bytes reach
    its file through virtlogd's pipe, so some the guest printed before a pause may land after
    the pause returns."""
    deadline = time.monotonic() + timeout
    size, since = log.stat().st_size, time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"{log} kept growing for {timeout:.0f} s"
        time.sleep(0.05)
        if (now := log.stat().st_size) != size:
            size, since = now, time.monotonic()
    return size


def wait_for_counter(log: Path, at_least: int = 1, start: int = 0,
                     timeout: float = BOOT_TIMEOUT, count: int = 1) -> list[int]:
    """Wait until ``count`` counters were printed after ``start`` and the last is >= at_least."""
    deadline = time.monotonic() + timeout
    while True:
        seen = counters(log, start)
        if len(seen) >= count and seen[-1] >= at_least:
            return seen
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise AssertionError(f"guest printed no counter >= {at_least} in {timeout:.0f} s; "
                                 f"console tail:\n{tail}")
        time.sleep(0.2)


def guest_writes(store: Path, session: str, lines: int, start: int | None = None,
                 timeout: float = 120.0) -> list[int]:
    """Wait until SESSION's guest has printed ``lines`` counters on its console after byte
    ``start`` of its console log (default: its end now), and return them. The guest prints one
    for each transcript line it has made durable (tools/guest-init.sh), about 2.5 a second
    under TCG here: a wait for lines, not a fixed sleep too long on a fast host and too short
    on a slow one. (ksfs's domains append to their log across restores: offsets stay valid.)"""
    log = Path(store) / "vm" / session / "console.log"
    return wait_for_counter(log, at_least=0, start=log.stat().st_size if start is None else start,
                            timeout=timeout, count=lines)


def read_image_file(image: Path, path: str) -> bytes:
    """A file from the ext4 filesystem of a raw disk image, journal replayed on a copy first.

    The image of a running guest holds recent metadata only in its journal, which debugfs alone
    does not read.
    """
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "image.raw"
        subprocess.run(["cp", "--sparse=always", str(image), str(copy)], check=True)
        fsck = subprocess.run(["e2fsck", "-p", "-E", "journal_only", str(copy)],
                              capture_output=True, timeout=120)
        if fsck.returncode not in (0, 1):
            raise AssertionError(f"e2fsck could not replay the journal of {image}: "
                                 f"{fsck.stdout.decode()[-500:]} {fsck.stderr.decode()[-500:]}")
        res = subprocess.run(["debugfs", "-R", f"cat {path}", str(copy)], capture_output=True,
                             timeout=60)
    if res.returncode != 0:
        raise AssertionError(f"debugfs could not read {path}: {res.stderr.decode()[-500:]}")
    return res.stdout


def transcript(image: Path) -> list[dict]:
    """The transcript lines (whole JSON lines only) stored in a raw disk image."""
    out = []
    for line in read_image_file(image, "/agent/transcript.jsonl").decode().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a torn last line is possible only in images taken without the guest's sync
    return out


class FileReader:
    """A plain file as the reader restore and fork take (``.size``, ``.read(offset, n)``)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self._fd = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0

    def read(self, offset: int, n: int) -> bytes:
        buf = os.pread(self._fd, n, offset)
        self.bytes_read += len(buf)
        return buf

    def close(self) -> None:
        os.close(self._fd)


def copy_source(source: object, dest: Path, changed: list[tuple[int, int]] | None = None,
                base: Path | None = None, block: int = 1 << 20) -> int:
    """Ingest a frozen disk the simple way: a file copy (only ``changed`` ranges over ``base``).

    Returns the bytes read from the source.
    """
    size = int(source.size)  # type: ignore[attr-defined]
    read = 0
    if changed is None or base is None:
        with open(dest, "wb") as f:
            for off in range(0, size, block):
                buf = source.pread(off, min(block, size - off))  # type: ignore[attr-defined]
                read += len(buf)
                if buf.count(0) != len(buf):
                    f.seek(off)
                    f.write(buf)
            f.truncate(size)
        return read
    subprocess.run(["cp", "--sparse=always", str(base), str(dest)], check=True)
    with open(dest, "r+b") as f:
        for off, length in changed:
            buf = source.pread(off, length)  # type: ignore[attr-defined]
            read += len(buf)
            f.seek(off)
            f.write(buf)
    return read
