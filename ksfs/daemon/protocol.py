"""The control socket's wire format and the verbs it serves.

One JSON object per line each way: ``{"verb": "save", "args": {...}}`` answered by
``{"ok": true, "result": ...}`` or ``{"ok": false, "error": "NoSuchSession", "message": "...",
"exit_code": 3, "errno": 2}``. Results are JSON-able (records are sent as their ``to_dict``).
Only the verbs listed here can be called: the socket is no general RPC into the keeper.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ksfs.errors import BadInput, KsfsError

SOCKET_NAME = "daemon.sock"

# verb name -> keeper method name
VERBS = {
    "ping": "ping",
    "session_new": "new_session",
    "session_adopt": "adopt_session",
    "session_rm": "remove_session",
    "session_list": "list_sessions",
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
