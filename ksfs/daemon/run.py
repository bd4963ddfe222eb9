"""The mount daemon process: one keeper, the FUSE mount, the control socket and the gateway.

Run as ``python -m ksfs.daemon.run STORE MNT [--allow-other] [--ready-fd N]``; ``ksfs mount``
starts it (detached unless --foreground). One daemon per store: a second one is refused while the
first holds ``STORE/daemon.lock``. At start it runs the keeper's recovery, so a daemon that died
mid-verb leaves nothing half done.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path

from ksfs.errors import Busy, DaemonError, KsfsError
from ksfs.regularfile import read_store_file

log = logging.getLogger("ksfs.daemon")


def upstream_url(store_path: Path, given: str | None) -> str | None:
    """The model provider the gateway fronts: --upstream, $KSFS_UPSTREAM, or config.json."""
    if given:
        return given
    if os.environ.get("KSFS_UPSTREAM"):
        return os.environ["KSFS_UPSTREAM"]
    try:
        settings = json.loads(read_store_file(store_path / "config.json", store_path))
    except (FileNotFoundError, ValueError):
        return None
    return settings.get("upstream") if isinstance(settings, dict) else None


def daemon_main(store: str, mountpoint: str, allow_other: bool = False,
                ready_fd: int | None = None, upstream: str | None = None) -> int:
    from ksfs.daemon.server import serve_control
    from ksfs.fuse.mount import acquire_daemon_lock, run_mount
    from ksfs.keeper import Keeper

    store_path = Path(store)
    keeper = None
    mounted = False
    try:
        keeper = Keeper(store_path, create=True)
        acquire_daemon_lock(store_path, os.path.realpath(mountpoint))
        recover = getattr(keeper, "recover", None)
        if recover is not None:
            try:
                recover()
            except KsfsError as exc:
                log.error("recovery at start failed: %s", exc)
        control = functools.partial(serve_control, keeper, store_path / "daemon.sock")
        services = [control]
        url = upstream_url(store_path, upstream)
        if url:
            from ksfs.daemon.gateways import GatewaySupervisor
            from ksfs.gateway import Gateway

            keeper.gateway = Gateway(keeper.store, keeper.ledger, url)
            # A service: the mount is ready once every machine session's gateway listens.
            supervisor = GatewaySupervisor(keeper, keeper.gateway)
            keeper.gateway_watcher = supervisor.listening_now
            services.append(supervisor.run)
            log.info("gateway in front of %s", url)

        def ready() -> None:
            nonlocal mounted
            mounted = True
            log.info("mounted %s at %s", store_path, mountpoint)
            if ready_fd is not None:
                os.write(ready_fd, b"ready\n")
                os.close(ready_fd)

        import trio

        draining = trio.CancelScope()  # what a signal during the drain cancels

        async def drain_gateway() -> None:
            # Unmounted or signalled: purchases in flight are stored (and their answers
            # written) before the servers stop, as `ksfs gateway serve` does on SIGTERM (QA: an
            # umount dropped them, and the guest's retry bought them again).
            gw = keeper.gateway
            if gw is None:
                return
            if gw.inflight_count():
                log.info("stopping: waiting up to %g s for %d gateway call(s) in flight",
                         gw.stop_wait, gw.inflight_count())
            with draining:
                await gw.drain(gw.stop_wait)

        async def stop_gateway_now() -> None:
            # A signal while draining: every answer still waiting ends with the gateway's
            # error, as a second signal does to `ksfs gateway serve` (QA F12).
            gw = keeper.gateway
            if gw is not None:
                await gw.stop_now()
            draining.cancel()

        try:
            run_mount(keeper, mountpoint, foreground=True, allow_other=allow_other, ready=ready,
                      before_stop=drain_gateway, stop_now=stop_gateway_now,
                      services=services)
        except BaseExceptionGroup as group:  # a task of the mount's nursery failed
            raise _first_failure(group) from group
        except Exception as exc:
            if isinstance(exc, KsfsError):
                raise
            # Said in the log and to the waiting `ksfs mount` (QA, fifteenth session: a
            # control socket that could not be bound ended the daemon with an empty log).
            log.exception("the daemon failed")
            raise DaemonError(f"the daemon failed: {exc}") from exc
    except KsfsError as exc:
        if ready_fd is None and not mounted:
            # `ksfs mount --foreground` refused before mounting: one line, as every command
            print(f"ksfs: error: {exc}", file=sys.stderr, flush=True)
        elif mounted or not isinstance(exc, Busy):
            # (a second mount refused is said by `ksfs mount`; its stderr is the log of the
            # daemon that holds the store, which has nothing to do with it)
            log.error("%s", exc)
        if ready_fd is not None:
            try:
                os.write(ready_fd, f"error {exc.exit_code} {exc}\n".encode())
            except OSError:
                pass
        return exc.exit_code
    finally:
        if keeper is not None:
            keeper.close()
    return 0


def _first_failure(group: BaseExceptionGroup) -> BaseException:
    """The error to report of a failed nursery: its first KsfsError, else a DaemonError of its
    first exception; a cancellation or interrupt is passed on as it is."""
    flat: list[BaseException] = []

    def walk(g: BaseExceptionGroup) -> None:
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            else:
                flat.append(e)

    walk(group)
    for e in flat:
        if isinstance(e, Exception) and not isinstance(e, KsfsError):
            log.error("a task of the daemon failed", exc_info=e)  # a bug: its traceback
    for e in flat:
        if isinstance(e, KsfsError):
            return e
    for e in flat:
        if not isinstance(e, Exception):
            return e  # KeyboardInterrupt, SystemExit
    return DaemonError(f"the daemon failed: {flat[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ksfs-daemon")
    parser.add_argument("store")
    parser.add_argument("mountpoint")
    parser.add_argument("--allow-other", action="store_true")
    parser.add_argument("--ready-fd", type=int)
    parser.add_argument("--upstream")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, force=True,  # over the CLI's (--foreground)
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from ksfs.heap import tune_for_bulk_reads

    tune_for_bulk_reads(long_running=True)  # every READ builds a 1 MiB reply: ksfs/heap.py
    os.umask(os.umask(0o022) | 0o022)  # as the CLI's keep_others_from_writing
    return daemon_main(args.store, args.mountpoint, args.allow_other, args.ready_fd,
                       args.upstream)


if __name__ == "__main__":
    sys.exit(main())
