"""The daemon's control socket server: a trio task answering the verbs of protocol.VERBS.

Each request runs its keeper method in a worker thread, so a long save on one session does not
hold up a verb on another; the keeper's own locks serialise verbs on one session. A request that
asks for progress gets ``{"progress": {"step", "done", "total"}}`` lines before its reply; one
that asks ``"alive": true`` gets ``{"alive": true}`` at once and every ALIVE_EVERY seconds while
its verb runs, so the caller tells a long verb from a stuck daemon.
Warnings a verb logs (a disk that names no root, a leftover removed) go to the daemon's log and
with its reply, as ``"warnings"``, so the command line that asked says them too.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import logging
import math
import os
import stat
from pathlib import Path
from typing import Any

import trio

from ksfs import progress
from ksfs.daemon.protocol import (
    check_verb,
    encode,
    error_reply,
    not_a_socket,
    to_jsonable,
    unix_address,
)
from ksfs.errors import BadInput, KsfsError, from_foreign

log = logging.getLogger("ksfs.daemon")

# The warnings of the verb this thread (or one it started with its context) runs.
_verb_warnings: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "verb_warnings", default=None)


class _WarningsToCaller(logging.Handler):
    """Keeps each warning logged inside a verb for the verb's reply."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        said = _verb_warnings.get()
        if said is not None and len(said) < MAX_WARNINGS:
            said.append(record.getMessage())


# A verb that warns in a loop says the first ones; the rest are in the daemon's log.
MAX_WARNINGS = 20
_to_caller = _WarningsToCaller()


async def serve_control(keeper: Any, path: Path, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on ``path`` until cancelled; the socket file is removed on the way out."""
    path = Path(path)
    _clear_socket_path(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    with unix_address(path) as address:
        await sock.bind(address)
    os.chmod(path, 0o600)  # only the mounting user drives the daemon
    if _to_caller not in logging.getLogger().handlers:
        logging.getLogger().addHandler(_to_caller)
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


def _clear_socket_path(path: Path) -> None:
    """Remove what a daemon before this one left at ``path`` (this one holds the daemon lock):
    a socket, or a link (only the link goes, never what it names; a dangling one made the
    bind fail, "Address already in use"). Anything else there is damage, not removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
        path.unlink()
        return
    raise not_a_socket(path, st.st_mode)


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
        replies: list[dict[str, Any]] = []
        wants = _wants(buf)
        try:
            if not wants:
                replies.append(await trio.to_thread.run_sync(_dispatch, keeper, buf))
            else:
                send, receive = trio.open_memory_channel(math.inf)
                sink = (_ProgressSink(send, trio.lowlevel.current_trio_token())
                        if "progress" in wants else None)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_forward_lines, receive, stream, "alive" in wants)
                    try:
                        replies.append(
                            await trio.to_thread.run_sync(_dispatch, keeper, buf, sink))
                    finally:
                        send.close()
        finally:
            # The verb's thread is never abandoned, so a verb the daemon finished while it was
            # told to stop (an unmount during a restore) still says so, shielded: else its
            # caller would report a failure that did not happen.
            if replies:
                with trio.CancelScope(shield=True), trio.move_on_after(REPLY_TIMEOUT):
                    try:
                        await stream.send_all(encode(replies[0]))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass


# How long a reply may take to reach a caller that stopped reading.
REPLY_TIMEOUT = 10
# At most this many progress lines a second, besides every change of step.
PROGRESS_RATE = 10
# A caller that asks "alive" hears from the daemon at least this often while its verb runs:
# well inside client.NOTICE_AFTER, the silence after which a caller says it is waiting (at 5 s,
# every verb of over 2 s, a save of a big machine, printed that warning on success).
ALIVE_EVERY = 0.5


class _ProgressSink:
    """Progress from the verb's threads, handed to the connection's task on the trio loop."""

    def __init__(self, send: trio.MemorySendChannel, token: trio.lowlevel.TrioToken) -> None:
        self.send = send
        self.token = token
        self.throttle = progress.Throttle(1 / PROGRESS_RATE)

    def __call__(self, step: str, done: int | None, total: int | None) -> None:
        if not self.throttle.due(step):
            return
        self.token.run_sync_soon(self._put, {"step": step, "done": done, "total": total})

    def _put(self, item: dict[str, Any]) -> None:
        try:
            self.send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the verb is over: a late step is of no use


async def _forward_lines(receive: trio.MemoryReceiveChannel, stream: trio.abc.Stream,
                         alive: bool) -> None:
    """The lines before a reply, one writer for the stream: the verb's progress steps and, for
    a caller that asked ``alive``, ``{"alive": true}`` at once and every ALIVE_EVERY seconds
    without a step, so it tells a long verb from a stuck daemon (client.call_daemon)."""
    item: dict[str, Any] | None = {"alive": True} if alive else None
    while True:
        if item is not None:
            try:
                await stream.send_all(encode(item))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the caller went away; the verb runs on
        item = {"alive": True} if alive else None
        with trio.move_on_after(ALIVE_EVERY if alive else math.inf):
            try:
                item = {"progress": await receive.receive()}
            except trio.EndOfChannel:
                return


def _wants(raw: bytes) -> set[str]:
    """Which of "progress" and "alive" the request asks for (``true`` in its object)."""
    try:
        request = json.loads(raw)
    except ValueError:
        return set()
    if not isinstance(request, dict):
        return set()
    return {k for k in ("progress", "alive") if request.get(k) is True}


def _dispatch(keeper: Any, raw: bytes, sink: progress.Sink | None = None) -> dict[str, Any]:
    said: list[str] = []
    token = _verb_warnings.set(said)
    try:
        with progress.reporting(sink):
            reply = _dispatch_verb(keeper, raw)
        # the names the verb published or deleted are gone from the kernel's cache before it
        # answers: `ksfs rm` and then `ls` never shows the old name
        keeper.settle_checkpoint_changes()
    finally:
        _verb_warnings.reset(token)
    if said:
        reply["warnings"] = said
    return reply


def _dispatch_verb(keeper: Any, raw: bytes) -> dict[str, Any]:
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
        try:
            # Checked apart from the call: a TypeError raised inside a verb is a bug, not
            # the caller's arguments.
            inspect.signature(method).bind(**args)
        except TypeError as exc:
            raise BadInput(
                f"the running daemon (pid {os.getpid()}) does not take "
                f"these arguments for {verb}: {exc}; a ksfs installed since the mount started "
                "needs `ksfs umount` and `ksfs mount` again") from None
        return {"ok": True, "result": to_jsonable(method(**args))}
    except KsfsError as exc:
        return error_reply(exc)
    except Exception as exc:
        known = from_foreign(exc, keeper.store_path)  # a damaged index, a full disk, ...
        if known is not None:
            return error_reply(known)
        log.exception("control verb failed")  # a bug: log it, answer, keep serving
        return error_reply(KsfsError(f"internal error: {type(exc).__name__}: {exc}"))
