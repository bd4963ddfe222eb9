"""The control socket's wire format and the verbs it serves.

One JSON object per line each way: ``{"verb": "save", "args": {...}}`` answered by
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "NoSuchSession", "message": "...",
"exit_code": 3, "errno": 2}``. Results are JSON-able (records are sent as their ``to_dict``).
Only the verbs listed here can be called: the socket is no general RPC into the keeper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ksfs.errors import BadInput, KsfsError, StoreDamaged
from ksfs.regularfile import file_kind

SOCKET_NAME = "daemon.sock"
SUN_PATH_MAX = 107  # bytes of a Unix socket's path, less its NUL (sockaddr_un.sun_path)


def not_a_socket(path: Path, mode: int) -> StoreDamaged:
    """The damage of something other than a socket at the control socket's ``path`` (in the
    store's own directory), for the client that would connect to it and the daemon that
    would bind there alike."""
    kind = file_kind(mode, "a regular file" if stat.S_ISREG(mode) else "not a socket")
    return StoreDamaged(path=path.parent, why=f"its control socket {path} is {kind}: remove it "
                        "(ksfs makes it again)")


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An address to bind or connect ``path`` by: the path itself, or for one too long for a
    Unix socket, the same file reached through /proc/self/fd of its directory (QA, fifteenth
    session: a store path over ~95 characters failed after its FUSE mount was up)."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)

# verb name -> keeper method name
VERBS = {
    "ping": "ping",
    "session_new": "new_session",
    "session_adopt": "adopt_session",
    "session_rm": "remove_session",
    "session_list": "list_sessions",
    "status": "status",
    "save": "save",
    "restore": "restore",
    "fork": "fork",
    "pause": "pause",
    "resume": "resume",
    "import": "import_files",
    "rm": "delete_checkpoint",
    "gc": "gc",
    "budget": "set_budget",
    "recover": "recover",
    "checkpoint_changed": "checkpoint_changed",
}

# Verbs that change nothing: a caller that stops waiting for one leaves nothing going on.
READING_VERBS = frozenset({"ping", "session_list", "status"})


def to_jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, sort_keys=True) + "\n").encode()


def error_reply(exc: KsfsError) -> dict[str, Any]:
    return {
        "ok": False,
        "error": type(exc).__name__,
        "message": str(exc),
        "exit_code": exc.exit_code,
        "errno": exc.errno,
    }


class RemoteError(KsfsError):
    """{message}"""

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(reply.get("message", "the daemon failed"))
        self.exit_code = int(reply.get("exit_code", 1))
        self.errno = int(reply.get("errno", 5))
        self.remote_class = reply.get("error", "KsfsError")


def check_verb(verb: str) -> str:
    if verb not in VERBS:
        raise BadInput(f"the daemon has no verb {verb!r}")
    return VERBS[verb]
