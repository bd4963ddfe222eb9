# ruff: noqa: F401, F811
# (pytest fixtures shared through test_gateway_helpers are imported by name, then named as test
# parameters, as pyproject.toml allows for the older gateway test modules)
"""Findings of a QA review of the gateway, each over real sockets: a provider's header with no
Latin-1 form, the operator's key echoed in headers, slow and idle clients, huge or partial usage
figures, paths that escape the chat checks, what follows a stream's end, and more.

Some findings need a provider that does what tests/fake_provider.py never does (odd header
bytes, the key echoed in headers): ``OddProvider`` here, on the standard library's http.server
as that one is, so the gateway is never tested against its own stack.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from test_gateway_cli import served  # a `ksfs gateway serve` in a subprocess
from test_gateway_helpers import (  # the shared fixtures, by name
    CHAT,
    MARKER_KEY,
    PRICES,
    QuietHandler,
    ThreadedProvider,
    call,
    chat_body,
    client,
    events,
    ledger,
    provider,
    store,
    upstream,
)

from ksfs.gateway import Gateway

# An operator's key no pattern of a provider's key format would catch: only the key itself.
PLAIN_KEY = "provider-key-QA-4b1d9e7c20aa51f3"


@pytest.fixture
def prices_file(tmp_path):
    p = tmp_path / "prices.toml"
    p.write_text(PRICES)
    return p


# --- a provider that does what the usual fake never does -------------------------------------


class OddProvider(ThreadedProvider):
    """Chat completions (JSON, or a stream when asked) with configurable oddities:

    - ``raw_header``: one header line written as these exact bytes (e.g. UTF-8 with no Latin-1
      form), on every answer;
    - ``echo_key``: the Authorization it was sent, echoed in a header and in the answer's text;
    - ``after_done``: bytes sent after a stream's ``data: [DONE]`` event;
    - ``drop_after_done``: the connection closed after that, the chunked body never ended;
    - ``status``: the status of chat answers (an error body then).
    """

    def __init__(self) -> None:
        self.raw_header: bytes | None = None
        self.echo_key = False
        self.after_done = b""
        self.drop_after_done = False
        self.status = 200
        self.count = 0
        provider = self

        class Handler(QuietHandler):
            def _head(self, status: int, ctype: str, length: int | None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                if length is None:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(length))
                if provider.raw_header is not None:
                    self._headers_buffer.append(provider.raw_header + b"\r\n")
                if provider.echo_key:
                    self.send_header("X-Echo-Authorization", self.headers.get("Authorization"))
                self.end_headers()

            def _text(self) -> str:
                said = self.headers.get("Authorization", "") if provider.echo_key else ""
                return f"you said {said} to me"

            def do_GET(self) -> None:
                raw = json.dumps({"object": "list", "data": [], "seen": self._text()}).encode()
                self._head(provider.status, "application/json", len(raw))
                self.wfile.write(raw)

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                provider.count += 1
                usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
                if provider.status != 200:
                    raw = json.dumps({"error": {"message": self._text()}}).encode()
                    self._head(provider.status, "application/json", len(raw))
                    self.wfile.write(raw)
                    return
                base = {"id": f"c-{provider.count}", "model": req["model"]}
                if not req.get("stream"):
                    raw = json.dumps(dict(base, usage=usage, choices=[
                        {"index": 0, "message": {"role": "assistant",
                                                 "content": self._text()}}])).encode()
                    self._head(200, "application/json", len(raw))
                    self.wfile.write(raw)
                    return
                self._head(200, "text/event-stream", None)
                for ev in (dict(base, choices=[{"index": 0, "delta": {"content": self._text()}}]),
                           dict(base, choices=[], usage=usage)):
                    self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self._chunk(b"data: [DONE]\n\n")
                if provider.after_done:
                    self._chunk(provider.after_done)
                if provider.drop_after_done:
                    self.close_connection = True
                    return
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self._serve(Handler)


@pytest.fixture
def odd():
    with OddProvider() as up:
        yield up


def store_bytes(store) -> bytes:
    """Every byte of every file of the store (LMDB's data file too)."""
    return b"".join(p.read_bytes() for p in sorted(Path(store.path).rglob("*")) if p.is_file())


# --- F1: a header with no Latin-1 form ---------------------------------------------------------


async def test_a_provider_header_with_no_latin1_form_reaches_the_guest(store, ledger, odd,
                                                                       prices_file, nursery):
    """QA F1: httpx decodes a UTF-8 header value to text that Latin-1 cannot write, and the guest
    got a 500 for a call that was bought and stored; its retries were counted as replays."""
    odd.raw_header = "X-Place: 東京".encode()
    gw = Gateway(store, ledger, odd.url, prices_file, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    for stream in (False, True):
        body = chat_body(f"where {stream}", model="test-model", stream=stream)
        first = await call(port, body)
        again = await call(port, body)
        assert first.status_code == again.status_code == 200, first.text
        assert first.headers["x-ksfs-replay"] == "false"
        assert again.headers["x-ksfs-replay"] == "true"
        for r in (first, again):
            assert dict(r.headers.raw)[b"x-place"] == "東京".encode()
        assert first.content == again.content
    # Passed through unpaid, too.
    async with client(port) as c:
        r = await c.get("/v1/models")
    assert r.status_code == 200 and dict(r.headers.raw)[b"x-place"] == "東京".encode()
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"]) == (2, 2) and odd.count == 2


async def test_a_guest_header_with_no_ascii_form_goes_upstream_as_sent(gw, provider, nursery):
    """The same on the way up: httpx encodes a text header value as ASCII, so a guest's UTF-8
    header (its bytes, each a Latin-1 character here) failed the purchase with a 500."""
    port = await nursery.start(gw.serve_session, "s1")
    note = "café 東京".encode()
    r = await call(port, chat_body("a note", model="test-model"), headers={"x-note": note})
    assert r.status_code == 200, r.text
    async with client(port) as c:
        assert (await c.get("/v1/models", headers={"x-note": note})).status_code == 200
    # (http.server reads header bytes as Latin-1)
    assert [q.headers["x-note"].encode("latin-1") for q in provider.requests] == [note] * 2


# --- F3: the key echoed in headers -------------------------------------------------------------


async def test_the_key_a_provider_echoes_in_headers_or_bodies_never_travels_back(
        store, ledger, odd, prices_file, nursery):
    """QA F3: headers crossed unmasked, so a provider echoing the request's Authorization in a
    header handed the operator's key to the guest and into the store. The key here has no
    provider's format (only the key itself can find it), in headers and bodies, on every way
    back: a paid answer (JSON, streamed, replayed), an upstream error, and a passed-through GET
    (answered and failed)."""
    odd.echo_key = True
    gw = Gateway(store, ledger, odd.url, prices_file, api_key=PLAIN_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    got = []
    for stream in (False, True):
        body = chat_body(f"echo {stream}", model="test-model", stream=stream)
        got += [await call(port, body), await call(port, body)]
    async with client(port) as c:
        got.append(await c.get("/v1/models"))
        odd.status = 500
        got.append(await c.get("/v1/models"))
        got.append(await call(port, chat_body("fails", model="test-model")))
    assert [r.status_code for r in got] == [200] * 5 + [500] * 2
    assert [r.headers.get("x-ksfs-replay") for r in got[:4]] == ["false", "true"] * 2
    key = PLAIN_KEY.encode()
    for r in got:
        assert r.headers["x-echo-authorization"] == "Bearer ***", r.headers
        assert b"***" in r.content and key not in r.content, r.content
        assert all(key not in k + v for k, v in r.headers.raw)
    assert key not in store_bytes(store)
    u = gw.usage("s1")
    assert (u["paid_calls"], u["upstream_errors"]) == (2, 1)


# --- F5, F8: usage figures too large, or only a total ------------------------------------------

USAGE_MAX = 10**9  # calls.USAGE_MAX, as docs/gateway.md says it: a billion tokens


@pytest.fixture
def gw(store, ledger, provider, prices_file):
    return Gateway(store, ledger, provider.url, prices_file, api_key=MARKER_KEY, timeout=10)


async def test_a_huge_usage_figure_is_recorded_clamped_and_flagged(gw, ledger, provider,
                                                                    nursery):
    """QA F5: 10**400 prompt tokens overflowed the cost's float: the call, bought, was answered
    500 and went unrecorded. Now it is stored and counted at calls.USAGE_MAX, and flagged."""
    provider.usage_as = {"prompt_tokens": 10**400, "completion_tokens": 5,
                         "total_tokens": 10**400 + 5}
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("count me", model="test-model")
    r = await call(port, body)
    assert r.status_code == 200, r.text
    assert (await call(port, body)).headers["x-ksfs-replay"] == "true"
    [e] = events(ledger, "s1", "gateway.call")
    assert e.body["stored"] is True and e.body["usage_clamped"] is True
    assert (e.body["prompt_tokens"], e.body["completion_tokens"]) == (USAGE_MAX, 5)
    assert e.body["total_tokens"] == USAGE_MAX + 5  # never below its parts
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"], u["prompt_tokens"]) == (1, 1, USAGE_MAX)
    assert u["cost_usd"] == pytest.approx((USAGE_MAX * 1000 + 5 * 2000) / 1e6)
    # A stream's usage is read the same way.
    r = await call(port, chat_body("count me too", model="test-model", stream=True))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert events(ledger, "s1", "gateway.call")[-1].body["usage_clamped"] is True
    assert gw.usage("s1")["paid_calls"] == 2


async def test_a_usage_of_only_a_total_is_priced_at_the_higher_price(gw, ledger, provider,
                                                                      nursery):
    """QA F8: a usage block with total_tokens alone counted its tokens but cost $0."""
    provider.usage_as = {"total_tokens": 100}
    port = await nursery.start(gw.serve_session, "s1")
    assert (await call(port, chat_body("total only", model="test-model"))).status_code == 200
    [e] = events(ledger, "s1", "gateway.call")
    assert (e.body["total_tokens"], e.body["usage_known"]) == (100, True)
    # test-model: input 1000, output 2000 USD per 1M tokens: the higher price, 2000.
    assert e.body["cost_usd"] == pytest.approx(100 * 2000 / 1e6)
    assert gw.usage("s1")["cost_usd"] == pytest.approx(0.2)
    # Part attributed: the rest still priced, at the higher price.
    provider.usage_as = {"prompt_tokens": 10, "total_tokens": 100}
    assert (await call(port, chat_body("partly", model="test-model"))).status_code == 200
    assert events(ledger, "s1", "gateway.call")[-1].body["cost_usd"] == pytest.approx(
        (10 * 1000 + 90 * 2000) / 1e6)
    # Embeddings price their output at 0: a total alone still costs the input's price.
    from ksfs.gateway import load_prices

    assert load_prices().cost("text-embedding-3-small", 0, 0, 1_000_000) == (
        pytest.approx(0.02), True)


# --- F9, F10, F11: paths, what follows a stream's end, the 503 of a stop ----------------------


async def test_a_paid_path_ending_in_a_slash_is_refused_and_sent_nowhere(gw, provider,
                                                                          nursery):
    """QA F9: /v1/chat/completions/ escaped the chat checks (usage asked for, [DONE] required)
    and went upstream unmetered, as a chat completion at many a provider."""
    port = await nursery.start(gw.serve_session, "s1")
    async with client(port) as c:
        for path in ("/v1/chat/completions/", "/v1/responses/", "/v1/embeddings/"):
            r = await c.post(path, json=chat_body("slash", model="test-model", stream=True))
            assert r.status_code == 400, (path, r.text)
            assert "must not end in '/'" in r.json()["error"]["message"]
        assert provider.requests == []
        # A bodyless GET is no paid call: passed through as ever.
        assert (await c.get("/v1/models/")).status_code == 404
        assert (await call(port, chat_body("no slash", model="test-model"))).status_code == 200
    assert [r.path for r in provider.requests] == ["/v1/models/", CHAT]


async def test_a_stream_is_stored_once_its_end_was_seen_whatever_follows(
        store, ledger, odd, prices_file, nursery):
    """QA F10: an event after data: [DONE] (here an error event, then a connection that breaks
    off) kept the answer, finished and billed, from being stored: a retry bought it again."""
    gw = Gateway(store, ledger, odd.url, prices_file, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    late = b'data: {"error": {"message": "late"}}\n\n'
    for n, (after, drop) in enumerate(((late, False), (late, True),
                                        (b'data: {"choices": []}\n\n', True))):
        odd.after_done, odd.drop_after_done = after, drop
        body = chat_body(f"after the end {n}", model="test-model", stream=True)
        first = await call(port, body)
        assert first.status_code == 200 and b"data: [DONE]" in first.content
        assert b"upstream_stream_incomplete" not in first.content, first.content
        again = await call(port, body)
        assert again.headers["x-ksfs-replay"] == "true" and again.content == first.content
        assert odd.count == n + 1
    calls = events(ledger, "s1", "gateway.call")
    assert [e.body["stored"] for e in calls] == [True] * 3
    # An error event before the end is still no answer.
    odd.after_done, odd.drop_after_done = b"", False
    from ksfs.gateway.sse import incomplete

    assert incomplete(late + b"data: [DONE]\n\n", CHAT) == "carried an error event"
    assert incomplete(b"data: [DONE]\n\n" + late, CHAT) is None


async def test_the_503_of_a_stopping_gateway_carries_its_ksfs_headers(gw, provider, nursery):
    """QA F11: every other answer to a paid call carries X-Ksfs-Key and X-Ksfs-Replay."""
    port = await nursery.start(gw.serve_session, "s1")
    assert await gw.drain(0) == 0  # stopping: no new purchase
    r = await call(port, chat_body("too late", model="test-model"), key="k1")
    assert r.status_code == 503 and r.json()["error"]["type"] == "gateway_stopping"
    assert r.headers["x-ksfs-replay"] == "error" and len(r.headers["x-ksfs-key"]) == 64
    assert provider.requests == []


# --- F13: option nits --------------------------------------------------------------------------


async def test_a_port_outside_the_tcp_range_is_refused_in_one_line(gw, nursery):
    """QA F13: serve_session(port=99999) went as far as the bind: an OverflowError deep in a
    nursery's exception group (which the daemon's supervisor does not catch)."""
    from ksfs.errors import BadInput

    for port in (99999, 65536, -1, True, "8080"):
        with pytest.raises(BadInput, match="not a TCP port"):
            await nursery.start(gw.serve_session, "s1", port)
    assert gw.ports == {}


async def test_the_token_scheme_is_case_insensitive_and_a_utf8_token_matches(gw, provider,
                                                                            nursery):
    """QA F13: "bearer" got 401 (RFC 7235: the scheme is case-insensitive), and a UTF-8 token
    never matched (the header's bytes were compared as their Latin-1 text's UTF-8)."""
    token = "jeton-à-clé-秘密"
    port = await nursery.start(partial(gw.serve_session, "s1", token=token))

    async def status(auth: bytes) -> int:
        async with client(port) as c:
            r = await c.post(CHAT, json=chat_body(f"auth {auth!r}", model="test-model"),
                             headers={"authorization": auth})
            return r.status_code

    for good in (b"Bearer ", b"bearer ", b"BEARER ", b"Bearer  "):
        assert await status(good + token.encode()) == 200, good
    for bad in (b"Bearer " + token.encode("utf-8")[:-1], b"Basic " + token.encode(),
                b"Bearer" + token.encode(),
                b"Bearer jeton-\xe0-cl\xe9-"):
        assert await status(bad) == 401, bad
    assert provider.count() == 4


def test_a_usd_budget_too_small_to_count_is_refused_in_one_line(tmp_path):
    """QA F13: `--usd 1e-320` (a subnormal float, not 0) was taken as a budget."""
    from test_gateway_cli import ksfs

    from ksfs.cas import ChunkStore

    store = tmp_path / "store"
    ChunkStore.open(store, create=True).close()
    (tmp_path / "note").write_text("n\n")
    ksfs(store, "import", "default", "c1", str(tmp_path / "note"))
    for tiny in ("1e-320", "5e-13", "4.9e-324"):
        res = ksfs(store, "budget", "default", "--usd", tiny, check=False)
        assert res.returncode == 2 and "too small to count" in res.stderr, (tiny, res.stderr)
        assert res.stderr.count("\n") == 1, res.stderr
    assert "no budget" in ksfs(store, "budget", "default").stdout
    assert "1e-12 USD" in ksfs(store, "budget", "default", "--usd", "1e-12").stdout


# --- F2: concurrent calls and the budget -------------------------------------------------------


async def burst(port: int, bodies: list[dict]) -> list[httpx.Response]:
    replies: list[httpx.Response] = []

    async def one(body: dict) -> None:
        replies.append(await call(port, body))

    async with trio.open_nursery() as calls:
        for body in bodies:
            calls.start_soon(one, body)
    return replies


async def test_concurrent_calls_spend_past_a_budget_by_at_most_what_docs_say(gw, provider,
                                                                              nursery):
    """QA F2: a request without a completion cap was reckoned at its prompt (body/4) or at the
    largest call before, no bound of what it may generate: after one short call, a burst of
    long answers all started together and spent several times the budget. Each purchase in
    flight now reserves its prompt and its cap, or 4096 completion tokens without one, and a
    budget is passed only by the one call that starts alone (docs/gateway.md)."""
    gw.set_budget("s1", tokens=300)
    port = await nursery.start(gw.serve_session, "s1")
    provider.words = ["short"]  # teaches the gate a call of 2 + 1 tokens
    assert (await call(port, chat_body("first", model="test-model"))).status_code == 200
    provider.words = ["long"] * 100  # each call now costs 2 + 100 tokens
    provider.delay = 0.3
    replies = await burst(port, [chat_body(f"uncapped {i}", model="test-model")
                                 for i in range(8)])
    one_call = 2 + 100
    u = gw.usage("s1")
    # Reserved at 4096 completion tokens each, more than the budget: one at a time, and the
    # budget passed by at most the one call that started alone.
    assert provider.most_active == 1
    assert 300 <= u["total_tokens"] <= 300 + one_call, u
    assert sorted(r.status_code for r in replies) == [200] * 3 + [402] * 5
    # Capped calls run beside each other as far as their caps fit, never further.
    gw.set_budget("s1", tokens=u["total_tokens"] + 400)
    provider.most_active = 0
    replies = await burst(port, [dict(chat_body(f"capped {i}", model="test-model"),
                                      max_tokens=100) for i in range(8)])
    # about 25 prompt + 100 reserved each: three fit in 400, not four
    assert provider.most_active == 3
    spent = gw.usage("s1")["total_tokens"] - u["total_tokens"]
    assert 400 <= spent <= 400 + one_call, spent
    # And in USD: each reserved at its prompt and its cap, at the model's prices.
    gw.set_budget("s1", usd=gw.usage("s1")["cost_usd"] + 0.5)
    provider.most_active = 0
    before = gw.usage("s1")["cost_usd"]
    replies = await burst(port, [dict(chat_body(f"usd {i}", model="test-model"),
                                      max_tokens=100) for i in range(8)])
    # 25 x 1000 + 100 x 2000 per 1M = 0.225 USD reserved each: two fit in 0.5
    assert provider.most_active == 2
    call_usd = (2 * 1000 + 100 * 2000) / 1e6
    assert 0.5 <= gw.usage("s1")["cost_usd"] - before <= 0.5 + call_usd + 1e-9


# --- F4: slow and idle clients -----------------------------------------------------------------


async def open_raw(port: int, data: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(data)
    return stream


async def read_all(stream: trio.SocketStream) -> bytes:
    got = b""
    while chunk := await stream.receive_some(65536):
        got += chunk
    return got


HALF_A_BODY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
               b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"model\": ")


async def test_slow_or_idle_clients_are_timed_out_and_counted_against_a_limit(
        gw, store, ledger, provider, nursery):
    """QA F4: no timeout on a request's body and no limit of connections: a client that never
    finished its body held its connection for ever, and enough of them exhausted the file
    descriptors. Now the body has read_timeout (408), a connection with no request under way
    is closed after min(5 s, read_timeout), and past max_connections requests being read or
    answered a new one gets 503 at once."""
    gw.read_timeout, gw.max_connections = 0.5, 2  # as Gateway(read_timeout=, max_connections=)
    port = await nursery.start(gw.serve_session, "s1")
    with trio.fail_after(5):
        slow = await open_raw(port, HALF_A_BODY)
        answer = await read_all(slow)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"type": "request_timeout"' in answer
    await slow.aclose()
    with trio.fail_after(5):  # nothing at all, or headers never ended: closed
        for start in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"):
            idle = await open_raw(port, start)
            assert await read_all(idle) == b""
            await idle.aclose()
    assert provider.requests == []
    # The limit: two requests under way (their bodies not yet whole), a third is refused.
    gw.read_timeout = 30.0
    held = [await open_raw(port, HALF_A_BODY) for _ in range(2)]
    with trio.fail_after(5):
        while gw.open_requests < 2:
            await trio.sleep(0.01)
    r = await call(port, chat_body("a third", model="test-model"))
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "too_many_connections" and "limit (2)" in err["message"]
    for stream in held:
        await stream.aclose()
    with trio.fail_after(5):
        while gw.open_requests:
            await trio.sleep(0.01)
    assert (await call(port, chat_body("a third", model="test-model"))).status_code == 200
    assert provider.count() == 1
    from ksfs.errors import BadInput

    for bad in ({"read_timeout": 0}, {"read_timeout": float("nan")}, {"max_connections": 0}):
        with pytest.raises(BadInput):
            Gateway(store, ledger, provider.url, **bad)


# --- F6: the daemon tries a busy port again ----------------------------------------------------


class Targets:
    """The keeper's face GatewaySupervisor uses: the sessions to serve, with port and token."""

    def __init__(self, targets: dict[str, tuple[int, str]]) -> None:
        self.targets = targets

    def gateway_targets(self) -> dict[str, tuple[int, str]]:
        return dict(self.targets)


async def test_the_daemon_serves_a_gateway_whose_port_was_busy_once_it_is_free(gw, provider,
                                                                              nursery):
    """QA F6: a session's port in use when the daemon started was never tried again: its guest
    had no gateway for as long as the daemon ran. Now it is tried again with a backoff, and
    the session's usage says why it is not served meanwhile."""
    import socket

    from ksfs.daemon.gateways import GatewaySupervisor

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    try:
        # started once the first attempt found the port taken, and said so
        await nursery.start(GatewaySupervisor(Targets({"s1": (port, "tok")}), gw).run)
        assert (gw.usage("s1").get("server") or {}).get("problem")
        await trio.sleep(0.5)  # and a retry or two
        assert "s1" not in gw.ports
        said = gw.usage("s1").get("server")
    finally:
        squatter.close()
    with trio.fail_after(10):
        while gw.ports.get("s1") != port:
            await trio.sleep(0.05)
    r = await call(port, chat_body("served at last", model="test-model"),
                   headers={"authorization": "Bearer tok"})
    assert r.status_code == 200
    assert said is not None and said["listening"] is False, said
    assert f"port {port} could not be bound" in said["problem"], said
    assert "trying again in" in said["problem"]
    assert gw.usage("s1")["server"] == {"listening": True, "port": port, "problem": None}


async def test_a_new_sessions_gateway_listens_when_the_verb_asks(gw, provider, nursery,
                                                                 monkeypatch):
    """Thirty-fourth session: the gateway of a session made while mounted started on the
    supervisor's next poll, so a fork's guest could run before its gateway listened. The
    supervisor is started with its first sessions listening, and a verb's thread that asks
    (``listening_now``, the keeper's gateway_watcher) returns once the new one listens. The
    poll is made too long to help here."""
    import socket

    from ksfs.daemon import gateways
    from ksfs.daemon.gateways import GatewaySupervisor

    monkeypatch.setattr(gateways, "POLL_S", 600.0)

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    first, second = free_port(), free_port()
    targets = Targets({"s1": (first, "tok1")})
    supervisor = GatewaySupervisor(targets, gw)
    supervisor.listening_now()  # not started yet: returns at once
    await nursery.start(supervisor.run)
    assert gw.ports == {"s1": first}  # listening when started, not a poll later
    targets.targets["s2"] = (second, "tok2")
    with trio.fail_after(10):
        await trio.to_thread.run_sync(supervisor.listening_now)
    assert gw.ports.get("s2") == second, gw.ports
    r = await call(second, chat_body("served at once", model="test-model"),
                   headers={"authorization": "Bearer tok2"})
    assert r.status_code == 200
    supervisor.listening_now()  # on trio's own thread: returns, does not deadlock
    del targets.targets["s1"]  # a removed session's server is stopped by the next pass
    with trio.fail_after(10):
        await trio.to_thread.run_sync(supervisor.listening_now)
        while "s1" in gw.ports:  # (cancelled by the pass; its server takes a moment to close)
            await trio.sleep(0.02)
    assert gw.ports == {"s2": second}


async def test_a_server_that_ends_is_started_again_without_stopping_the_supervisor(nursery):
    """Review (thirty-fourth session): the supervisor's start of a session's server now waits
    for its first bind, and a server that ended and was started again said "started" a second
    time, which trio refuses (RuntimeError): the supervisor, and the mount with it, would
    have stopped. A server that ends is started again, as before."""
    from ksfs.daemon.gateways import GatewaySupervisor

    class EndingGateway:
        def __init__(self) -> None:
            self.starts = 0

        async def serve_session(self, session, port, token,
                                task_status=trio.TASK_STATUS_IGNORED):
            self.starts += 1
            task_status.started(port)
            await trio.sleep(0.05)  # then ends, with no error

    gateway = EndingGateway()
    await nursery.start(GatewaySupervisor(Targets({"s1": (1, "tok")}), gateway).run)
    with trio.fail_after(10):
        while gateway.starts < 3:
            await trio.sleep(0.05)


# --- F12: a second signal under a stream -------------------------------------------------------


def test_a_second_signal_ends_a_stream_with_an_error_event(served, provider):
    """QA F12: a second SIGTERM stopped `ksfs gateway serve` at once, and a stream in flight
    was cut off with no final event: its guest could not tell a cut from an end. Now it ends
    with the gateway's error event, and the body ends cleanly."""
    import signal

    from test_gateway_cli import read_line

    store, port, proc = served
    provider.chunk_delay = 0.4  # nine events: over 3 s
    got: list[bytes] = []
    failed: list[BaseException] = []
    first = threading.Event()

    def stream() -> None:
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False,
                              timeout=30) as c, \
                    c.stream("POST", CHAT, json=chat_body("stop me", stream=True)) as r:
                for piece in r.iter_bytes():
                    got.append(piece)
                    first.set()
        except BaseException as exc:  # noqa: BLE001 - said by the test below
            failed.append(exc)
        first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(15)
    proc.send_signal(signal.SIGTERM)
    assert "waiting up to" in read_line(proc, time.monotonic() + 10)
    proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert proc.wait(30) == 0
    assert failed == [], failed
    body = b"".join(got)
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), body
    assert json.loads(last[6:])["error"]["type"] == "gateway_stopping", body
    assert b"[DONE]" not in body


# --- F7: kill -9 under a call ------------------------------------------------------------------


def test_a_call_in_flight_when_the_gateway_is_killed_is_counted_at_the_next_start(
        tmp_path, served, provider):
    """QA F7: kill -9 of the gateway mid-call lost the spend record: the provider had the call
    (and bills it), and no usage, event or budget ever saw it. Now each purchase is recorded,
    with what it is reserved at, before it is sent, and the next gateway to start on the store
    counts it (gateway.call, error gateway_lost), so a budget holds across a crash."""
    import os
    import signal
    import subprocess

    from test_gateway_cli import KSFS, ksfs, read_line

    from ksfs.cas import ChunkStore
    from ksfs.gateway import GatewayStore
    from ksfs.ledger import Ledger

    store, port, proc = served
    provider.delay = 30
    body = dict(chat_body("bought, then killed", model="gpt-4o-mini"), max_tokens=100)
    failed: list[BaseException] = []

    def post() -> None:
        try:
            post_raw(port, body)
        except httpx.HTTPError as exc:  # the gateway is killed under it
            failed.append(exc)

    t = threading.Thread(target=post)
    t.start()
    deadline = time.monotonic() + 15
    while provider.active == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert provider.active == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    t.join(15)
    assert len(failed) == 1
    before = json.loads(ksfs(store, "usage", "default", "--json").stdout)
    assert before["paid_calls"] == 0  # nothing counted yet: the process that knew is gone
    env = dict(os.environ)
    again = subprocess.Popen(
        KSFS + ["--store", str(store), "gateway", "serve", "--upstream", provider.url,
                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)
    try:
        assert "ksfs gateway: session default on" in read_line(again, time.monotonic() + 30)
        u = json.loads(ksfs(store, "usage", "default", "--json").stdout)
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(15) == 0
        again.stdout.close()
        again.stderr.close()
    prompt = len(provider.requests[0].body) // 4  # the request as sent, a token per 4 bytes
    assert (u["paid_calls"], u["upstream_errors"]) == (1, 1), u
    assert (u["prompt_tokens"], u["completion_tokens"]) == (prompt, 100), u
    assert u["cost_usd"] == pytest.approx((prompt * 0.15 + 100 * 0.60) / 1e6)
    with ChunkStore.open(store) as s:
        led = Ledger(s)
        [e] = [e for e in led.events("default") if e.type == "gateway.call"]
        assert e.body["error"] == "gateway_lost" and e.body["stored"] is False
        assert e.body["usage_known"] is False and e.body["reserved"] is True
        assert led.verify() == [] and s.check().ok
        # Counted once: nothing is left recorded for a third start to count again.
        assert GatewayStore(s, led).pending() == []
    assert provider.count() == 1


def post_raw(port: int, body: dict) -> httpx.Response:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=30) as c:
        return c.post(CHAT, json=body)


async def test_two_gateways_on_one_store_see_each_others_calls_in_flight(
        store, ledger, provider, prices_file, nursery):
    """QA F2, the rest of it: the gate was per process, so the daemon and a standalone gateway
    on one store each spent up to the budget beside the other. Each now counts what the other
    recorded in flight (GatewayStore.begin_purchase) as in flight too."""
    gws = [Gateway(store, ledger, provider.url, prices_file, api_key=MARKER_KEY, timeout=10)
           for _ in range(2)]
    ports = [await nursery.start(g.serve_session, "s1") for g in gws]
    gws[0].set_budget("s1", tokens=300)
    provider.words = ["long"] * 100  # 2 + 100 tokens a call; reserved at 4096 uncapped
    provider.delay = 1.0
    replies: list[httpx.Response] = []

    async def one(port: int, text: str) -> None:
        replies.append(await call(port, chat_body(text, model="test-model")))

    async with trio.open_nursery() as calls:
        calls.start_soon(one, ports[0], "first, through one")
        with trio.fail_after(5):
            while provider.active == 0:
                await trio.sleep(0.01)
        # The other gateway's call waits for the first to land, then goes: 102 + 102 < 300.
        calls.start_soon(one, ports[1], "second, through the other")
        await trio.sleep(0.5)
        assert provider.active == 1 and provider.count() == 1
    assert [r.status_code for r in replies] == [200, 200]
    assert provider.most_active == 1 and provider.count() == 2
    # Nothing is left recorded in flight once both landed.
    assert gws[0].db.pending() == [] and gws[1].db.reserved_elsewhere(
        ledger.session("s1").lineage) == (0, 0, 0.0, 0)


def _dead_owner() -> dict:
    """The owner record of a process that has exited (and was reaped)."""
    import subprocess

    from ksfs.gateway import store as gwstore

    child = subprocess.Popen(["true"])
    child.wait()
    return {"pid": child.pid, "start": 1, "boot": gwstore._boot_id()}


async def test_a_lost_record_is_counted_before_the_next_call_is_admitted(
        store, ledger, provider, prices_file, nursery, monkeypatch):
    """Review of 77f4122/5081c60: a record a dead gateway left was settled in the background
    while the call that met it went through alone, so spending ended past the budget (6110 of
    5000 tokens) and only the next call was refused. It is counted first: that call is 402."""
    from ksfs.gateway import store as gwstore

    gw = Gateway(store, ledger, provider.url, prices_file, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", tokens=5000)
    other = type(gw.db)(store, ledger)  # another gateway on the store, then killed
    owner = _dead_owner()
    monkeypatch.setattr(gwstore, "_this_process", lambda: owner)
    lineage = ledger.session("s1").lineage
    other.begin_purchase("s1", lineage, b"k" * 32, "test-model", CHAT, 100, 6000, 0.0, True)
    monkeypatch.undo()
    r = await call(port, dict(chat_body("after the lost one", model="test-model"),
                              max_tokens=50))
    assert r.status_code == 402, r.text
    assert provider.count() == 0
    u = gw.usage("s1")
    assert u["paid_calls"] == 1 and u["prompt_tokens"] + u["completion_tokens"] == 6100, u
    assert gw.db.pending() == []


async def test_a_call_held_back_by_a_stuck_gateways_record_is_answered_429_in_time(
        store, ledger, provider, prices_file, nursery):
    """Review of 77f4122: a record of a live but stuck gateway (SIGSTOPped, or one whose
    settle failed) held a call that does not fit beside it back for ever, polled every 0.25 s
    with no answer. It waits admission_wait, then 429 naming the other gateway's pid."""
    import os

    gw = Gateway(store, ledger, provider.url, prices_file, api_key=MARKER_KEY, timeout=10,
                 admission_wait=1.0)
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", tokens=5000)
    other = type(gw.db)(store, ledger)  # another gateway on the store: this process, stuck
    lineage = ledger.session("s1").lineage
    other.begin_purchase("s1", lineage, b"k" * 32, "test-model", CHAT, 100, 4950, 0.0, True)
    body = dict(chat_body("held back", model="test-model"), max_tokens=50)
    with trio.fail_after(8):
        r = await call(port, body)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "held_back_by_calls_in_flight" and err["holders"] == [os.getpid()]
    assert str(os.getpid()) in err["message"]
    assert r.headers["x-ksfs-replay"] == "refused" and r.headers["x-ksfs-key"]
    assert provider.count() == 0


async def test_a_call_held_back_whose_guest_hung_up_is_never_bought(
        store, ledger, provider, prices_file, nursery):
    """A request queued in admission whose client disconnected was bought once room came."""
    gw = Gateway(store, ledger, provider.url, prices_file, api_key=MARKER_KEY, timeout=10,
                 admission_wait=30.0)
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", tokens=5000)
    other = type(gw.db)(store, ledger)
    lineage = ledger.session("s1").lineage
    purchase = other.begin_purchase("s1", lineage, b"k" * 32, "test-model", CHAT, 100, 4950,
                                    0.0, True)
    body = dict(chat_body("hung up", model="test-model"), max_tokens=50)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False,
                                 timeout=0.6) as c:
        with pytest.raises(httpx.TimeoutException):
            await c.post(CHAT, json=body)
    with trio.fail_after(10):  # the gateway has seen the hang-up and let the request go
        while gw.open_requests:
            await trio.sleep(0.01)
    with other.env.begin(write=True) as txn:  # the other gateway's call ends, uncounted
        from ksfs.ledger.keys import lineage_bytes
        assert txn.delete(lineage_bytes(lineage) + b"k" * 32 + purchase, db=other._pending)
    await trio.sleep(1.0)  # past a few polls: room now
    assert provider.count() == 0
    assert gw.usage("s1")["paid_calls"] == 0


def _post_head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
            b"\r\nConnection: close\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n")


async def test_a_steady_slow_body_is_read_and_a_trickle_still_ends(
        gw, store, ledger, provider, nursery):
    """Review of 8e90d0d: the read timeout bounded the whole body, so a steady slow upload was
    cut (3 KB in 20 pieces over 2.3 s with read_timeout=2: 408; 16 MiB needed 280 KB/s). It is
    now a stall timeout: no byte for read_timeout; the whole body is bound by the body limit
    at MIN_BODY_RATE, so a trickle still ends."""
    gw.read_timeout = 0.5
    port = await nursery.start(gw.serve_session, "s1")
    body = json.dumps(chat_body("slow " * 600, model="test-model")).encode()
    assert len(body) > 3000
    with trio.fail_after(10):
        stream = await open_raw(port, _post_head(len(body)))
        step = len(body) // 20 + 1
        for i in range(0, len(body), step):  # 20 pieces over about 1.2 s: > read_timeout
            await trio.sleep(0.06)
            await stream.send_all(body[i:i + step])
        answer = await read_all(stream)
    await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert provider.count() == 1
    # A trickle: a byte every 0.2 s never stalls, but the whole body has its bound.
    from ksfs.gateway.app import body_deadline

    gw.max_body = 4096
    assert body_deadline(gw.read_timeout, gw.max_body) == 0.75
    with trio.fail_after(10):
        stream = await open_raw(port, _post_head(200))
        got = b""
        with trio.move_on_after(5):
            async with trio.open_nursery() as n:
                async def trickle() -> None:
                    for _ in range(40):
                        await trio.sleep(0.2)
                        try:
                            await stream.send_all(b" ")
                        except trio.BrokenResourceError:
                            return

                n.start_soon(trickle)
                got = await read_all(stream)
                n.cancel_scope.cancel()
    await stream.aclose()
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert provider.count() == 1


async def test_one_session_cannot_take_every_connection(gw, store, ledger, provider, nursery):
    """Review of 8e90d0d: max_connections counts the requests of every session of a gateway,
    so one guest's slow bodies (4 of max_connections=4) made every other session's call a
    503. A session may hold all but a quarter of them while others are served."""
    gw.read_timeout, gw.max_connections = 30.0, 4
    port1 = await nursery.start(gw.serve_session, "s1")
    port2 = await nursery.start(gw.serve_session, "s2")
    held = [await open_raw(port1, HALF_A_BODY) for _ in range(4)]
    try:
        with trio.fail_after(5):
            while gw.open_requests < 3:
                await trio.sleep(0.01)
        await trio.sleep(0.2)
        r = await call(port2, chat_body("the other session", model="test-model"))
        assert r.status_code == 200, r.text
        assert gw.open_by_session["s1"] == 3 and gw.session_connections() == 3
        r = await call(port1, chat_body("past its share", model="test-model"))
        assert r.status_code == 503 and "its share (3 of 4)" in r.json()["error"]["message"]
    finally:
        for stream in held:
            await stream.aclose()
    with trio.fail_after(5):
        while gw.open_requests:
            await trio.sleep(0.01)
    assert gw.open_by_session == {}
    assert provider.count() == 1
