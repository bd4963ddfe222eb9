"""Mount verbs: mount (the daemon) and umount."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import click

from ksfs.cli import SECONDS, main, pass_ctx
from ksfs.errors import BadInput, Busy, DaemonError, DaemonTimeout, NoSuchFile, NotPermitted

KSFS_FSTYPE = "fuse.ksfs"
_MOUNTS_ESCAPES = re.compile(r"\\([0-7]{3})")  # /proc/mounts writes " " as \040 and so on


def _mount_type(mountpoint: str) -> str | None:
    """The type of the filesystem mounted on ``mountpoint`` (the last one mounted there), or
    None when nothing is."""
    target = os.path.realpath(mountpoint)
    found = None
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and _MOUNTS_ESCAPES.sub(
                    lambda m: chr(int(m.group(1), 8)), fields[1]) == target:
                found = fields[2]
    return found


def _mounted_store(mountpoint: str, wait: float = 2.0) -> tuple[str | None, bool | None]:
    """(the store the daemon serving ``mountpoint`` keeps, as its ``store`` file says, or
    None; whether the daemon answered within ``wait`` seconds: True, False, or None when it is
    gone, the kernel answering ENOTCONN for it). The file is read by a child process, killed
    when the daemon does not answer: a read left waiting in this process would hold the mount
    busy, and the unmount would fail (QA: a stopped daemon's mount could not be unmounted, "in
    use")."""
    try:
        res = subprocess.run(["cat", "--", os.path.join(mountpoint, "store")],
                             capture_output=True, timeout=wait, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, LC_ALL="C"))  # its strerror, in English
    except subprocess.TimeoutExpired:  # (run kills the child: a FUSE wait is killable)
        return None, False
    if b"not connected" in res.stderr:  # ENOTCONN: "Transport endpoint is not connected"
        return None, None
    try:
        path = json.loads(res.stdout[: 1 << 20]).get("path") if res.returncode == 0 else None
    except (ValueError, AttributeError):
        path = None
    return (path if isinstance(path, str) and os.path.isdir(path) else None), True


@main.command()
@click.argument("mountpoint")  # (a file is refused below, in ksfs's words: QA)
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground, logging to stderr.")
@click.option("--allow-other", is_flag=True,
              help="Let other users see the mount: every local user then reads every "
                   "checkpoint, memory and disk included.")
@click.option("--upstream", metavar="URL",
              help="Model provider the gateway fronts (default $KSFS_UPSTREAM or config.json).")
@click.option("--timeout", type=SECONDS, default=120.0, show_default=True,
              help="Seconds to wait for the mount.")
@pass_ctx
def mount(ctx, mountpoint: str, foreground: bool, allow_other: bool, upstream: str | None,
          timeout: float) -> None:
    """Run the daemon and mount the store at MOUNTPOINT.

    Without --foreground it detaches once the mount is ready and says where it logs.

    Example: ksfs mount /mnt/ksfs && ls /mnt/ksfs/sessions
    """
    clear = f"`ksfs umount {mountpoint}` clears a ksfs mount whose daemon died"
    try:
        is_dir = stat.S_ISDIR(os.stat(mountpoint).st_mode)
    except FileNotFoundError:
        raise NoSuchFile(what="mount point", name=mountpoint) from None
    except OSError as exc:  # ENOTCONN: a FUSE mount whose server is gone
        raise BadInput(f"mount point {mountpoint} cannot be used ({exc.strerror}); {clear}"
                       ) from None
    if not is_dir:
        raise BadInput(f"mount point {mountpoint} is not a directory")
    there = _mount_type(mountpoint)
    # Busy, as mount(2)'s EBUSY and as a store already mounted elsewhere (QA: exit 2 here
    # and 8 there for one situation)
    if there == KSFS_FSTYPE:
        raise Busy(f"{mountpoint} is already a ksfs mount (`ksfs umount {mountpoint}` "
                   "unmounts it, also when its daemon died)")
    if there is not None:
        raise Busy(f"{mountpoint} is already a mount point (of {there}); mount elsewhere")
    store = Path(ctx.store_path)
    _refuse_overlap(store, Path(mountpoint))
    # Make (or check) the store before the daemon's log file lands in its directory.
    ctx.store(create=True)
    ctx.close()
    _warn_if_not_empty(mountpoint)  # (once nothing else refuses it: one line then)
    extra = (["--allow-other"] if allow_other else []) + (
        ["--upstream", upstream] if upstream else [])
    mountpoint = os.path.realpath(mountpoint)  # as the kernel's mount table will name it
    if foreground:
        from ksfs.daemon.run import main as daemon_cli

        sys.exit(daemon_cli([str(store), mountpoint, *extra]))
    log_path = store / "daemon.log"
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "ksfs.daemon.run", str(store), mountpoint, "--ready-fd",
           str(write_fd), *extra]
    with _open_log(store, log_path) as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    answer = _read_ready(read_fd, proc, timeout)
    if answer.startswith("ready"):
        click.echo(f"mounted {store} at {mountpoint} (pid {proc.pid}, log {log_path})")
        return
    if answer.startswith("error "):
        _, code, message = answer.split(" ", 2)
        click.echo(f"ksfs: error: {message.strip()}", err=True)
        sys.exit(int(code))
    raise DaemonError(f"the daemon did not mount {mountpoint}: {answer or 'it exited'}; "
                      f"see {log_path}")


def _open_log(store: Path, log_path: Path):
    """The daemon's log, to append to; never through a symbolic link (as root it would write
    into whatever file the link names), nor a directory, FIFO or hard link: damage, one line,
    exit 6."""
    from ksfs.errors import translate
    from ksfs.regularfile import open_store_file

    with translate("open the daemon's log", log_path):
        fd = open_store_file(log_path, store, os.O_WRONLY | os.O_APPEND, 0o600, "daemon log")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def _warn_if_not_empty(mountpoint: str) -> None:
    """Mounting over files hides them (and anyone reading them) until the unmount: said, not
    refused, as mount(8) does (QA: a non-empty mount point went unmentioned)."""
    try:
        with os.scandir(mountpoint) as it:
            held = next(it, None) is not None
    except OSError:
        return
    if held:
        click.echo(f"ksfs: warning: mount point {mountpoint} is not empty: what it holds is "
                   "hidden while the store is mounted there", err=True)


def _refuse_overlap(store: Path, mountpoint: Path) -> None:
    """The daemon reads and writes the store's files: mounted over them (or inside them), each
    of its own file operations would be a request to itself, and it would hang."""
    s, m = store.resolve(), mountpoint.resolve()
    if s == m or m in s.parents:
        raise BadInput(f"mount point {mountpoint} would hide the store {store} under the mount; "
                       "mount somewhere outside it")
    if s in m.parents:
        raise BadInput(f"mount point {mountpoint} is inside the store {store}; "
                       "mount somewhere outside it")


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                part = os.read(fd, 4096)
                if not part:
                    break
                buf += part
                if buf.endswith(b"\n"):
                    break
        else:
            proc.terminate()
            return f"no answer within {timeout:.0f}s"
    finally:
        os.close(fd)
    return buf.decode(errors="replace")


@main.command()
@click.argument("mountpoint")
@click.option("--timeout", type=SECONDS, default=60.0, show_default=True,
              help="Seconds to wait for the daemon to let go of the store; past them, exit 14.")
@pass_ctx
def umount(ctx, mountpoint: str, timeout: float) -> None:
    """Unmount MOUNTPOINT and wait for its daemon to finish.

    Exits 14 when the mount is gone but its daemon still holds the store after --timeout
    (it may be finishing a verb): it is named, and a new mount of the store waits for it.

    Example: ksfs umount /mnt/ksfs
    """
    there = _mount_type(mountpoint)
    if there is None:
        if not os.path.lexists(mountpoint):
            raise NoSuchFile(what="mount point", name=mountpoint)
        raise BadInput(f"{mountpoint} is not mounted")
    if there != KSFS_FSTYPE:
        # fusermount3 run by root unmounts whatever is there: never another filesystem.
        raise BadInput(f"{mountpoint} is not a ksfs mount (it is {there}): not unmounted")
    found, answered = _mounted_store(mountpoint)
    store = found or ctx.store_path
    real = os.path.realpath(mountpoint)
    # fusermount3 refuses a path whose last part is a symlink: the real one, as mounted
    res = subprocess.run(["fusermount3", "-u", real],
                         capture_output=True, text=True,
                         env=dict(os.environ, LC_ALL="C"))  # its strerror read below, in English
    if res.returncode != 0:
        if "busy" in res.stderr.lower():
            hint = ""
            if not answered:
                # (QA: nothing said how to get rid of a dead mount something still holds)
                hint = (f"; its daemon {'is gone' if answered is None else 'does not answer'}"
                        f", so `fusermount3 -uz {real}` detaches it now and the kernel lets it "
                        "go once the last of them does")
            raise Busy(f"{mountpoint} is in use (a process has a file open or its working "
                       "directory there, or is waiting on a verb it asked for there, such as a "
                       f"mkdir that saves): not unmounted{hint}")
        if os.geteuid() != 0 and ("not found in" in res.stderr or "permitted" in res.stderr):
            # fusermount3 names /etc/mtab for a mount of another user's (QA: exit 13)
            raise NotPermitted(f"{mountpoint} was mounted by another user: only that user or "
                               "root can unmount it")
        raise DaemonError(f"could not unmount {mountpoint}: {res.stderr.strip()}")
    if answered is False:
        # A daemon that does not answer (stopped, or stuck in a verb) is not waited for.
        click.echo(f"unmounted {mountpoint} (its daemon did not answer and may still run: "
                   f"see its log, daemon.log in the store)")
        return
    lock = Path(store) / "daemon.lock"
    if not _wait_for_release(lock, timeout):
        # QA: this said "unmounted" and exit 0 while the daemon still held the store
        from ksfs.daemon.client import daemon_pid

        pid = daemon_pid(store)
        who = f"its daemon (pid {pid})" if pid else "its daemon"
        raise DaemonTimeout(
            f"unmounted {mountpoint}, but {who} still holds the store {store} after "
            f"{timeout:g} s (it may be finishing a verb or a gateway call: see "
            f"{Path(store) / 'daemon.log'}); a new mount of the store is refused until it ends")
    click.echo(f"unmounted {mountpoint}")


def _wait_for_release(lock: Path, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the daemon's lock on its store to be let go;
    whether it was (no lock file: no daemon ever held it)."""
    import fcntl

    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
