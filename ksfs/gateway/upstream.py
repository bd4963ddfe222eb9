"""The gateway's client side: one httpx connection pool to the model provider, per session.

It decides which headers cross to the provider (never the guest's Authorization: the gateway's
own key replaces it) and turns transport failures into the answers the guest gets (502 for a
provider that cannot be reached, 504 for one that does not answer in time). It must never log,
store or return the API key, and never follow redirects (a redirect is passed back as it is).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx
import trio

log = logging.getLogger("ksfs.gateway")

# Hop-by-hop headers (RFC 9110 7.6.1) and those the HTTP stack sets itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})
# Never forwarded from the guest: the key is the gateway's to give, the idempotency key is ours,
# and which organization or project the key bills is the operator's choice, not the guest's.
GUEST_ONLY = frozenset({"authorization", "idempotency-key", "cookie", "openai-organization",
                        "openai-project"})
SECRET_KEY_MIN = 20  # shorter API keys are placeholders, not secrets to mask
# An API key as providers echo it in errors ("Incorrect API key provided: sk-proj-****abcd").
KEY_ECHO = re.compile(rb"\b(sk|rk)-[A-Za-z0-9_*-]{4,}")
_KEY_ECHO_TEXT = re.compile(KEY_ECHO.pattern.decode("ascii"))
# Not kept with a stored response: they describe one delivery, not the response.
NOT_STORED = HOP_BY_HOP | {"date", "server", "set-cookie", "content-encoding", "alt-svc",
                           "x-ksfs-replay", "x-ksfs-key"}

Headers = list[tuple[str, str]]


@dataclass(frozen=True)
class Fetched:
    """A whole upstream response, body read to its end."""

    status: int
    headers: Headers
    body: bytes


@dataclass(frozen=True)
class Reply:
    """What the gateway answers a guest with (a stored, replayed or error response)."""

    status: int
    headers: Headers
    body: bytes


@dataclass(frozen=True)
class CutShort(Reply):
    """The error Reply (502/504) for an answer that broke off after it began (the connection
    dropped, the timeout): ``begun`` is what had arrived, which the provider may have billed."""

    begun: Fetched | None = None


def error_reply(status: int, type_: str, message: str, **extra: object) -> Reply:
    """An OpenAI-style JSON error: {"error": {"type", "message", ...}}."""
    body = json.dumps({"error": {"type": type_, "message": message, **extra}},
                      sort_keys=True).encode("utf-8")
    return Reply(status, [("content-type", "application/json")], body)


def without_keys(body: bytes) -> bytes:
    """An error body with any API key the provider echoed in it masked: even partly masked,
    the operator's key is not the guest's to see."""
    return KEY_ECHO.sub(rb"\1-***", body)


class KeyMask:
    """Replaces the operator's key with ``***`` in a body that arrives in pieces, so a key split
    across two pieces is caught too: a piece's end that could be the key's start waits for the
    next piece (only that: an event of a stream is not held back for nothing).
    A key shorter than SECRET_KEY_MIN is a local server's placeholder ("EMPTY", "ollama"), no
    secret, and may be a word of the answer: nothing is masked then."""

    def __init__(self, api_key: str | None) -> None:
        key = (api_key or "").encode()
        self.key = key if len(key) >= SECRET_KEY_MIN else b""
        self._held = b""

    def feed(self, piece: bytes) -> bytes:
        if not self.key:
            return piece
        data = (self._held + piece).replace(self.key, b"***")
        keep = min(len(self.key) - 1, len(data))
        while keep and not data.endswith(self.key[:keep]):
            keep -= 1
        self._held = data[len(data) - keep:] if keep else b""
        return data[: len(data) - keep]

    def end(self) -> bytes:
        held, self._held = self._held, b""
        return held

    def whole(self, body: bytes) -> bytes:
        """A whole body, masked (the key anywhere in it)."""
        return body.replace(self.key, b"***") if self.key else body

    def headers(self, headers: Headers) -> Headers:
        """Headers with the key masked in names and values, and with any key a provider echoes
        in its own format (``sk-...``, even partly masked) cut to ``sk-***`` as in error
        bodies: a provider or a proxy that echoes the request's Authorization in a header
        (a debug header, a redirect's Location) must not hand the operator's key to the
        guest, nor have it stored with the answer (QA F3)."""
        key = self.key.decode("latin-1")  # headers hold their bytes as Latin-1 characters
        out = []
        for k, v in headers:
            if key:
                k, v = k.replace(key, "***"), v.replace(key, "***")
            out.append((k, _KEY_ECHO_TEXT.sub(r"\1-***", v)))
        return out


def keep_headers(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> Headers:
    return [(k.lower(), v) for k, v in headers if k.lower() not in drop]


class Upstream:
    """The provider at ``base_url`` (scheme://host[:port][/prefix]; guest paths are appended)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.timeout = timeout
        # trust_env=False: no proxy or netrc from the environment may redirect calls or add keys.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout), trust_env=False,
                                        follow_redirects=False)

    async def aclose(self) -> None:
        await self.client.aclose()

    def __repr__(self) -> str:  # never show the key, even in a traceback's locals
        return f"Upstream({self.base_url!r})"

    def url(self, path: str, query: bytes = b"") -> str:
        if not path.startswith("/"):  # the app refuses these; never build another host's URL
            raise ValueError(f"upstream path {path[:80]!r} does not start with '/'")
        return self.base_url + path + (("?" + query.decode("latin-1")) if query else "")

    def outgoing(self, guest: Iterable[tuple[str, str]], identity: bool = False) -> Headers:
        """The headers sent upstream: the guest's, less hop-by-hop and secrets, plus our key.
        They go as bytes (``encode_headers``): the guest's as it sent them (httpx would encode
        a text value as ASCII, and a guest's UTF-8 header was a 500). The guest's
        Accept-Encoding keeps only what httpx can decode (``decodable``): every answer is
        decoded here (key masking reads it) and handed on without its content-encoding, so a
        br answer httpx cannot decode reached the guest as undecodable bytes (review)."""
        guest = list(guest)
        out = keep_headers(guest, HOP_BY_HOP | GUEST_ONLY | {"accept-encoding"})
        # Stored bodies must be plain so usage can be read and replays need no decoding.
        asked = None if identity else ", ".join(
            v for k, v in guest if k.lower() == "accept-encoding")
        out.append(("accept-encoding", decodable(asked) if asked else "identity"))
        if self._api_key:
            out.append(("authorization", f"Bearer {self._api_key}"))
        return out

    async def fetch(self, method: str, path: str, guest_headers: Headers, body: bytes,
                    on_start: Callable[[int, Headers], None] | None = None,
                    on_chunk: Callable[[bytes], None] | None = None,
                    query: bytes = b"") -> Fetched | Reply:
        """The whole response, or the error Reply (502/504) when none came in time.

        ``on_start(status, headers)`` and ``on_chunk(bytes)`` see the response as it arrives
        (for streaming it through); the bytes they see are exactly those of the result. An
        answer that breaks off after it began is a ``CutShort`` holding what had arrived.
        """
        begun: list[tuple[int, Headers]] = []
        chunks: list[bytes] = []
        try:
            with trio.fail_after(self.timeout):
                async with self.client.stream(
                    method, self.url(path, query),
                    headers=encode_headers(self.outgoing(guest_headers, identity=True)),
                    content=body,
                ) as resp:
                    # The key masked wherever it could travel back: what the guest gets,
                    # live or replayed, and what is stored.
                    mask = KeyMask(self._api_key)
                    headers = mask.headers(raw_headers(resp))
                    begun.append((resp.status_code, headers))
                    if on_start is not None:
                        on_start(resp.status_code, headers)

                    def take(piece: bytes) -> None:
                        if piece:
                            chunks.append(piece)
                            if on_chunk is not None:
                                on_chunk(piece)

                    # Masked as it comes, so what a stream's guest is sent live is what is
                    # stored (a provider that echoes the request back echoes our key).
                    # Decoded: a provider that compresses although asked for identity must
                    # not have gzip stored (and replayed) without its content-encoding.
                    async for chunk in resp.aiter_bytes():
                        take(mask.feed(chunk))
                    take(mask.end())
                    return Fetched(resp.status_code, headers, b"".join(chunks))
        except (trio.TooSlowError, httpx.TimeoutException):
            reply = error_reply(504, "upstream_timeout",
                                f"the model provider did not answer within {self.timeout:g} s"
                                + (" (its answer had begun)" if begun else ""))
        except httpx.HTTPError as exc:
            log.warning("upstream %s failed: %s", self.base_url, type(exc).__name__)
            reply = error_reply(502, "upstream_unreachable", (
                f"the model provider's answer broke off before its end ({type(exc).__name__})"
                if begun else _not_answered(exc)))
        if not begun:
            return reply
        return CutShort(reply.status, reply.headers, reply.body,
                        Fetched(*begun[0], b"".join(chunks)))

    async def passthrough(self, method: str, path: str, query: bytes, guest_headers: Headers,
                          body: bytes, send) -> None:
        """Forward one request and stream the answer back to the ASGI ``send`` unchanged."""
        req = self.client.build_request(method, self.url(path, query),
                                        headers=encode_headers(self.outgoing(guest_headers)),
                                        content=body)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.TimeoutException:
            return await send_reply(send, error_reply(
                504, "upstream_timeout", "the model provider did not answer in time"))
        except httpx.HTTPError as exc:
            return await send_reply(send, error_reply(
                502, "upstream_unreachable", _not_answered(exc)))
        try:
            if resp.status_code >= 400:
                # An error is small: read it whole and decoded, so a key the provider echoes
                # is masked however it was compressed or split.
                try:
                    body = await resp.aread()  # decoded
                except httpx.HTTPError:
                    body = b""
                mask = KeyMask(self._api_key)
                return await send_reply(send, Reply(resp.status_code, keep_headers(
                    mask.headers(raw_headers(resp)), HOP_BY_HOP | {"content-encoding"}),
                    without_keys(mask.whole(body))))
            # Decoded, so that the key is found however the body was compressed; its length
            # and encoding are then no longer the provider's (HOP_BY_HOP drops content-length).
            mask = KeyMask(self._api_key)  # a provider that echoes requests (a debug route)
            headers = keep_headers(mask.headers(raw_headers(resp)),
                                   HOP_BY_HOP | {"content-encoding"})
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": encode_headers(headers)})
            try:
                async for chunk in resp.aiter_bytes():
                    if piece := mask.feed(chunk):
                        await send({"type": "http.response.body", "body": piece,
                                    "more_body": True})
            except httpx.HTTPError as exc:
                # Headers are out: all we can do is end the body early and say so in the log.
                log.warning("upstream %s broke off a passed-through response: %s",
                            self.base_url, type(exc).__name__)
            await send({"type": "http.response.body", "body": mask.end(), "more_body": False})
        finally:
            await resp.aclose()


def _decoders() -> frozenset[str]:
    try:
        from httpx._decoders import SUPPORTED_DECODERS  # what this httpx decodes (br when
        return frozenset(SUPPORTED_DECODERS)  # brotli is installed, zstd with zstandard)
    except ImportError:  # (a private name: the codings every httpx decodes)
        return frozenset({"identity", "gzip", "deflate"})


DECODABLE = _decoders()


def decodable(accept_encoding: str) -> str:
    """A guest's Accept-Encoding less the codings httpx cannot decode (and ``*``, which would
    let the provider choose one); ``identity`` when nothing is left."""
    kept = []
    for item in accept_encoding.split(","):
        coding = item.split(";")[0].strip().lower()
        if coding and coding in DECODABLE:
            kept.append(item.strip())
    return ", ".join(kept) or "identity"


def raw_headers(resp: httpx.Response) -> Headers:
    """A provider's headers as the bytes it sent, each byte one character (Latin-1), so that
    they go back out byte for byte (QA: httpx's decoding of a UTF-8 value, "東京", has no
    Latin-1 form, and the answer to a call already bought and stored was a 500)."""
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.headers.raw]


def encode_headers(headers: Headers) -> list[tuple[bytes, bytes]]:
    """Headers as the bytes the ASGI server writes: Latin-1, which gives back the provider's own
    bytes (``raw_headers``); a value that has no Latin-1 form (one stored by an older gateway
    as httpx decoded it) goes as UTF-8, and one with no form at all (a lone surrogate) is
    dropped: a header the guest cannot be sent never costs it the answer."""
    out = []
    for k, v in headers:
        try:
            name = k.encode("latin-1")
        except UnicodeEncodeError:
            continue
        try:
            value = v.encode("latin-1")
        except UnicodeEncodeError:
            try:
                value = v.encode("utf-8")
            except UnicodeEncodeError:
                continue
        if b"\r" in value or b"\n" in value or b"\0" in value:
            continue  # (never from a provider's parsed answer; never write a split header)
        out.append((name, value))
    return out


async def send_reply(send, reply: Reply, extra: Headers = ()) -> None:
    headers = [(k, v) for k, v in reply.headers if k != "content-length"]
    headers += list(extra) + [("content-length", str(len(reply.body)))]
    await send({"type": "http.response.start", "status": reply.status,
                "headers": encode_headers(headers)})
    await send({"type": "http.response.body", "body": reply.body, "more_body": False})


def _not_answered(exc: Exception) -> str:
    """Why no answer came: the provider unreachable, or reached and gone without answering
    (QA, eighteenth session: a provider that read the request and closed was "could not be
    reached", though it had the request)."""
    if isinstance(exc, httpx.RemoteProtocolError):
        return (f"the model provider closed the connection without answering "
                f"({type(exc).__name__})")
    return f"the model provider could not be reached ({type(exc).__name__})"
