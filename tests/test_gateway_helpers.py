"""Shared helpers of the gateway tests: a real store and ledger in a tmp dir, sessions, a
checkpoint record to fork from, and a client that talks to a served session. No test here.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from typing import Any

import httpx
import pytest
from fake_provider import FakeProvider, QuietServer

from ksfs.cas import ChunkStore
from ksfs.ledger import Ledger
from ksfs.model import CheckpointRecord, ForkPoint

CHAT = "/v1/chat/completions"
MARKER_KEY = "sk-ksfs-test-MARKER-7f3a9c1e5b"  # the API key the secrecy test looks for
# The price table of the budget tests: test-model at $1000 / $2000 per million tokens.
PRICES = """
[models."test-model"]
input = 1000.0
output = 2000.0
"""


def open_store(path: str | os.PathLike[str]) -> ChunkStore:
    return ChunkStore.open(path, create=True)


def add_sessions(ledger: Ledger, *names: str) -> None:
    with ledger.env.begin(write=True) as txn:
        for name in names:
            ledger.create_session(txn, name)


def take_checkpoint(ledger: Ledger, session: str, name: str) -> int:
    """A checkpoint record with no files (the gateway needs only its seq); returns the seq."""
    with ledger.env.begin(write=True) as txn:
        ev = ledger.append(txn, session, "checkpoint.begin", {"name": name})
        ledger.put_checkpoint(txn, CheckpointRecord(session, name, ev.seq, time.time(), ()))
    return ev.seq


def fork(ledger: Ledger, parent: str, checkpoint: str, new: str) -> None:
    seq = ledger.checkpoint(parent, checkpoint).seq
    fp = ForkPoint(parent, checkpoint, seq, ledger.session(parent).lineage)
    with ledger.env.begin(write=True) as txn:
        ledger.create_session(txn, new, parent=fp)


def events(ledger: Ledger, session: str, type_: str) -> list[Any]:
    return [e for e in ledger.events(session) if e.type == type_]


def chat_body(text: str = "hello there gateway", model: str = "gpt-4o-mini",
              stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def client(port: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30)


async def call(port: int, body: dict[str, Any], key: str | None = None,
               raw: bytes | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    """One chat completion through the gateway; the whole body read."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        hdrs["idempotency-key"] = key
    async with client(port) as c:
        return await c.post(CHAT, content=raw if raw is not None else json.dumps(body),
                            headers=hdrs)


def check_clean(store: ChunkStore, ledger: Ledger) -> None:
    """Every test that touched the store ends here: the ledger and the store verify clean."""
    assert ledger.verify() == []
    report = store.check()
    assert report.ok, report


# --- fixtures the gateway test modules share (each imports them by name) ------------------


@pytest.fixture(scope="module")
def upstream():
    """One fake provider on 127.0.0.1 per test module."""
    with FakeProvider() as up:
        yield up


@pytest.fixture
def provider(upstream):
    upstream.reset()
    yield upstream
    upstream.reset()


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def ledger(store):
    """A ledger with sessions s1 and s2, checked clean after the test."""
    led = Ledger(store)
    add_sessions(led, "s1", "s2")
    yield led
    check_clean(store, led)


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive, chunked answers), and nothing logged to the test's stderr."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass


class ThreadedProvider:
    """A provider stand-in on 127.0.0.1 whose subclass's __init__ ends with
    ``self._serve(Handler)``; as a context manager it answers on a thread until the block
    ends."""

    def _serve(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self._server = QuietServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def anthropic_stream(model: str, start_usage: dict, output_tokens: int) -> bytes:
    """A /v1/messages stream as Anthropic sends one: message_start carries ``start_usage``
    (the input and cache tokens, output 1), message_delta the cumulative ``output_tokens``."""
    def event(name: str, obj: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()

    return b"".join([
        event("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "usage": start_usage}}),
        event("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": "hi"}}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": output_tokens}}),
        event("message_stop", {"type": "message_stop"}),
    ])
