"""Reach the running mount daemon through its control socket (plain sockets, no trio).

``call_daemon`` returns ``NO_DAEMON`` when no daemon listens, so the caller does the work itself
under the same locks; a daemon that answers with an error raises it as a KsfsError with the same
exit code.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from ksfs.daemon.protocol import SOCKET_NAME, RemoteError, check_verb, encode
from ksfs.errors import DaemonError

NO_DAEMON = object()


def socket_path(store_path: str | Path) -> Path:
    return Path(store_path) / SOCKET_NAME


def call_daemon(store_path: str | Path, verb: str, timeout: float = 600.0, **args: Any) -> Any:
    """Run ``verb`` in the daemon of ``store_path``; NO_DAEMON when there is none."""
    check_verb(verb)
    path = socket_path(store_path)
    if not path.exists():
        return NO_DAEMON
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return NO_DAEMON  # a stale socket of a daemon that died: work locally
        sock.sendall(encode({"verb": verb, "args": args}))
        buf = b""
        while not buf.endswith(b"\n"):
            part = sock.recv(65536)
            if not part:
                raise DaemonError("the daemon closed the control socket without answering")
            buf += part
    except TimeoutError:
        raise DaemonError(f"the daemon did not answer {verb!r} within {timeout:.0f}s") from None
    finally:
        sock.close()
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise RemoteError(reply)
    return reply.get("result")
