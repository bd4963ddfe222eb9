"""`ksfs mount` and `ksfs umount` with the paths and daemons users really have: a mount point
reached through a symlink, and a daemon that no longer answers (QA, fourteenth session)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.cli_helpers import KSFS

ENV = dict(os.environ, KSFS_GUEST="")


def ksfs(store: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, stdin=subprocess.DEVNULL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def test_a_mount_point_through_a_symlink_stays_mounted_and_unmounts(tmp_path: Path) -> None:
    """The daemon compared the path as given with the kernel's mount table, which holds the
    real one: it took its mount for gone a second later and stopped, and fusermount3 refused
    to unmount a path ending in a symlink."""
    store, real = tmp_path / "store", tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "parent").symlink_to(tmp_path)
    for given in (tmp_path / "link", tmp_path / "parent" / "real"):
        res = ksfs(store, "mount", str(given))
        assert res.returncode == 0, res.stderr
        try:
            time.sleep(2.5)  # the watcher looks every second
            assert os.path.ismount(real)
            assert sorted(os.listdir(given)) == ["sessions", "store"]
            res = ksfs(store, "umount", str(given))
            assert res.returncode == 0, res.stderr
            assert not os.path.ismount(real)
        finally:
            if os.path.ismount(real):
                subprocess.run(["fusermount3", "-u", str(real)], check=False)


def test_umount_of_a_daemon_that_does_not_answer(tmp_path: Path) -> None:
    """A stopped daemon's mount could not be unmounted: `ksfs umount` read its `store` file in
    a thread of its own, which held the mount busy ("in use")."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    res = ksfs(store, "mount", str(mnt))
    assert res.returncode == 0, res.stderr
    pid = int(re.search(r"\(pid (\d+),", res.stdout).group(1))
    try:
        os.kill(pid, signal.SIGSTOP)
        res = ksfs(store, "umount", str(mnt), timeout=60)
        assert res.returncode == 0, res.stderr
        assert "did not answer" in res.stdout and not os.path.ismount(mnt)
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:  # it sees its mount gone and ends
            time.sleep(0.2)
        assert not alive(pid)
        res = ksfs(store, "mount", str(mnt))  # and the store mounts again
        assert res.returncode == 0, res.stderr
        res = ksfs(store, "umount", str(mnt))
        assert res.returncode == 0 and res.stdout.strip() == f"unmounted {mnt}", res
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_wait_that_is_no_number_of_seconds_is_refused_before_anything(tmp_path: Path) -> None:
    """QA: `mount --timeout -1` (or nan) started a daemon, killed it at once, and said exit 13
    "no answer within -1s", having made the store's files."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    for value in ("-1", "0", "nan", "inf", "soon"):
        for verb in ("mount", "umount"):
            res = ksfs(store, verb, str(mnt), "--timeout", value)
            assert res.returncode == 2, (verb, value, res.stderr)
            assert res.stderr.startswith("ksfs: error: --timeout: must be a number of seconds")
        assert not store.exists() and not os.path.ismount(mnt)
