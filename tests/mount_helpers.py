"""Helpers for tests that mount a store for real: a mount server in a subprocess, a wait that
fails if the server died, and an unmount that checks the mountpoint is gone and the server exited 0.
Tests skip only when FUSE truly cannot mount here. Also the source files (sparse disks, memory-like
images) and the offline store the mount tests share."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ksfs.keeper import Keeper
from ksfs.model import CheckpointRecord

REPO = Path(__file__).resolve().parent.parent


def fuse_unavailable() -> str | None:
    """Why FUSE cannot mount on this machine, or None when it can."""
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed"
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return f"/dev/fuse cannot be opened: {exc}"
    os.close(fd)
    return None


def skip_without_fuse() -> None:
    why = fuse_unavailable()
    if why:
        pytest.skip(why)


def start_mount(store: Path, mnt: Path, env: dict[str, str] | None = None,
                log: Path | None = None, args: tuple[str, ...] = ()) -> subprocess.Popen:
    full_env = dict(os.environ, **(env or {}))
    out = open(log, "wb") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "ksfs.fuse.mount", str(store), str(mnt), *args],
            cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT,
        )
    finally:
        if log:
            out.close()


def wait_for_mount(proc: subprocess.Popen, mnt: Path, timeout: float = 30.0,
                   log: Path | None = None) -> None:
    """Wait until ``mnt`` is a mountpoint; fail at once if the server process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace") if log and log.exists() else ""
            pytest.fail(f"mount server exited with {proc.returncode} before mounting:\n{text}")
        if os.path.ismount(mnt):
            return
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    pytest.fail(f"{mnt} was not mounted within {timeout} s")


def umount(proc: subprocess.Popen, mnt: Path, timeout: float = 30.0,
           log: Path | None = None) -> None:
    """Unmount, then assert the mountpoint is gone and the server exited 0."""
    def tail() -> str:
        return log.read_text(errors="replace")[-4000:] if log and log.exists() else ""

    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"mount server did not exit after unmount; its log ends:\n{tail()}")
    assert not os.path.ismount(mnt), f"{mnt} is still mounted"
    assert rc == 0, f"mount server exited with {rc}; its log ends:\n{tail()}"


@contextlib.contextmanager
def mounted(store_path: Path, env: dict[str, str] | None = None,
            args: tuple[str, ...] = ()) -> Iterator[Path]:
    """Mount ``store_path`` on a fresh temporary directory for the body of the block (with
    ``--allow-other`` in ``args``, one other users can reach)."""
    skip_without_fuse()
    tmp = Path(tempfile.mkdtemp(prefix="ksfs-mnt-"))
    if "--allow-other" in args:
        tmp.chmod(0o755)
    mnt = tmp / "mnt"
    mnt.mkdir()
    log = tmp / "server.log"
    try:
        proc = start_mount(store_path, mnt, env, log, args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        wait_for_mount(proc, mnt, log=log)
        mounted.last_pid = proc.pid
        yield mnt
    finally:
        try:
            umount(proc, mnt, log=log)
        finally:
            mounted.last_log = log.read_text(errors="replace")
            shutil.rmtree(tmp, ignore_errors=True)


mounted.last_log = ""  # type: ignore[attr-defined]
mounted.last_pid = 0  # type: ignore[attr-defined]  # the server of the innermost open block

# --- source files and an offline store ------------------------------------------------------

KIB = 1024
MIB = 1024 * KIB


def write_disk(path: Path, size: int, seed: int, extents: list[tuple[int, int]]) -> Path:
    """A sparse disk image of ``size`` bytes: random data only in ``extents``, holes elsewhere."""
    rnd = random.Random(seed)
    with open(path, "wb") as f:
        f.truncate(size)
        for off, n in extents:
            f.seek(off)
            f.write(rnd.randbytes(n))
    return path


def write_memory(path: Path, size: int, seed: int) -> Path:
    """A memory-like image: runs of random bytes, repeated pages and zeros (compresses a bit)."""
    rnd = random.Random(seed)
    out = bytearray()
    page = rnd.randbytes(4096)
    while len(out) < size:
        kind = rnd.randrange(3)
        n = rnd.randrange(1, 64) * 1024
        out += rnd.randbytes(n) if kind == 0 else (page * (n // 4096 + 1))[:n] if kind == 1 \
            else bytes(n)
    path.write_bytes(bytes(out[:size]))
    return path


def build_store(root: Path) -> dict:
    """A store with session s1 (c1, c2: disks differing in a few bytes, equal memory), a scratch
    checkpoint to delete, and session ``many`` with 1,000 checkpoints. Returns the source paths."""
    src = root / "src"
    src.mkdir()
    # Sizes deliberately not multiples of 64 KiB; holes between the data extents.
    size = 6 * MIB + 1000
    extents = [(0, 100 * KIB), (1 * MIB + 123, 300 * KIB), (5 * MIB + 7, 64 * KIB + 5),
               (size - 700, 700)]
    disk1 = write_disk(src / "disk1.raw", size, 1, extents)
    disk2 = src / "disk2.raw"
    data = bytearray(disk1.read_bytes())
    for off in (1 * MIB + 500, 5 * MIB + 10):
        data[off] ^= 0xFF
    disk2.write_bytes(bytes(data))
    memory = write_memory(src / "memory", 3 * MIB + 4321, 7)
    tiny = src / "note"
    tiny.write_bytes(b"tiny\n")
    store = root / "store"
    sources = {"disk1": disk1, "disk2": disk2, "memory": memory, "store": store}
    with Keeper(store, create=True) as k:
        for name, disk in (("c1", disk1), ("c2", disk2)):
            staged = src / name
            staged.mkdir()
            (staged / "disk.raw").symlink_to(disk)
            (staged / "memory").symlink_to(memory)
            k.import_files("s1", name, [staged / "memory"], disks=[staged / "disk.raw"])
        k.import_files("s1", "scratch", [tiny])
        add_checkpoints(k, "many", 1000, tiny)
    return sources


def add_checkpoints(k: Keeper, session: str, count: int, tiny: Path) -> None:
    """``count`` checkpoints of one tiny file, written in one ledger transaction (fast)."""
    first = k.import_files(session, "k_00000", [tiny])
    with k.store.env.begin(write=True) as txn:
        for i in range(1, count):
            name = f"k_{i:05d}"
            ev = k.ledger.append(txn, session, "checkpoint.begin", {"name": name})
            rec = CheckpointRecord(session=session, name=name, seq=ev.seq, created=time.time(),
                                   files=first.files, parent=f"k_{i - 1:05d}")
            k.ledger.put_checkpoint(txn, rec)
