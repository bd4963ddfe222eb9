"""The raw ASGI app of one session's server: routes every call that can cost money to the
gateway and passes the rest (bodyless GETs and the like, e.g. ``GET /v1/models``) through to the
provider.

Kept apart from the service so the HTTP plumbing (lifespan, body limits, status mapping) reads on
its own. It never decides anything about replay or money, only which requests are paid:
``Gateway.paid_call`` does the rest.
"""

from __future__ import annotations

import hmac
from typing import Any

import trio

from ksfs.errors import BadInput, KsfsError, NotFound, ReadOnly
from ksfs.gateway.calls import CHAT_PATH
from ksfs.gateway.inflight import StreamThrough
from ksfs.gateway.upstream import Reply, error_reply, send_reply

__all__ = ["CHAT_PATH", "asgi_app", "is_paid"]


def is_paid(method: str, body: bytes) -> bool:
    """Whether a request may cost money, so must pass the budget and be counted.

    Every POST, and anything else that carries a body: which endpoints bill is the provider's
    choice and changes over time (chat, embeddings, responses, images, audio, ...), so a list of
    paid paths would let each new one bypass the budget. A bodyless GET/HEAD/DELETE (a model list,
    a file's metadata) is passed through unchecked.
    """
    return method == "POST" or bool(body)


async def asgi_app(gw: Any, served: Any, scope: dict, receive, send) -> None:
    """The app; hypercorn gets it with ``gw`` and ``served`` bound by functools.partial."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if gw.open_requests >= gw.max_connections:
        # (QA F4: idle or slow clients held a connection each, without end, until the file
        # descriptors ran out) Said at once, the body unread: the connection then closes.
        await send_reply(send, error_reply(
            503, "too_many_connections",
            f"this gateway is answering {gw.open_requests} requests, its limit "
            f"({gw.max_connections}); retry shortly"))
        return
    mine = gw.open_by_session.get(served.session, 0)
    if mine >= gw.session_connections():
        # One session's guest may not take every connection: the others keep a share
        # (review: four slow bodies of one session made every other session's call a 503).
        await send_reply(send, error_reply(
            503, "too_many_connections",
            f"session {served.session!r} has {mine} requests open on this gateway, its share "
            f"({gw.session_connections()} of {gw.max_connections}); retry shortly"))
        return
    gw.open_requests += 1
    gw.open_by_session[served.session] = mine + 1
    try:
        await _answer(gw, served, scope, receive, send)
    finally:
        gw.open_requests -= 1
        left = gw.open_by_session[served.session] - 1
        if left:
            gw.open_by_session[served.session] = left
        else:
            del gw.open_by_session[served.session]


async def _answer(gw: Any, served: Any, scope: dict, receive, send) -> None:
    headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
    if served.token is not None and not _token_ok(headers, served.token):
        await send_reply(send, error_reply(
            401, "invalid_api_key",
            f"this gateway serves session {served.session!r}; give its token as the API key"))
        return
    # (QA F4: a client that never finished its body held its connection for ever) A body may
    # go read_timeout without a byte (review: a bound on the whole body cut a steady slow
    # upload, 16 MiB needed 280 KB/s), and take as long as the body limit needs at
    # MIN_BODY_RATE in all, so that a trickle of a byte now and then still ends.
    whole = body_deadline(gw.read_timeout, gw.max_body)
    try:
        with trio.fail_after(whole):
            body = await read_body(receive, gw.max_body, gw.read_timeout)
    except ClientGone:
        return  # a body cut short is no request: nothing is sent upstream or bought
    except (trio.TooSlowError, Stalled) as exc:
        await send_reply(send, error_reply(
            408, "request_timeout",
            f"no byte of the request body arrived for {gw.read_timeout:g} s"
            if isinstance(exc, Stalled) else
            f"the request body did not arrive whole within {whole:g} s"))
        return
    if body is None:
        await send_reply(send, error_reply(413, "request_too_large",
                                           f"request body over {gw.max_body} bytes"))
        return
    method, path = scope["method"], scope["path"]
    wire = wire_path(scope)
    if wire is None:
        # Appended to the provider's URL, a target such as "0:8080/v1/..." or ".evil.example/"
        # would send the call, with the API key, to another host.
        await send_reply(send, error_reply(
            400, "invalid_request_error",
            "the request target must be a plain path that starts with '/' (no absolute URL, "
            "authority, control characters, or '.', '..' or empty segments)"))
        return
    if is_paid(method, body) and wire.endswith("/"):
        # /v1/chat/completions/ is a chat completion at many a provider, but not here: its
        # usage would not be asked for, nor its stream's end required (QA F9: it went
        # through unmetered). Refused rather than guessed at, as dot segments are.
        await send_reply(send, error_reply(
            400, "invalid_request_error",
            "a paid call's path must not end in '/' (e.g. /v1/chat/completions, not "
            "/v1/chat/completions/)"))
        return
    if is_paid(method, body):
        gw.answering += 1  # a stop waits for this answer to be written (Gateway.drain)
        try:
            gone = trio.Event()  # the guest hung up: a call held back is then not bought
            try:
                async with trio.open_nursery() as watch:
                    watch.start_soon(_watch_hangup, receive, gone)
                    try:
                        answer, extra = await gw.paid_call(
                            served, method, path, scope.get("query_string", b""), headers,
                            body, wire=wire, gone=gone)
                    finally:
                        watch.cancel_scope.cancel()
            except KsfsError as exc:
                answer, extra = ksfs_error_reply(exc), []
            if gone.is_set() and not isinstance(answer, StreamThrough) \
                    and answer.status == 499:
                return  # nobody to answer
            if isinstance(answer, StreamThrough):
                await answer.send_to(send)
            else:
                await send_reply(send, answer, extra)
        finally:
            gw.answering -= 1
        return
    await served.upstream.passthrough(method, wire, scope.get("query_string", b""), headers,
                                      body, send)


async def _watch_hangup(receive, gone: trio.Event) -> None:
    """Set ``gone`` when the client disconnects (the body is read whole: what comes next on
    ``receive`` is only the disconnect)."""
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            gone.set()
            return


def wire_path(scope: dict) -> str | None:
    """The path as the guest sent it (still percent-encoded, so ``a%2Fb`` stays one segment),
    or None when it is not a plain origin-form path."""
    raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    if not raw.startswith(b"/") or any(c <= 0x20 or c >= 0x7F for c in raw):
        return None
    # Dot and empty segments: the provider (and httpx, building its URL) resolves them, so
    # /v1/./chat/completions is a chat completion there, but here it would be another route,
    # its usage not asked for and a cut-off stream kept (QA). Refused rather than guessed at.
    segments = raw.split(b"/")[1:]
    if any(seg in (b"", b".", b"..") for seg in segments[:-1]) or segments[-1] in (b".", b".."):
        return None
    return raw.decode("ascii")


def _token_ok(headers: list[tuple[str, str]], token: str) -> bool:
    """Whether the request carries ``Authorization: Bearer TOKEN``. The scheme's name is
    case-insensitive (RFC 7235: "bearer" too), and the credentials are compared as bytes, the
    header's own (each a Latin-1 character here) with the token's UTF-8 (QA F13: a UTF-8
    token never matched, and "bearer" was 401)."""
    given = next((v for k, v in headers if k == "authorization"), "")
    scheme, _, credentials = given.strip(" \t").partition(" ")
    expected = token.encode("utf-8")
    offered = credentials.strip(" \t").encode("latin-1", "replace")
    same = hmac.compare_digest(offered, expected)
    return scheme.lower() == "bearer" and same


class ClientGone(Exception):
    """The client hung up before its request body was whole (a restore closes the guest's
    connections mid-upload)."""


class Stalled(Exception):
    """No byte of the request body arrived for the read timeout."""


# The slowest a body may arrive on the whole (bytes/s): with the read timeout, the bound of a
# whole body's time (``body_deadline``): 16 MiB at 16 KiB/s is 1024 s.
MIN_BODY_RATE = 16 * 1024


def body_deadline(read_timeout: float, max_body: int) -> float:
    return read_timeout + max_body / MIN_BODY_RATE


async def read_body(receive, limit: int, idle: float | None = None) -> bytes | None:
    """The request body; None when it is over ``limit``; ClientGone when it never ended;
    Stalled when ``idle`` seconds went by with nothing of it."""
    parts, size = [], 0
    while True:
        if idle is None:
            msg = await receive()
        else:
            with trio.move_on_after(idle) as waited:
                msg = await receive()
            if waited.cancelled_caught:
                raise Stalled
        if msg["type"] == "http.disconnect":
            raise ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(parts)


def ksfs_error_reply(exc: KsfsError) -> Reply:
    status = 404 if isinstance(exc, NotFound) else 400 if isinstance(exc, BadInput) \
        else 403 if isinstance(exc, ReadOnly) else 500
    return error_reply(status, "gateway_error", str(exc))
