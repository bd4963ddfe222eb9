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
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ksfs.gateway.calls import (
    Usage,
    is_chat,
    json_bytes,
    model_of,
    raw_usage,
    text_bytes,
    usage_from,
)

RESPONSES_PATH = "/v1/responses"
# Terminal events of a Responses API stream that carry a whole response.
RESPONSES_DONE = ("response.completed", "response.incomplete")
RESPONSES_FAILED = ("response.failed", "error")


# The blank line that ends an event: two line ends in a row, each "\r\n" or "\n" (a lone "\r"
# line end, which no provider sends, is not recognised).
_END = re.compile(rb"\r?\n\r?\n")
_END_OVERLAP = 3  # bytes of an event's end (at most 4) that can come before the next piece
_LINE = re.compile(rb"\r\n|\r|\n")


def split_events(body: bytes) -> Iterator[bytes]:
    """Each event of a stream with its blank line; a last one without it as it is. Scans once
    (a stream of 40,000 events must not be sliced 40,000 times)."""
    pos = 0
    for m in _END.finditer(body):
        yield body[pos:m.end()]
        pos = m.end()
    if pos < len(body):
        yield body[pos:]


def parse_event(raw: bytes) -> tuple[str | None, str]:
    """(event name or None, data lines joined with newlines) of one event. Lines are split at
    SSE's own line ends only (not at U+2028 inside a JSON string)."""
    name, data = None, []
    for line in _LINE.split(raw):
        field, _, value = line.decode("utf-8", "replace").partition(":")
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
    is still the answer); any stream that carries an error event is not. Only the events that
    could say so are parsed; what follows the end is not (``ended``).
    """
    done = ended(body)
    if done is None:
        return "carried an error event"
    if is_chat(path) and not done:
        return "ended without its data: [DONE]"
    if path == RESPONSES_PATH and not done:
        return "ended without response.completed"
    return None


def ended(body: bytes) -> bool | None:
    """Whether a stream reached its end (``data: [DONE]``, ``response.completed`` or
    ``response.incomplete``) with no error event before it: True; an error event first: None;
    neither: False. What follows the end is not judged (QA F10: an event after [DONE] kept
    an answer the provider had finished, and billed, from being stored)."""
    for raw in split_events(body):
        if b"error" not in raw and b"response." not in raw and b"[DONE]" not in raw:
            continue
        name, data = parse_event(raw)
        obj = _json_of(data) if b"{" in raw else None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if name in RESPONSES_FAILED or kind in RESPONSES_FAILED or (
                isinstance(obj, dict) and obj.get("error") not in (None, {}, "")):
            return None
        if data.strip() == "[DONE]" or name in RESPONSES_DONE or kind in RESPONSES_DONE:
            return True
    return False


def usage_of_sse(body: bytes, request_model: str | None) -> Usage:
    """Usage of a streamed response: the last event whose data carries a usage object.

    OpenAI-style chat streams send it in a final chunk when asked (``stream_options``); a
    /v1/responses stream in its ``response.completed`` event. Without one the usage is not
    known (the service counts the call at an estimate). Events are read as ``incomplete``
    reads them: data split over several lines is one JSON text, and a U+2028 inside a string
    does not end a line.
    """
    model = request_model
    merged: dict[str, Any] = {}
    for raw in split_events(body):
        if b"{" not in raw:
            continue
        obj = _json_of(parse_event(raw)[1])
        model = model_of(obj) or model
        u = raw_usage(obj)
        if u is not None:
            # Merged, later figures over earlier ones (review: the last usage alone was
            # taken, and an Anthropic stream's message_delta says only output_tokens, so
            # message_start's input_tokens and cache tokens counted 0). A 0 or null never
            # replaces a figure already given.
            _merge_figures(merged, u)
    found = usage_from({"usage": merged}, model) if merged else None
    if found is None:
        return Usage(model)
    return replace(found, model=model)


def _merge_figures(merged: dict[str, Any], later: dict[str, Any]) -> None:
    """``later``'s figures over ``merged``'s, where they are not 0 or null; an object of
    figures (``cache_creation``) merged the same way, key by key."""
    for k, v in later.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            _merge_figures(merged[k], v)
        elif v is not None and (v != 0 or k not in merged):
            merged[k] = dict(v) if isinstance(v, dict) else v


def generated_text_bytes(body: bytes) -> int:
    """UTF-8 bytes of the text a stream generated: the deltas of its chat chunks (their
    ``choices``), and of a Responses stream's ``*.delta`` events. Read only when the stream
    carried no usage, to count it at an estimate (``calls.estimated_usage``); never the
    whole-answer events (``response.completed``, ``*.done``), which repeat the deltas."""
    total = 0
    for raw in split_events(body):
        if b"{" not in raw:
            continue
        obj = _json_of(parse_event(raw)[1])
        if not isinstance(obj, dict):
            continue
        delta, kind = obj.get("delta"), obj.get("type")
        if isinstance(delta, str) and isinstance(kind, str) and kind.endswith(".delta"):
            total += len(delta.encode("utf-8", "replace"))
        else:
            total += text_bytes(obj.get("choices"))
    return total


def wants_usage_added(obj: dict[str, Any]) -> bool:
    """A streamed chat request that did not ask for its usage (the openai client's default)."""
    if obj.get("stream") is not True:
        return False
    opts = obj.get("stream_options")
    if opts is None:
        return True
    # Asked for already, or a value the provider must judge (an invalid request stays one).
    return isinstance(opts, dict) and opts.get("include_usage") in (None, False)


def with_usage(obj: dict[str, Any]) -> bytes:
    """The request body that asks the provider for the stream's usage as well."""
    opts = dict(obj.get("stream_options") or {}, include_usage=True)
    return json_bytes(dict(obj, stream_options=opts))


class HiddenUsage:
    """Feeds of a stream in, the stream the guest asked for out: the final chunk that only
    carries usage (``"choices": []``) is dropped and other chunks lose their ``usage`` field.
    Works event by event, so output comes at event boundaries whatever the chunking was.

    The bytes of an event not yet ended are held as the pieces they came in, joined once when
    its end arrives: one event of many MB, fed 64 KiB at a time, is copied about twice, not
    once per piece (which made hiding the usage quadratic in the event's size)."""

    def __init__(self) -> None:
        self._held: list[bytes] = []  # the pieces of an event not yet ended
        self._tail = b""  # the last few bytes held: a blank line may straddle two pieces

    def feed(self, data: bytes) -> bytes:
        # Only the new bytes, and the few before them, can hold an event's end not seen yet.
        window = self._tail + data
        if _END.search(window) is None:
            if data:
                self._held.append(data)
            self._tail = window[-_END_OVERLAP:]
            return b""
        held = sum(map(len, self._held))
        buf = b"".join([*self._held, data])
        out, pos = [], 0
        for m in _END.finditer(buf, max(0, held - _END_OVERLAP)):
            out.append(_without_usage(buf[pos:m.end()]))
            pos = m.end()
        rest = buf[pos:]
        self._held = [rest] if rest else []
        self._tail = rest[-_END_OVERLAP:]
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._held, self._tail = b"".join(self._held), [], b""
        return _without_usage(rest) if rest else b""

    @classmethod
    def apply(cls, body: bytes) -> bytes:
        f = cls()
        return f.feed(body) + f.flush()


def _without_usage(event: bytes) -> bytes:
    if b"usage" not in event:
        return event  # most chunks: no parse
    name, data = parse_event(event)
    obj = _json_of(data)
    if name is not None or not isinstance(obj, dict) or "usage" not in obj:
        return event
    if obj.get("usage") is not None and obj.get("choices") == []:
        return b""
    del obj["usage"]
    # Only the data line is rewritten: an id:, retry: or comment line of the event stays.
    lines = [ln for ln in _LINE.split(event.rstrip(b"\r\n")) if not ln.startswith(b"data:")]
    lines.append(b"data: " + json_bytes(obj))
    end = event[len(event.rstrip(b"\r\n")):] or b"\n\n"
    sep = b"\r\n" if end.startswith(b"\r\n") else b"\n"
    return sep.join(lines) + end
