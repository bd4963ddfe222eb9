"""Helpers for tests that drive ksfs through its real command line and mount daemon.

``ksfs(store, env, *args)`` runs one command in a subprocess; ``daemon_mount(...)`` mounts a fresh
store with `ksfs mount` for the body of a block and, whatever happens, removes every session it
holds (so every domain), unmounts, and checks the mount point is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, env: dict | None, *args: str, check: bool = True,
         timeout: float = 300) -> subprocess.CompletedProcess:
    res = subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                         env=env, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"ksfs {' '.join(args)} -> {res.returncode}: {res.stderr}")
    return res


def ksfs_on_terminal(store: Path, env: dict | None, *args: str,
                     timeout: float = 300, columns: int = 200) -> tuple[int, str, str]:
    """Run ksfs with its standard error on a pseudo-terminal ``columns`` wide (standard output
    piped): (exit code, stdout, what the terminal got)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(KSFS + ["--store", str(store), *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=terminal, env=env)
    os.close(terminal)
    got = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                part = os.read(controller, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not part:
                break
            got += part
        out = proc.stdout.read().decode()
        return proc.wait(timeout=max(1, deadline - time.monotonic())), out, got.decode()
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def virsh(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    res = subprocess.run(["virsh", "-q", "-c", "qemu:///system", *args], capture_output=True,
                         text=True, check=check)
    if args and args[0] == "undefine":  # a test's own domain: libvirt's log of it goes too
        for f in Path("/var/log/libvirt/qemu").glob(glob.escape(args[-1]) + ".log*"):
            f.unlink(missing_ok=True)
    return res


def guest_dir() -> Path:
    """libvirtd up and the test guest built (both idempotent); the guest's directory."""
    subprocess.run([str(ROOT / "tools/start-libvirt")], check=True)
    out = subprocess.run([str(ROOT / "tools/build-guest")], check=True, capture_output=True,
                         text=True).stdout
    return Path(out.strip().splitlines()[-1])


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def remove_sessions(store: Path, env: dict | None, extra: list[str] = ()) -> None:
    """Remove every session of the store (and so its domain), plus domains named in ``extra``."""
    listing = ksfs(store, env, "session", "list", "--json", check=False)
    names = [s["session"] for s in json.loads(listing.stdout or "[]")] \
        if listing.returncode == 0 else []
    # and every machine the store made a directory for: a listing that failed (a daemon that
    # stopped under a failed test) left its domain defined for the next run to trip on
    vm = Path(store) / "vm"
    names += [d.name for d in vm.iterdir() if d.is_dir()] if vm.is_dir() else []
    for name in set(names) | set(extra):
        ksfs(store, env, "session", "rm", name, check=False)
        virsh("destroy", f"ksfs-{name}")
        virsh("undefine", f"ksfs-{name}")


@contextlib.contextmanager
def daemon_mount(base: Path, env: dict, *mount_args: str) -> Iterator[tuple[Path, Path]]:
    """(store, mnt) of a fresh store mounted by `ksfs mount` under ``base``."""
    store, mnt = base / "store", base / "mnt"
    mnt.mkdir()
    ksfs(store, env, "mount", str(mnt), *mount_args)
    try:
        yield store, mnt
    finally:
        remove_sessions(store, env)
        if os.path.ismount(mnt):
            ksfs(store, env, "umount", str(mnt), check=False)
    assert not os.path.ismount(mnt), f"{mnt} is still mounted"


def transcript(path: Path) -> list[dict]:
    """The JSON lines of a transcript file; a torn last line is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def flock_waited_on(fd: int) -> bool:
    """Whether a process waits for the flock held on ``fd``'s file (a ``->`` line of
    /proc/locks naming its inode)."""
    inode = os.fstat(fd).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 6 and fields[1] == "->" and fields[2] == "FLOCK" and \
                fields[6].rsplit(":", 1)[-1] == str(inode):
            return True
    return False
