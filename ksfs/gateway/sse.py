"""Server-sent event streams as the gateway must judge and reshape them. Pure functions over
bytes, no I/O.

``incomplete`` says whether a stream that ended cleanly is a whole answer: a provider reports a
failure mid-stream as an error event after a 200, and a stream can stop before its terminator,
and neither may be stored and replayed as if it were the answer. ``HiddenUsage`` takes out of a
chat stream what the gateway asked the provider for on the guest's behalf (the usage chunk of
``stream_options.include_usage``), so the guest gets the stream it asked for while the gateway
still learns what the call cost.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ksfs.gateway.calls import CHAT_PATH

RESPONSES_PATH = "/v1/responses"
# Terminal events of a Responses API stream that carry a whole response.
RESPONSES_DONE = ("response.completed", "response.incomplete")
RESPONSES_FAILED = ("response.failed", "error")


def _boundary(buf: bytes) -> tuple[int, int]:
    """(index, length) of the first blank line ending an event in ``buf``; (-1, 0) if none."""
    found = [(i, len(sep)) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
    return min(found) if found else (-1, 0)


def split_events(body: bytes) -> Iterator[bytes]:
    """Each event of a stream with its blank line; a last one without it as it is."""
    while body:
        i, n = _boundary(body)
        if i < 0:
            yield body
            return
        yield body[: i + n]
        body = body[i + n:]


def parse_event(raw: bytes) -> tuple[str | None, str]:
    """(event name or None, data lines joined with newlines) of one event."""
    name, data = None, []
    for line in raw.decode("utf-8", "replace").splitlines():
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    return name, "\n".join(data)


def _json_of(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def incomplete(body: bytes, path: str) -> str | None:
    """Why a stream that ended cleanly is not a whole answer, or None when it is.

    A chat stream is whole when it reached ``data: [DONE]``; a Responses stream when it reached
    ``response.completed`` or ``response.incomplete`` (a response cut by its own token limit
    is still the answer); any stream that carries an error event is not.
    """
    done = False
    for raw in split_events(body):
        name, data = parse_event(raw)
        obj = _json_of(data)
        kind = obj.get("type") if isinstance(obj, dict) else None
        if name in RESPONSES_FAILED or kind in RESPONSES_FAILED or (
                isinstance(obj, dict) and obj.get("error") not in (None, {}, "")):
            return "carried an error event"
        if data.strip() == "[DONE]" or name in RESPONSES_DONE or kind in RESPONSES_DONE:
            done = True
    if path == CHAT_PATH and not done:
        return "ended without its data: [DONE]"
    if path == RESPONSES_PATH and not done:
        return "ended without response.completed"
    return None


def wants_usage_added(obj: dict[str, Any]) -> bool:
    """A streamed chat request that did not ask for its usage (the openai client's default)."""
    if obj.get("stream") is not True:
        return False
    opts = obj.get("stream_options")
    if opts is None:
        return True
    return isinstance(opts, dict) and opts.get("include_usage") is not True


def with_usage(obj: dict[str, Any]) -> bytes:
    """The request body that asks the provider for the stream's usage as well."""
    opts = dict(obj.get("stream_options") or {}, include_usage=True)
    return json.dumps(dict(obj, stream_options=opts), ensure_ascii=False,
                      separators=(",", ":")).encode("utf-8")


class HiddenUsage:
    """Feeds of a stream in, the stream the guest asked for out: the final chunk that only
    carries usage (``"choices": []``) is dropped and other chunks lose their ``usage`` field.
    Works event by event, so output comes at event boundaries whatever the chunking was."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while True:
            i, n = _boundary(self._buf)
            if i < 0:
                return b"".join(out)
            event, self._buf = self._buf[: i + n], self._buf[i + n:]
            out.append(_without_usage(event))

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return _without_usage(rest) if rest else b""

    @classmethod
    def apply(cls, body: bytes) -> bytes:
        f = cls()
        return f.feed(body) + f.flush()


def _without_usage(event: bytes) -> bytes:
    name, data = parse_event(event)
    obj = _json_of(data)
    if name is not None or not isinstance(obj, dict) or "usage" not in obj:
        return event
    if obj.get("usage") is not None and obj.get("choices") == []:
        return b""
    del obj["usage"]
    end = event[len(event.rstrip(b"\r\n")):] or b"\n\n"
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + end
