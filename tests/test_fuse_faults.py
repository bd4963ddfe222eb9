"""Faults through the mount: a damaged chunk and a crashing handler each give EIO for what they
touch, never wrong bytes, and the mount stays up and keeps serving everything else."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal

import pytest

from ksfs.keeper import Keeper
from tests.mount_helpers import (
    MIB,
    mounted,
    skip_without_fuse,
    start_mount,
    umount,
    wait_for_mount,
    write_disk,
    write_memory,
)

K64 = 64 * 1024


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    disk = write_disk(root / "disk.raw", 2 * MIB + 3, 3, [(0, 2 * MIB + 3)])
    memory = write_memory(root / "memory", 1 * MIB + 17, 4)
    with Keeper(root / "store", create=True) as k:
        k.import_files("s", "c", [memory], disks=[disk])
    return root / "store", disk, memory


def read_error(path, offset: int, n: int) -> int | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, n, offset)
        return None
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)


def test_crash_inside_a_handler_gives_eio_and_the_mount_stays_up(small_store):
    store, disk, memory = small_store
    with mounted(store, env={"KSFS_FUSE_FAULT": "read:memory"}) as mnt:
        c = mnt / "sessions" / "s" / "checkpoints" / "c"
        for _ in range(3):
            with pytest.raises(OSError) as info:
                (c / "memory").read_bytes()
            assert info.value.errno == errno.EIO
        # Still mounted and serving: listing, sizes, other files' bytes.
        assert os.path.ismount(mnt)
        assert (c / "memory").stat().st_size == memory.stat().st_size
        assert (c / "disk.raw").read_bytes() == disk.read_bytes()
        assert "s" in os.listdir(mnt / "sessions")
    assert "injected crash" in mounted.last_log and "answering EIO" in mounted.last_log


def test_damaged_chunk_gives_eio_never_wrong_bytes(small_store, tmp_path):
    store, disk, memory = small_store
    # Damage one chunk of the disk in a copy of the store, so the other test keeps a good one.
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    with Keeper(damaged) as k:
        reader = k.open_file("s", "c", "disk.raw")
        ids = reader.chunk_ids()
        victim = 5  # the sixth 64 KiB cluster
        loc = k.store.lookup(ids[victim])
        pack = os.path.join(k.store.packs_dir, f"{loc.pack:08d}.pack")
    with open(pack, "r+b") as f:
        f.seek(loc.offset + 52 + loc.stored_len // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    original = disk.read_bytes()
    with mounted(damaged) as mnt:
        path = mnt / "sessions" / "s" / "checkpoints" / "c" / "disk.raw"
        assert read_error(path, victim * K64 + 10, 100) == errno.EIO
        # Everything outside the damaged cluster still reads, and reads right.
        rnd = random.Random(1)
        fd = os.open(path, os.O_RDONLY)
        try:
            for _ in range(50):
                off = rnd.choice([rnd.randrange(0, victim * K64 - 4096),
                                  rnd.randrange((victim + 1) * K64, len(original) - 1)])
                n = min(4096, (victim * K64 - off) if off < victim * K64 else 4096)
                assert os.pread(fd, n, off) == original[off : off + n]
        finally:
            os.close(fd)
        assert os.path.ismount(mnt)
        assert (mnt / "sessions" / "s" / "checkpoints" / "c" / "memory").read_bytes() == \
            memory.read_bytes()


def test_sigterm_unmounts_cleanly(small_store, tmp_path):
    store, disk, memory = small_store
    skip_without_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = start_mount(store, mnt, log=tmp_path / "log")
    wait_for_mount(proc, mnt, log=tmp_path / "log")
    assert (mnt / "sessions" / "s" / "checkpoints" / "c" / "memory").read_bytes() == \
        memory.read_bytes()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not os.path.ismount(mnt)
    umount(proc, mnt)  # asserts the same through the shared helper


def test_mounting_on_a_non_directory_is_a_clear_error(small_store, tmp_path):
    from ksfs.errors import DaemonError
    from ksfs.fuse.mount import run_mount

    store, disk, memory = small_store
    with Keeper(store) as k:
        for target in (tmp_path / "missing", disk):
            with pytest.raises(DaemonError, match="not a directory"):
                run_mount(k, target)


def test_a_mount_whose_server_was_killed_says_how_to_clear_it(small_store, tmp_path):
    """kill -9 of the mount's server leaves a dead mount: ``ksfs mount`` on it is refused with
    the way out (``ksfs umount``), which clears it; then it mounts again."""
    import subprocess
    import sys

    store, disk, memory = small_store
    skip_without_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = start_mount(store, mnt, log=tmp_path / "log")
    try:
        wait_for_mount(proc, mnt, log=tmp_path / "log")
        proc.kill()
        proc.wait(30)
        cli = [sys.executable, "-m", "ksfs.cli", "--store", str(store)]
        res = subprocess.run(cli + ["mount", str(mnt)], capture_output=True, text=True,
                             timeout=60)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 8, res.stderr  # Busy, as mount(2)
        assert len(lines) == 1 and f"ksfs umount {mnt}" in lines[0], res.stderr
        res = subprocess.run(cli + ["umount", str(mnt)], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(mnt)
    finally:
        if os.path.ismount(mnt) or proc.poll() is None:
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
            proc.kill()
    proc = start_mount(store, mnt, log=tmp_path / "log2")
    wait_for_mount(proc, mnt, log=tmp_path / "log2")
    assert (mnt / "sessions" / "s" / "checkpoints" / "c" / "memory").read_bytes() == \
        memory.read_bytes()
    umount(proc, mnt)


def test_umount_of_a_mount_in_use_is_busy_and_leaves_it_mounted(small_store):
    import subprocess
    import sys

    store, disk, memory = small_store
    with mounted(store) as mnt:
        cli = [sys.executable, "-m", "ksfs.cli", "--store", str(store), "umount", str(mnt)]
        with open(mnt / "sessions" / "s" / "checkpoints" / "c" / "memory", "rb") as held:
            res = subprocess.run(cli, capture_output=True, text=True, timeout=60)
            assert res.returncode == 8, res.stderr
            assert res.stderr.strip() == (
                f"ksfs: error: {mnt} is in use (a process has a file open or its working "
                "directory there, or is waiting on a verb it asked for there, such as a mkdir "
                "that saves): not unmounted")
            assert os.path.ismount(mnt) and held.read() == memory.read_bytes()


def test_umount_touches_only_ksfs_mounts_and_takes_any_path(small_store, tmp_path):
    """QA (ninth session): run as root, `ksfs umount` unmounted whatever was mounted there (a
    tmpfs, a loop-mounted disk), and a mount point with a space was "not mounted" (its
    /proc/mounts field is escaped), so neither umount nor the mount's own check worked."""
    import subprocess
    import sys

    store, disk, memory = small_store
    skip_without_fuse()
    cli = [sys.executable, "-m", "ksfs.cli", "--store", str(store)]
    other = tmp_path / "other"
    other.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "qa", str(other)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    odd = tmp_path / "with space\tand tab"
    odd.mkdir()
    try:
        for verb, why, code in (("umount", "is not a ksfs mount (it is tmpfs)", 2),
                                ("mount", "is already a mount point (of tmpfs)", 8)):
            res = subprocess.run(cli + [verb, str(other)], capture_output=True, text=True,
                                 timeout=60)
            assert res.returncode == code and why in res.stderr, res.stderr
            assert os.path.ismount(other)
        res = subprocess.run(cli + ["mount", str(odd)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        assert (odd / "sessions" / "s" / "checkpoints" / "c" / "memory").read_bytes() == \
            memory.read_bytes()
        again = subprocess.run(cli + ["mount", str(odd)], capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 8 and "already a ksfs mount" in again.stderr, again.stderr
        res = subprocess.run(cli + ["umount", str(odd)], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(odd)
    finally:
        if os.path.ismount(odd):
            subprocess.run(["fusermount3", "-uz", str(odd)], check=False)
        subprocess.run(["umount", str(other)], check=False)


def test_umount_given_another_store_waits_for_the_daemon_of_the_mount(small_store, tmp_path):
    """QA (ninth session): `ksfs umount` waited on the daemon of its own --store, so with
    another (or the default) store it returned while the mount's daemon was still closing.
    The mount's `store` file says where its store is; umount waits on that daemon's lock."""
    import fcntl
    import json
    import subprocess
    import sys

    store, disk, memory = small_store
    skip_without_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cli = [sys.executable, "-m", "ksfs.cli"]
    res = subprocess.run(cli + ["--store", str(store), "mount", str(mnt)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    try:
        assert json.loads((mnt / "store").read_text())["path"] == str(store)
        res = subprocess.run(cli + ["--store", str(tmp_path / "elsewhere"), "umount", str(mnt)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert not os.path.ismount(mnt)
        fd = os.open(store / "daemon.lock", os.O_RDWR)
        try:  # the daemon is gone: its lock is free at once
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)


def test_a_mount_without_a_usable_fuse_device_says_why(tmp_path):
    """QA (tenth session): a user without access to /dev/fuse got "fuse_session_mount failed"
    (exit 13) with the reason only in the daemon's log."""
    import errno as errno_

    from ksfs.errors import DaemonError, NotPermitted
    from ksfs.fuse.mount import require_fuse_device

    with pytest.raises(DaemonError, match="there is no .*load the fuse module"):
        require_fuse_device(str(tmp_path / "no-fuse"))
    blocked = tmp_path / "fuse"
    blocked.write_bytes(b"")
    blocked.chmod(0)
    if os.geteuid() == 0:  # root opens it all the same: the refusal is shown as the kernel's
        require_fuse_device(str(blocked))
        with pytest.raises(NotPermitted, match="needs read and write access"):
            import unittest.mock as mock

            with mock.patch("os.open", side_effect=PermissionError(errno_.EACCES, "denied")):
                require_fuse_device(str(blocked))
    else:
        with pytest.raises(NotPermitted, match="needs read and write access"):
            require_fuse_device(str(blocked))
    require_fuse_device()  # the real one, which these tests mount with
