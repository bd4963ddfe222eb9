"""One purchase in flight and how its buyer's guest gets the answer.

A ``Call`` is shared by every request for one key while its upstream call runs; a
``StreamThrough`` passes a streamed response to the guest that started the purchase as it arrives,
holding back its last chunk until the whole stream is committed. Nothing here touches the store
or the provider: it must never send a guest the end of a response that is not stored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ksfs.gateway.store import StoredResponse
from ksfs.gateway.upstream import (
    NOT_STORED,
    Headers,
    Reply,
    encode_headers,
    error_reply,
    keep_headers,
    send_reply,
)


@dataclass
class Call:
    """One upstream purchase in flight; every request for its key waits on ``done``.

    While it runs, ``status``/``headers``/``chunks`` show the response as it arrives, and
    ``changed`` is set (and replaced) on every step, for the one caller streaming it through.
    """

    digest: str = ""  # of the request that bought it: a duplicate must be the same request
    done: trio.Event = field(default_factory=trio.Event)
    stored: StoredResponse | None = None
    error: Reply | None = None
    status: int | None = None
    headers: Headers = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    # The provider's stream ended cleanly but was no whole answer (an error event, no end):
    # its last chunk is passed on before the gateway's error, as it is whole.
    ended_cleanly: bool = False
    # The gateway is stopping at once (a second signal): whoever is answering from this call
    # ends its answer now, with the gateway's error, rather than be cut off (Gateway.abort).
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        self.notify()

    async def settled(self) -> bool:
        """Wait until the call is done (True) or aborted (False)."""
        while not self.done.is_set() and not self.aborted:
            await self.changed.wait()
        return self.done.is_set()

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def on_start(self, status: int, headers: Headers) -> None:
        self.status, self.headers = status, headers
        self.notify()

    def on_chunk(self, chunk: bytes) -> None:
        if self.chunks and _trailing_only(chunk):
            # Blank lines or comments after an event (a keep-alive after [DONE]) stay with the
            # chunk before them, which is still withheld: the end of a stream is never sent
            # because some filler came after it.
            self.chunks[-1] += chunk
        else:
            self.chunks.append(chunk)
        self.notify()


def _trailing_only(chunk: bytes) -> bool:
    """Nothing but line ends and SSE comment lines (":" ...)."""
    return all(not line or line.startswith(b":") for line in chunk.splitlines())


@dataclass
class StreamThrough:
    """The buyer's own answer to a streamed call: passed on as it arrives, all but its last
    chunk, which is sent only once the whole stream is committed to the store. So a guest that
    saw the end of a stream can always have it replayed; a guest cut off earlier retries."""

    call: Call
    key: bytes
    # For a duplicate following the buyer's purchase: records it as a replay once stored.
    replayed: Callable[[StoredResponse], Awaitable[None]] | None = None

    async def send_to(self, send) -> None:
        call = self.call
        while call.status is None and not call.done.is_set():
            await call.changed.wait()
        sse = (header(call.headers, "content-type") or "").startswith("text/event-stream")
        if call.status is None or not 200 <= call.status < 300 or not sse:
            if not await call.settled():
                return await send_reply(send, stopped_reply(), ksfs_headers(self.key, "error"))
            if call.stored is not None:
                reply, replay = reply_of(call.stored), self._replay_header
                await self._record_replay()
            else:
                reply, replay = call.error or lost_reply(), "error"
            return await send_reply(send, reply, ksfs_headers(self.key, replay))
        headers = keep_headers(call.headers, NOT_STORED) + ksfs_headers(self.key,
                                                                         self._replay_header)
        await send({"type": "http.response.start", "status": call.status,
                    "headers": encode_headers(headers)})
        sent = 0
        try:
            while not call.done.is_set() and not call.aborted:
                changed = call.changed
                while sent < len(call.chunks) - 1:  # withhold the last chunk until stored
                    await send({"type": "http.response.body", "body": call.chunks[sent],
                                "more_body": True})
                    sent += 1
                if not call.done.is_set() and not call.aborted:
                    await changed.wait()
        except trio.Cancelled:
            # Stopped under us all the same: the error event, if the connection still takes
            # it, so the guest knows the stream was cut, not ended (QA F12).
            with trio.CancelScope(shield=True), trio.move_on_after(STOP_SEND_S):
                try:
                    await send({"type": "http.response.body", "more_body": False,
                                "body": _stop_event(call.chunks[:sent])})
                except Exception:  # noqa: BLE001 - the connection is going: nothing to add
                    pass
            raise
        if not call.done.is_set():
            # The gateway stops at once (a second signal): the stream ends with its error
            # event, not cut off mid-way with nothing said (QA F12). The withheld chunk is
            # not sent: it is not stored.
            await send({"type": "http.response.body", "more_body": False,
                        "body": _stop_event(call.chunks[:sent])})
            return
        done = b"".join(call.chunks[:sent])
        if call.stored is not None and call.stored.body.startswith(done):
            rest = call.stored.body[len(done):]
        else:
            # Headers are out, so the failure goes in the stream, as providers send theirs.
            tail = b"".join(call.chunks[sent:]) if call.ended_cleanly else b""
            if tail and not tail.endswith((b"\n\n", b"\r\n\r\n")):
                tail += b"\n\n"
            rest = tail + b"data: " + (call.error or lost_reply()).body + b"\n\n"
        await self._record_replay()  # before the end goes out: a guest that has it, counted
        await send({"type": "http.response.body", "body": rest, "more_body": False})

    @property
    def _replay_header(self) -> str:
        """``false`` for the buyer's own answer, ``true`` for a duplicate whose purchase is
        stored, and ``joined`` for one whose headers go out while the purchase is still in
        flight: it may yet fail, and a header cannot be taken back (QA: it said ``true``, a
        replay, of a purchase that then failed and bought nothing). Its end tells: the
        stream's own end once stored (then counted as a replay), or the gateway's error."""
        if self.replayed is None:
            return "false"
        return "true" if self.call.stored is not None else "joined"

    async def _record_replay(self) -> None:
        if self.replayed is not None and self.call.stored is not None:
            await self.replayed(self.call.stored)


def header(headers: Headers, name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def ksfs_headers(key: bytes, replay: str) -> Headers:
    return [("x-ksfs-key", key.hex()), ("x-ksfs-replay", replay)]


def reply_of(stored: StoredResponse) -> Reply:
    return Reply(stored.status, list(stored.headers), stored.body)


def lost_reply() -> Reply:
    return error_reply(500, "gateway_error", "the call ended without a response")


def stopped_reply() -> Reply:
    return error_reply(503, "gateway_stopping",
                       "the gateway stopped before the call completed; retry it")


STOP_SEND_S = 0.5  # how long a stream cut by a stop may take to be told so


def _stop_event(sent: list[bytes]) -> bytes:
    """The gateway's stop as a stream's last event, after a blank line when what was sent
    did not end with one (a piece may end mid-event)."""
    event = b"data: " + stopped_reply().body + b"\n\n"
    if sent and not sent[-1].endswith((b"\n\n", b"\r\n\r\n")):
        event = b"\n\n" + event
    return event
