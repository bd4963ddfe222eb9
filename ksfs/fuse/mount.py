"""Mount a keeper's tree with pyfuse3 and serve it in one trio run until unmounted.

``run_mount`` is what the CLI's ``ksfs mount`` calls; ``python -m ksfs.fuse.mount STORE MNT`` runs
it on a store directly (tests and the benchmark use that). This module never imports click or
libvirt, and never detaches: a caller that daemonizes must fork before opening the keeper (an
LMDB environment must not cross a fork) and use ``ready`` to tell its waiting parent.
"""

from __future__ import annotations

import argparse
import faulthandler
import fcntl
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ksfs.errors import Busy, DaemonError, NotPermitted
from ksfs.fuse import faults
from ksfs.fuse.forgetting import NameForgetter
from ksfs.fuse.ops import Operations
from ksfs.fuse.tree import CheckpointTree

log = logging.getLogger(__name__)

# The largest request the kernel takes (FUSE_MAX_MAX_PAGES = 256 pages); libfuse 3.14 negotiates
# max_pages from it. Readahead is raised on the mount's bdi to keep several such reads in flight.
MAX_READ = 1024 * 1024
READ_AHEAD_KB = 2048  # two 1 MiB requests in flight: the next one is queued while one is answered


def mount_options(allow_other: bool = False, debug: bool = False) -> set[str]:
    opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks mode bits
    # No max_read option: the kernel default is unlimited, and libfuse refuses one it did not
    # negotiate itself; requests are then bounded by max_pages (MAX_READ).
    # nodev, nosuid: a guest's device nodes and setuid files under fs/ are shown, never used.
    opts |= {"fsname=ksfs", "subtype=ksfs", "nodev", "nosuid"}
    if allow_other:
        opts.add("allow_other")
    if debug:
        opts.add("debug")
    return opts


def _mount_device(mountpoint: str) -> str | None:
    """The ``major:minor`` of our mount, from mountinfo (a stat would wait on our own server)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    escaped = (mountpoint.replace("\\", "\\134").replace(" ", "\\040")
               .replace("\t", "\\011").replace("\n", "\\012"))
    for line in reversed(lines):
        fields = line.split()
        fstype = line.partition(" - ")[2].split()[:1]
        if len(fields) > 4 and fields[4] == escaped and fstype == ["fuse.ksfs"]:
            return fields[2]
    return None


def raise_readahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> bool:
    """Raise the kernel readahead of the mount (root only; harmless to fail): large sequential
    reads of disk images then keep several requests in flight, decompressed on several threads."""
    dev = _mount_device(mountpoint)
    if dev is None:
        return False
    try:
        Path(f"/sys/class/bdi/{dev}/read_ahead_kb").write_text(str(kb))
        return True
    except OSError as exc:
        log.info("readahead left at the kernel default: %s", exc)
        return False


def is_mounted(mountpoint: str) -> bool:
    """Whether our mount is still in this process's mount table."""
    return _mount_device(mountpoint) is not None


async def _stop_when_unmounted(mountpoint: str, every: float = 1.0) -> None:
    """End the FUSE loop once the mount is gone from our namespace.

    Usually the kernel ends the connection on unmount and pyfuse3.main returns by itself. But
    libvirt starts each QEMU in a mount namespace of its own, copied from ours: a session made
    while mounted keeps a copy of the mount alive there, the connection stays open, and the
    loop would wait for ever after ``fusermount3 -u``.
    """
    while True:
        await trio.sleep(every)
        if not is_mounted(mountpoint):
            log.info("%s was unmounted; stopping", mountpoint)
            pyfuse3.terminate()
            return


def require_fuse_device(path: str = "/dev/fuse") -> None:
    """Refuse, saying why, a mount the kernel's FUSE device would refuse: libfuse says only
    "fuse_session_mount failed" (its reason goes to the daemon's log)."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        raise DaemonError(f"cannot mount: there is no {path} (load the fuse module: "
                          "modprobe fuse)") from None
    except PermissionError:
        raise NotPermitted(f"cannot mount: {path} is not open to this user (it needs read and "
                           "write access to it)") from None
    except OSError as exc:
        raise DaemonError(f"cannot mount: opening {path} failed: {exc.strerror}") from None


async def _trim_heap() -> None:
    """Now and then give freed heap back to the kernel (ksfs.heap: a daemon runs for days)."""
    from ksfs.heap import TRIM_EVERY, trim

    while True:
        await trio.sleep(TRIM_EVERY)
        await trio.to_thread.run_sync(trim)


async def _refresh_stored_blocks(tree: CheckpointTree, every: float = 1.0) -> None:
    """Tell the kernel to ask again for the attributes of stored files whenever what other
    checkpoints hold has changed: their st_blocks count the bytes no other checkpoint holds
    (keeper.exclusive_bytes), yet the kernel keeps their attributes for ever (they are the only
    attribute that moves, and the page cache is kept: size and mtime never change)."""
    seen = None
    failed = ""
    while True:
        await trio.sleep(every)
        try:
            version = await trio.to_thread.run_sync(tree.keeper.holdings_version)
            if version is None or version == seen:
                continue
            seen = version
            await trio.to_thread.run_sync(_invalidate_attrs, tree.stored_file_inodes())
            failed = ""
        except Exception as exc:  # a bug or a damaged store must not end the mount
            if repr(exc) != failed:  # once per distinct failure, not every second
                log.exception("refreshing the st_blocks of stored files failed")
            failed = repr(exc)


def _invalidate_attrs(inodes: list[int]) -> None:
    for ino in inodes:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError:
            pass  # the kernel has already forgotten it: nothing cached to drop


async def _stop_on_signals(stopping: trio.Event,
                           again: Callable[[], Awaitable[Any]] | None) -> None:
    """The first SIGTERM or SIGINT unmounts; one that comes while the stop is under way (its
    ``before_stop``: the gateway storing its purchases in flight) awaits ``again``, which stops
    at once. The receiver stays open until the mount ends: closed after the first signal, it
    gave the second back to the default handler, which killed the daemon in the middle of its
    stop (QA F12: its guests' answers were cut off with no error, their purchases left for the
    next start to count)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if not stopping.is_set():
                log.info("signal %d: unmounting", signum)
                stopping.set()
                pyfuse3.terminate()
            elif again is not None:
                log.info("signal %d again: stopping at once", signum)
                await again()
                again = None


async def _serve(
    mountpoint: str,
    ready: Callable[[], Any] | None,
    extra_tasks: Iterable[Callable[[], Awaitable[Any]]],
    before_stop: Callable[[], Awaitable[Any]] | None = None,
    stop_now: Callable[[], Awaitable[Any]] | None = None,
    services: Iterable[Callable[..., Awaitable[Any]]] = (),
) -> None:
    stopping = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, stopping, stop_now, name="signals")
        nursery.start_soon(_stop_when_unmounted, mountpoint, name="unmount-watch")
        for task in extra_tasks:
            nursery.start_soon(task, name=getattr(task, "__name__", repr(task)))
        # When the FUSE loop ends (unmounted, or terminate() on a signal) the other tasks stop.
        async def fuse_main() -> None:
            await pyfuse3.main()
            stopping.set()  # (a signal from now on is a second one: see _stop_on_signals)
            if before_stop is not None:
                await before_stop()  # the other tasks still run (the gateway's purchases)
            nursery.cancel_scope.cancel()

        nursery.start_soon(fuse_main, name="fuse")
        # A stat answered by our own loop proves the kernel's INIT is done; only then does a
        # readahead setting stick (INIT caps it at what it negotiated).
        # Abandoned on cancel: should another task fail first, the loop that would answer
        # this stat is cancelled too, and waiting for the thread would hang the daemon.
        await trio.to_thread.run_sync(os.stat, mountpoint, abandon_on_cancel=True)
        raise_readahead(mountpoint)
        # Ready means usable: a control socket started with start_soon bound its path on a
        # worker thread and listened a scheduling pass later, so a client told "ready" could
        # find no listener yet and take the daemon for absent (found in review).
        for service in services:
            await nursery.start(service)
        if ready is not None:
            ready()


def run_mount(
    keeper: Any,
    mountpoint: str | os.PathLike,
    foreground: bool = True,
    allow_other: bool = False,
    debug: bool = False,
    ready: Callable[[], Any] | None = None,
    extra_tasks: Iterable[Callable[[], Awaitable[Any]]] = (),
    tree: CheckpointTree | None = None,
    before_stop: Callable[[], Awaitable[Any]] | None = None,
    stop_now: Callable[[], Awaitable[Any]] | None = None,
    services: Iterable[Callable[..., Awaitable[Any]]] = (),
) -> None:
    """Mount ``keeper``'s tree on ``mountpoint`` and serve it until unmounted or signalled.

    ``ready`` is called once, when the mount is in place and each of ``services`` (tasks taking
    trio's ``task_status``) has said it started; ``services`` and ``extra_tasks`` run in the
    same trio nursery and are cancelled when the mount ends, after ``before_stop`` (awaited
    once the mount is gone) returns; ``stop_now`` is awaited on a signal that comes while
    ``before_stop`` runs, and should make it return at once. ``foreground`` is the caller's
    business (see the module docstring); it is accepted so the CLI can pass its flag through.
    """
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: dump every stack
    # Resolved: the kernel's mount table names the real path, and a mount point reached
    # through a symlink looked unmounted to the watcher a second later (QA).
    mnt = os.path.realpath(os.fspath(mountpoint))
    tree = tree or CheckpointTree(keeper, open_reader=faults.reader_from_env())
    ops = Operations(tree)

    async def refresh_stored_blocks() -> None:
        await _refresh_stored_blocks(tree)

    def forget_entry(session: str, checkpoint: str | None) -> None:
        # Names of sessions and checkpoints are cached by the kernel for a second
        # (nodes.SHORT): drop one at once when this process publishes or deletes a checkpoint
        # (checkpoint None: removes the session), so a name deleted and taken again never shows
        # the old one's files. On a thread of its own: callers may be inside a FUSE request
        # (ksfs/fuse/forgetting.py); the control socket waits for it after a verb.
        if checkpoint is None:
            parents, name = tree.known_inodes(("sessions",)), session
        else:
            parents, name = tree.known_inodes(("sessions", session, "checkpoints")), checkpoint
        for parent in parents:
            forgetter.forget(parent, os.fsencode(name))

    if not os.path.isdir(mnt):
        raise DaemonError(f"cannot mount on {mnt}: it is not a directory")
    require_fuse_device()
    try:
        pyfuse3.init(ops, mnt, mount_options(allow_other, debug))
    except RuntimeError as exc:  # libfuse says only that mounting failed; its reason is on stderr
        raise DaemonError(f"cannot mount on {mnt}: {exc}") from exc
    forgetter = NameForgetter()
    stop_listening = keeper.on_checkpoint_change(forget_entry, settle=forgetter.settle)
    try:
        trio.run(_serve, mnt, ready, [refresh_stored_blocks, _trim_heap, *extra_tasks],
                 before_stop, stop_now, services)
    finally:
        stop_listening()
        forgetter.close()  # its notifies need the FUSE session, which close destroys
        # Unmounted on a failure too: a mount whose daemon is gone answers every request with
        # ENOTCONN and stays in the way of the next mount (as root libfuse detaches it lazily).
        pyfuse3.close(unmount=is_mounted(mnt))


def acquire_daemon_lock(store_path: Path | str, mountpoint: str) -> int:
    """Hold the store's daemon lock for the life of this process, or raise Busy: one mount
    per store, whichever way it is started (`ksfs mount`, or this module run directly)."""
    from ksfs.regularfile import open_lock_file

    path = Path(store_path) / "daemon.lock"
    # never through a symlink: this truncates and writes the file (as root, whatever it named)
    fd = open_lock_file(path, store_path, os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        raise Busy(
            f"store {store_path} is already mounted at {holder.get('mountpoint', '?')} "
            f"by pid {holder.get('pid', '?')}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "mountpoint": mountpoint}).encode(), 0)
    return fd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ksfs.fuse.mount")
    parser.add_argument("store")
    parser.add_argument("mountpoint")
    parser.add_argument("--debug", action="store_true", help="log every FUSE request")
    parser.add_argument("--allow-other", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    from ksfs.heap import tune_for_bulk_reads

    tune_for_bulk_reads(long_running=True)  # every READ builds a 1 MiB reply: ksfs/heap.py
    from ksfs.keeper import Keeper

    try:
        acquire_daemon_lock(Path(args.store), os.path.realpath(args.mountpoint))
    except Busy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    with Keeper(args.store) as keeper:
        run_mount(
            keeper,
            args.mountpoint,
            allow_other=args.allow_other,
            debug=args.debug,
            ready=lambda: print(f"mounted {args.store} on {args.mountpoint}", flush=True),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
