"""Reach the running mount daemon through its control socket (plain sockets, no trio).

``call_daemon`` returns ``NO_DAEMON`` when no daemon listens, so the caller does the work itself
under the same locks; a daemon that answers with an error raises it as a KsfsError with the same
exit code.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ksfs.daemon.protocol import (
    READING_VERBS,
    SOCKET_NAME,
    RemoteError,
    check_verb,
    encode,
    unix_address,
)
from ksfs.errors import DaemonError, DaemonTimeout

NO_DAEMON = object()
log = logging.getLogger("ksfs.daemon")

# A daemon asked with "alive" says so at once and every server.ALIVE_EVERY seconds while the
# verb runs, so silence means its loop is stuck or stopped, not that the verb is long (a save
# of a big machine takes minutes). Silent this long: said on stderr, once; this long: given up.
NOTICE_AFTER = 2.0
SILENCE_MAX = 30.0


def socket_path(store_path: str | Path) -> Path:
    return Path(store_path) / SOCKET_NAME


def daemon_pid(store_path: str | Path) -> int | None:
    """The pid the store's daemon wrote into its lock file (``daemon.lock``), if it says one."""
    try:
        pid = json.loads((Path(store_path) / "daemon.lock").read_bytes()[:4096]).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None


class _Silent(Exception):
    pass


def call_daemon(store_path: str | Path, verb: str, timeout: float = 600.0,
                progress: Callable[[str, int | None, int | None], None] | None = None,
                **args: Any) -> Any:
    """Run ``verb`` in the daemon of ``store_path``; NO_DAEMON when there is none.

    The daemon says it is alive while the verb runs: after NOTICE_AFTER seconds without a word
    from it, stderr says that this waits for it (once); after ``timeout`` seconds (at most
    SILENCE_MAX), DaemonTimeout (exit 14). With ``progress``, the daemon's progress lines for
    the verb are handed to it as they come."""
    check_verb(verb)
    path = socket_path(store_path)
    if not path.exists():
        return NO_DAEMON
    limit = min(timeout, SILENCE_MAX)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(limit)
    begun = False  # the daemon took the request: it runs the verb whatever this side does
    try:
        try:
            with unix_address(path) as address:
                sock.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            return NO_DAEMON  # a stale socket of a daemon that died: work locally
        request: dict[str, Any] = {"verb": verb, "args": args, "alive": True}
        if progress is not None:
            request["progress"] = True
        sock.sendall(encode(request))

        def notice() -> None:
            pid = daemon_pid(store_path)
            log.warning("waiting for the daemon%s to answer %s (nothing from it for %g s) ...",
                        f" (pid {pid})" if pid else "", verb.replace("_", " "), NOTICE_AFTER)

        def heard() -> None:
            nonlocal begun
            begun = True

        try:
            reply = _read_reply(sock, progress, limit, notice, heard)
        except KeyboardInterrupt:
            # QA: Ctrl-C or SIGTERM here said "terminated" while the daemon, which has no
            # way to be called back, went on and finished the verb (a whole restore).
            if verb not in READING_VERBS:
                log.warning("the mount daemon finishes the %s it had begun; this command only "
                            "stops waiting for it", verb.replace("_", " "))
            raise
    except (TimeoutError, _Silent):
        pid = daemon_pid(store_path)
        who = f"the daemon (pid {pid})" if pid else "the daemon"
        what = verb.replace("_", " ")
        more = "" if verb in READING_VERBS else (
            f"; it may still finish the {what} it had begun" if begun else
            f"; the {what} was sent, and a daemon that comes back may still run it")
        dump = f" (`kill -USR1 {pid}` writes its threads' stacks to its log)" if pid else ""
        raise DaemonTimeout(
            f"{who} of {store_path} said nothing for {limit:g} s when asked to "
            f"{what}: it is stuck or stopped{dump}; see "
            f"{Path(store_path) / 'daemon.log'}{more}") from None
    finally:
        sock.close()
    for said in reply.get("warnings") or ():  # logged here as the verb logged them there
        log.warning("%s", said)
    if not reply.get("ok"):
        raise RemoteError(reply)
    return reply.get("result")


def _read_reply(sock: socket.socket, progress: Callable[..., None] | None, limit: float,
                notice: Callable[[], None], heard: Callable[[], None]) -> dict[str, Any]:
    """The verb's reply line, handing progress lines before it to ``progress`` and skipping
    the daemon's "alive" lines. ``notice()`` once after NOTICE_AFTER seconds of silence;
    _Silent after ``limit`` seconds of it."""
    buf = b""
    last = time.monotonic()
    noticed = limit <= NOTICE_AFTER  # a caller's short wait (a courtesy call) says nothing
    while True:
        while b"\n" not in buf:
            silent = time.monotonic() - last
            if silent >= limit:
                raise _Silent
            until = limit if noticed else NOTICE_AFTER
            sock.settimeout(max(until - silent, 0.01))
            try:
                part = sock.recv(65536)
            except TimeoutError:
                if not noticed and time.monotonic() - last >= NOTICE_AFTER:
                    noticed = True
                    notice()
                continue
            if not part:
                raise DaemonError("the daemon closed the control socket without answering")
            buf += part
            last = time.monotonic()
            heard()
        line, _, buf = buf.partition(b"\n")
        message = json.loads(line)
        if "alive" in message:
            continue
        if "progress" not in message:
            return message
        if progress is not None:
            step = message["progress"]
            progress(step.get("step", ""), step.get("done"), step.get("total"))
