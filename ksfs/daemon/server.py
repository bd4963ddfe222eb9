"""The daemon's control socket server: a trio task answering the verbs of protocol.VERBS.

Each request runs its keeper method in a worker thread, so a long save on one session does not
hold up a verb on another; the keeper's own locks serialise verbs on one session.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import trio

from ksfs.daemon.protocol import check_verb, encode, error_reply, to_jsonable
from ksfs.errors import BadInput, KsfsError, from_foreign

log = logging.getLogger("ksfs.daemon")


async def serve_control(keeper: Any, path: Path, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``path`` until cancelled; the socket file is removed on the way out."""
    path = Path(path)
    if path.exists():
        path.unlink()
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o600)  # only the mounting user drives the daemon
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        await trio.serve_listeners(lambda stream: _handle(keeper, stream), [listener])
    finally:
        with trio.CancelScope(shield=True):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


async def _handle(keeper: Any, stream: trio.abc.Stream) -> None:
    async with stream:
        buf = b""
        while not buf.endswith(b"\n"):
            part = await stream.receive_some(65536)
            if not part:
                return
            buf += part
            if len(buf) > 1 << 20:
                return
        reply = await trio.to_thread.run_sync(_dispatch, keeper, buf)
        try:
            await stream.send_all(encode(reply))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _dispatch(keeper: Any, raw: bytes) -> dict[str, Any]:
    try:
        try:
            request = json.loads(raw)
            verb, args = request["verb"], request.get("args") or {}
            if not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise BadInput(
                "the control request is not valid JSON of the form {verb, args}"
            ) from None
        method = getattr(keeper, check_verb(verb))
        return {"ok": True, "result": to_jsonable(method(**args))}
    except KsfsError as exc:
        return error_reply(exc)
    except TypeError as exc:
        return error_reply(BadInput(f"bad arguments: {exc}"))
    except Exception as exc:
        known = from_foreign(exc, keeper.store_path)  # a damaged index, a full disk, ...
        if known is not None:
            return error_reply(known)
        log.exception("control verb failed")  # a bug: log it, answer, keep serving
        return error_reply(KsfsError(f"internal error: {type(exc).__name__}: {exc}"))
