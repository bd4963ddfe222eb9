"""Reach the running mount daemon through its control socket (plain sockets, no trio).

``call_daemon`` returns ``NO_DAEMON`` when no daemon listens, so the caller does the work itself
under the same locks; a daemon that answers with an error raises it as a KsfsError with the same
exit code.
"""

from __future__ import annotations

import json
import logging
import socket
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
from ksfs.errors import DaemonError

NO_DAEMON = object()
log = logging.getLogger("ksfs.daemon")


def socket_path(store_path: str | Path) -> Path:
    return Path(store_path) / SOCKET_NAME


def call_daemon(store_path: str | Path, verb: str, timeout: float = 600.0,
                progress: Callable[[str, int | None, int | None], None] | None = None,
                **args: Any) -> Any:
    """Run ``verb`` in the daemon of ``store_path``; NO_DAEMON when there is none.

    With ``progress``, the daemon's progress lines for the verb are handed to it as they come
    (``timeout`` then bounds the wait for each line, not the whole verb)."""
    check_verb(verb)
    path = socket_path(store_path)
    if not path.exists():
        return NO_DAEMON
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            with unix_address(path) as address:
                sock.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            return NO_DAEMON  # a stale socket of a daemon that died: work locally
        request: dict[str, Any] = {"verb": verb, "args": args}
        if progress is not None:
            request["progress"] = True
        sock.sendall(encode(request))
        try:
            reply = _read_reply(sock, progress)
        except KeyboardInterrupt:
            # QA: Ctrl-C or SIGTERM here said "terminated" while the daemon, which has no
            # way to be called back, went on and finished the verb (a whole restore).
            if verb not in READING_VERBS:
                log.warning("the mount daemon finishes the %s it had begun; this command only "
                            "stops waiting for it", verb.replace("_", " "))
            raise
    except TimeoutError:
        raise DaemonError(f"the daemon did not answer {verb!r} within {timeout:.0f}s") from None
    finally:
        sock.close()
    for said in reply.get("warnings") or ():  # logged here as the verb logged them there
        log.warning("%s", said)
    if not reply.get("ok"):
        raise RemoteError(reply)
    return reply.get("result")


def _read_reply(sock: socket.socket, progress: Callable[..., None] | None) -> dict[str, Any]:
    """The verb's reply line, handing progress lines before it to ``progress``."""
    buf = b""
    while True:
        while b"\n" not in buf:
            part = sock.recv(65536)
            if not part:
                raise DaemonError("the daemon closed the control socket without answering")
            buf += part
        line, _, buf = buf.partition(b"\n")
        message = json.loads(line)
        if "progress" not in message:
            return message
        if progress is not None:
            step = message["progress"]
            progress(step.get("step", ""), step.get("done"), step.get("total"))
