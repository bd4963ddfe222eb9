"""`ksfs mount` and `ksfs umount` with the paths and daemons users really have: a mount point
reached through a symlink, and a daemon that no longer answers (QA, fourteenth session)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ksfs.cli.mount_cmds import _wait_for_release
from tests.cli_helpers import KSFS, alive

ENV = dict(os.environ, KSFS_GUEST="")


def ksfs(store: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, stdin=subprocess.DEVNULL)


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


def test_a_store_path_too_long_for_a_unix_socket_mounts_and_serves_verbs(tmp_path: Path) -> None:
    """QA (fifteenth session): the control socket (STORE/daemon.sock) of a store path over ~95
    characters is beyond a Unix socket's 108 bytes: its bind failed after the FUSE mount was
    up, and the mount was left dead with an empty log."""
    from ksfs.daemon.client import NO_DAEMON, call_daemon

    store = tmp_path / ("s" * max(1, 120 - len(str(tmp_path)))) / "store"
    assert len(os.fsencode(store / "daemon.sock")) > 108
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = ksfs(store, "mount", str(mnt), timeout=90)
    assert res.returncode == 0, res.stderr
    try:
        assert (store / "daemon.sock").exists()
        assert call_daemon(store, "ping") is not NO_DAEMON  # answered by the daemon
        src = tmp_path / "notes.txt"
        src.write_text("notes\n")
        res = ksfs(store, "import", "s", "c1", str(src))
        assert res.returncode == 0, res.stderr
        assert (mnt / "sessions" / "s" / "checkpoints" / "c1" / "notes.txt").read_text() \
            == "notes\n"
    finally:
        res = ksfs(store, "umount", str(mnt))
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    assert res.returncode == 0 and not os.path.ismount(mnt), res


def test_a_daemon_task_that_fails_after_the_mount_takes_the_mount_down_and_says_why(
        tmp_path: Path) -> None:
    """QA (fifteenth session): a task of the daemon failing once FUSE was mounted (there, the
    control socket's bind) ended the daemon with nothing in its log, left a dead mount
    (ENOTCONN) in the way, and `ksfs mount` waited its whole --timeout."""
    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    src = tmp_path / "notes.txt"
    src.write_text("notes\n")
    assert ksfs(store, "import", "s", "c1", str(src)).returncode == 0
    (store / "daemon.sock").mkdir()  # the socket's place taken: its task fails at once
    t0 = time.monotonic()
    try:
        res = ksfs(store, "mount", str(mnt), "--timeout", "60", timeout=90)
        # (its class kept: a directory there is damage, exit 6; twenty-fourth session)
        assert res.returncode == 6, res
        assert time.monotonic() - t0 < 30, "it waited for its --timeout"
        assert f"its control socket {store / 'daemon.sock'} is a directory" in res.stderr, \
            res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "daemon.sock" in (store / "daemon.log").read_text()
        deadline = time.monotonic() + 10
        while os.path.ismount(mnt) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.ismount(mnt)
        # and the daemon gone: it unmounts before it says why and lets go of the store
        assert _wait_for_release(store / "daemon.lock", 30), "the daemon still holds the store"
        (store / "daemon.sock").rmdir()
        res = ksfs(store, "mount", str(mnt))  # nothing left in the way
        assert res.returncode == 0, res.stderr
        assert (mnt / "sessions" / "s" / "checkpoints" / "c1" / "notes.txt").exists()
        assert ksfs(store, "umount", str(mnt)).returncode == 0
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_the_module_entry_point_refuses_a_store_already_mounted(tmp_path: Path) -> None:
    """QA (fifteenth session): `python -m ksfs.fuse.mount STORE MNT2` mounted a store that
    `ksfs mount` already had, so two daemons served one store; and a refused second `ksfs
    mount` wrote its error into the running daemon's log."""
    import sys

    store, mnt, mnt2 = tmp_path / "store", tmp_path / "mnt", tmp_path / "mnt2"
    mnt.mkdir()
    mnt2.mkdir()
    assert ksfs(store, "mount", str(mnt)).returncode == 0
    try:
        log_before = (store / "daemon.log").read_text()
        res = subprocess.run([sys.executable, "-m", "ksfs.fuse.mount", str(store), str(mnt2)],
                             capture_output=True, text=True, timeout=60, env=ENV)
        assert res.returncode == 8, res
        assert f"already mounted at {mnt}" in res.stderr, res.stderr
        assert not os.path.ismount(mnt2)
        res = ksfs(store, "mount", str(mnt2))
        assert res.returncode == 8 and "already mounted" in res.stderr, res
        assert not os.path.ismount(mnt2)
        assert (store / "daemon.log").read_text() == log_before
    finally:
        for m in (mnt2, mnt):
            if os.path.ismount(m):
                ksfs(store, "umount", str(m))
    assert not os.path.ismount(mnt)


def test_a_default_guest_template_that_is_no_guest_is_said_so(tmp_path: Path) -> None:
    """QA (fifteenth session): a default guest (KSFS_GUEST or config.json) that does not
    exist made `mkdir sessions/NAME` answer ENOENT with nothing in the log, as if the new
    name were missing; an unparsable config.json was said to set no template."""
    import errno

    store, mnt = tmp_path / "store", tmp_path / "mnt"
    mnt.mkdir()
    nowhere = tmp_path / "nowhere"
    for env, said in ((dict(ENV, KSFS_GUEST=str(nowhere)),
                       f"the default guest template {nowhere} (KSFS_GUEST) is not a guest "
                       "directory"),
                      (ENV, "config.json is not valid JSON")):
        if "KSFS_GUEST" in env and not env["KSFS_GUEST"]:
            (store / "config.json").write_text("not json")
        res = subprocess.run(KSFS + ["--store", str(store), "mount", str(mnt)], env=env,
                             capture_output=True, text=True, timeout=90)
        assert res.returncode == 0, res.stderr
        try:
            try:
                os.mkdir(mnt / "sessions" / "s1")
                raise AssertionError("mkdir sessions/s1 made a session")
            except OSError as exc:
                assert exc.errno == errno.EPERM, exc
            assert said in (store / "daemon.log").read_text()
            assert os.listdir(mnt / "sessions") == []
        finally:
            res = ksfs(store, "umount", str(mnt))
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", str(mnt)], check=False)
        assert res.returncode == 0, res


def test_another_users_umount_is_not_permitted() -> None:
    """QA (fifteenth session): a non-root user's `ksfs umount` of root's mount said exit 13
    with fusermount3's words about /etc/mtab."""
    import tempfile

    import pytest

    # A clone under a directory nobody else may enter (/root) has a Python that nobody may run
    # (a fresh clone's CI run failed here so, with ModuleNotFoundError, exit 1).
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            *KSFS, "--version"], capture_output=True, env=ENV, cwd="/")
    if probe.returncode != 0:
        pytest.skip("this Python cannot be run by an unprivileged user here")
    # (not under pytest's own temporary directory, which nobody else may enter)
    with tempfile.TemporaryDirectory(prefix="ksfs-other-user-", dir="/tmp") as where:
        os.chmod(where, 0o755)
        _try_umount_as_nobody(Path(where))


def _try_umount_as_nobody(base: Path) -> None:
    store, mnt = base / "store", base / "mnt"
    mnt.mkdir()
    assert ksfs(store, "mount", str(mnt)).returncode == 0
    try:
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              *KSFS, "--store", str(store), "umount", str(mnt)],
                             capture_output=True, text=True, env=ENV, timeout=60)
        assert res.returncode == 12, res
        assert "was mounted by another user" in res.stderr, res.stderr
        assert os.path.ismount(mnt)
    finally:
        res = ksfs(store, "umount", str(mnt))
    assert res.returncode == 0 and not os.path.ismount(mnt), res


READY_ORDER = r"""
import os, signal, sys, time
import trio
from ksfs.fuse.mount import run_mount
from ksfs.keeper import Keeper

store, mnt, told = sys.argv[1:]

def say(what):
    with open(told, "a") as f:
        f.write(what + "\n")

async def slow_service(task_status=trio.TASK_STATUS_IGNORED):
    await trio.sleep(0.5)  # longer than the mount takes to be in place
    say("service started")
    task_status.started()
    await trio.sleep_forever()

def ready():
    say("ready")
    os.kill(os.getpid(), signal.SIGTERM)  # unmounts

with Keeper(store, create=True) as keeper:
    run_mount(keeper, mnt, ready=ready, services=[slow_service])
say("unmounted")
"""


def test_ready_waits_for_the_services_to_start(tmp_path: Path) -> None:
    """A review (33rd session) found the control socket started with start_soon: `ksfs mount`
    could say ready before the socket listened, and a verb sent at once found no daemon. The
    mount's ready now waits for every service (the control socket) to say it started."""
    store, mnt, told = tmp_path / "store", tmp_path / "mnt", tmp_path / "told"
    mnt.mkdir()
    try:
        res = subprocess.run([sys.executable, "-c", READY_ORDER, str(store), str(mnt), str(told)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert told.read_text().splitlines() == ["service started", "ready", "unmounted"]
        assert not os.path.ismount(mnt)
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)
