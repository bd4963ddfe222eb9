"""Prompt-cache tokens priced at the table's cache prices, over real sockets.

Cached prompt tokens were counted as prompt tokens at the input price: OpenAI's
``prompt_tokens_details.cached_tokens`` (a part of the prompt, billed at a discount) was not told
apart, and Anthropic's ``cache_read_input_tokens`` (about 0.1x input) and
``cache_creation_input_tokens`` (about 1.25x) were priced as input, so a USD budget was charged
wrongly. ``ScriptedProvider`` here answers every POST with the bytes it is given (an Anthropic
``/v1/messages`` answer or stream, a Responses answer), on the standard library's http.server as
``fake_provider.py`` is, so the gateway is never tested against its own stack.
"""

from __future__ import annotations

import json

import pytest
import test_gateway_helpers as helpers
import trio
from test_gateway_cli import ksfs  # `ksfs ...` in a subprocess
from test_gateway_helpers import (
    MARKER_KEY,
    PRICES,
    QuietHandler,
    ThreadedProvider,
    call,
    chat_body,
    check_clean,
    client,
    events,
)

from ksfs.cas import ChunkStore
from ksfs.errors import BadInput
from ksfs.gateway import Gateway, load_prices, parse_prices, read_usage
from ksfs.ledger import Ledger
from ksfs.ledger.keys import lineage_bytes

# cache-model: input $1000, output $2000, a cache read $100 and a cache write $1250 per 1M
# tokens (0.1x and 1.25x input, as Anthropic bills them); test-model (PRICES) has no cache
# prices, so its cached tokens cost its input price.
CACHE_PRICES = PRICES + """
[models."cache-model"]
input = 1000.0
output = 2000.0
cache_read = 100.0
cache_write = 1250.0
"""
# An OpenAI usage of 1000 prompt tokens, 800 of them read from the cache, and 10 completion:
# cost = (200 * 1000 + 800 * 100 + 10 * 2000) / 1e6 = 0.3 USD (1.02 at the input price).
OPENAI_USAGE = {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010,
                "prompt_tokens_details": {"cached_tokens": 800, "audio_tokens": 0}}
OPENAI_USD, OPENAI_AT_INPUT = 0.3, 1.02
# An Anthropic usage: 100 input tokens besides 3000 read from the cache and 400 written to it,
# 50 output: (100 * 1000 + 3000 * 100 + 400 * 1250 + 50 * 2000) / 1e6 = 1.0 USD
# (3.6 with every prompt token at the input price).
ANTHROPIC_USAGE = {"input_tokens": 100, "cache_read_input_tokens": 3000,
                   "cache_creation_input_tokens": 400, "output_tokens": 50}
ANTHROPIC_USD, ANTHROPIC_AT_INPUT = 1.0, 3.6
MESSAGES = "/v1/messages"
# The shared fixtures, by name (assigned, not imported by name: ruff would read each test's
# parameter of that name as an unused import redefined).
upstream, provider = helpers.upstream, helpers.provider
store, ledger = helpers.store, helpers.ledger


class ScriptedProvider(ThreadedProvider):
    """Answers every POST with ``answer``: (content type, body); a text/event-stream body goes
    out chunked, one event at a time. Counts what it was asked in ``count``."""

    def __init__(self) -> None:
        self.answer: tuple[str, bytes] = ("application/json", b"{}")
        self.count = 0
        provider = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                provider.count += 1
                ctype, body = provider.answer
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                if not ctype.startswith("text/event-stream"):
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in body.split(b"\n\n"):
                    if event:
                        piece = event + b"\n\n"
                        self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self._serve(Handler)


@pytest.fixture
def scripted():
    with ScriptedProvider() as up:
        yield up


@pytest.fixture
def table():
    return parse_prices(CACHE_PRICES, "test")


@pytest.fixture
def gw(store, ledger, provider, table):
    return Gateway(store, ledger, provider.url, table, api_key=MARKER_KEY, timeout=10)


def anthropic_json(model: str) -> bytes:
    return json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": model,
                       "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                       "usage": ANTHROPIC_USAGE}).encode()


def anthropic_stream(model: str) -> bytes:
    return helpers.anthropic_stream(model, dict(ANTHROPIC_USAGE, output_tokens=1),
                                    ANTHROPIC_USAGE["output_tokens"])


async def post(port: int, path: str, body: dict) -> int:
    async with client(port) as c:
        r = await c.post(path, content=json.dumps(body),
                         headers={"content-type": "application/json"})
    return r.status_code


def only_call(ledger: Ledger, session: str = "s1") -> dict:
    (ev,) = events(ledger, session, "gateway.call")
    return ev.body


# --- OpenAI: cached_tokens, a part of the prompt -------------------------------------------------


async def test_openai_cached_tokens_are_priced_at_the_cache_read_price(gw, ledger, provider,
                                                                        nursery):
    port = await nursery.start(gw.serve_session, "s1")
    provider.usage_as = OPENAI_USAGE
    assert (await call(port, chat_body("cached", model="cache-model"))).status_code == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(OPENAI_USD, abs=1e-12), u
    # the prompt still counts its cached tokens: totals keep their meaning
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (1000, 10, 1010)
    assert (u["cache_read_tokens"], u["cache_write_tokens"]) == (800, 0)
    m = u["by_model"]["cache-model"]
    assert (m["cache_read_tokens"], m["cache_write_tokens"], m["prompt_tokens"]) == (800, 0, 1000)
    ev = only_call(ledger)
    assert (ev["cache_read_tokens"], ev["cache_write_tokens"]) == (800, 0), ev
    assert ev["cost_usd"] == pytest.approx(OPENAI_USD, abs=1e-12)


async def test_an_openai_stream_s_cached_tokens_are_priced_at_the_cache_read_price(
        gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    provider.usage_as = OPENAI_USAGE  # in the stream's final usage chunk
    r = await call(port, chat_body("cached stream", model="cache-model", stream=True))
    assert r.status_code == 200 and b"[DONE]" in r.content
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(OPENAI_USD, abs=1e-12), u
    assert (u["prompt_tokens"], u["cache_read_tokens"], u["cache_write_tokens"]) == (1000, 800, 0)
    assert only_call(ledger)["stream"] is True


async def test_a_responses_call_s_cached_tokens_are_priced_at_the_cache_read_price(
        store, ledger, table, scripted, nursery):
    """The Responses API says input_tokens and input_tokens_details.cached_tokens."""
    usage = {"input_tokens": 1000, "input_tokens_details": {"cached_tokens": 800},
             "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 1010}
    scripted.answer = ("application/json", json.dumps({
        "id": "resp_1", "object": "response", "status": "completed", "model": "cache-model",
        "output": [], "usage": usage}).encode())
    gw = Gateway(store, ledger, scripted.url, table, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    assert await post(port, "/v1/responses", {"model": "cache-model", "input": "hi"}) == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(OPENAI_USD, abs=1e-12), u
    assert (u["prompt_tokens"], u["cache_read_tokens"]) == (1000, 800)


# --- Anthropic: cache tokens besides input_tokens ------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
async def test_anthropic_cache_reads_and_writes_are_priced_at_the_cache_prices(
        store, ledger, table, scripted, nursery, streamed):
    scripted.answer = (("text/event-stream", anthropic_stream("cache-model")) if streamed
                       else ("application/json", anthropic_json("cache-model")))
    gw = Gateway(store, ledger, scripted.url, table, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = {"model": "cache-model", "max_tokens": 100, "stream": streamed,
            "messages": [{"role": "user", "content": "hi"}]}
    assert await post(port, MESSAGES, body) == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(ANTHROPIC_USD, abs=1e-12), u
    # prompt = input + cache read + cache write, as before
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (3500, 50, 3550)
    assert (u["cache_read_tokens"], u["cache_write_tokens"]) == (3000, 400)
    ev = only_call(ledger)
    assert (ev["cache_read_tokens"], ev["cache_write_tokens"]) == (3000, 400), ev
    assert ev["stream"] is streamed and ev["usage_known"] is True
    assert await post(port, MESSAGES, body) == 200 and scripted.count == 1  # replayed


# --- a model without cache prices: cached tokens at its input price, as before -------------------


async def test_a_model_without_cache_prices_charges_cached_tokens_at_input(
        store, ledger, table, provider, scripted, nursery):
    gw = Gateway(store, ledger, provider.url, table, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    provider.usage_as = OPENAI_USAGE
    assert (await call(port, chat_body("cached", model="test-model"))).status_code == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(OPENAI_AT_INPUT, abs=1e-12), u
    assert u["cache_read_tokens"] == 800  # counted apart all the same

    scripted.answer = ("application/json", anthropic_json("test-model"))
    other = Gateway(store, ledger, scripted.url, table, api_key=MARKER_KEY, timeout=10)
    port2 = await nursery.start(other.serve_session, "s2")
    assert await post(port2, MESSAGES, {"model": "test-model", "max_tokens": 100,
                                        "messages": [{"role": "user", "content": "hi"}]}) == 200
    u2 = other.usage("s2")
    assert u2["cost_usd"] == pytest.approx(ANTHROPIC_AT_INPUT, abs=1e-12), u2
    assert (u2["cache_read_tokens"], u2["cache_write_tokens"]) == (3000, 400)
    # and the table says what it has: no cache prices, not a guessed discount
    p = table.price("test-model")
    assert (p.cache_read, p.cache_write) == (None, None)


# --- the price table ----------------------------------------------------------------------------


def test_cache_prices_in_the_table_are_read_and_checked(table):
    p = table.price("cache-model")
    assert (p.input, p.output, p.cache_read, p.cache_write) == (1000.0, 2000.0, 100.0, 1250.0)
    # cached parts of a prompt; a part past the prompt is no part of it (the rest at input)
    assert table.cost("cache-model", 1000, 10, cache_read_tokens=800) == (
        pytest.approx(OPENAI_USD, abs=1e-12), True)
    assert table.cost("cache-model", 100, 0, cache_read_tokens=500)[0] == pytest.approx(0.01)
    assert table.cost("test-model", 1000, 10, cache_read_tokens=800)[0] == pytest.approx(
        OPENAI_AT_INPUT)
    head = '[models."m"]\ninput = 1\noutput = 2\n'
    for bad, field in ((head + "cache_read = -1\n", "cache_read"),
                       (head + 'cache_read = "cheap"\n', "cache_read"),
                       (head + "cache_write = true\n", "cache_write"),
                       (head + "cache_write = inf\n", "cache_write"),
                       (head + "cache_read = nan\n", "cache_read")):
        with pytest.raises(BadInput) as info:
            parse_prices(bad, "bad.toml")
        said = str(info.value)
        assert f"models.m.{field} must be a number >= 0" in said and "\n" not in said, said
    # a mistyped field is refused, not passed over (cached tokens would cost the input price)
    with pytest.raises(BadInput) as info:
        parse_prices(head + "cached_input = 0.5\n", "bad.toml")
    assert "models.m has no field 'cached_input'" in str(info.value), info.value
    zero = parse_prices(head + "cache_read = 0\ncache_write = 0\n").price("m")
    assert (zero.cache_read, zero.cache_write) == (0.0, 0.0)  # free is a price, not "none"
    # the shipped table: OpenAI's published cached-input prices, no write price (OpenAI bills
    # none), and none at all for models without a cached-input price
    shipped = load_prices()
    assert (shipped.price("gpt-4o-mini").cache_read, shipped.price("gpt-4o-mini").cache_write) \
        == (0.075, None)
    assert shipped.price("gpt-4o-2024-08-06").cache_read == 1.25
    assert shipped.price("gpt-4").cache_read is None


def test_bad_cache_price_stops_gateway_serve_with_one_line(tmp_path):
    bad = tmp_path / "prices.toml"
    bad.write_text('[models."m"]\ninput = 1\noutput = 2\ncache_write = -1.25\n')
    fresh = tmp_path / "fresh"
    res = ksfs(fresh, "gateway", "serve", "--upstream", "http://127.0.0.1:9",
               "--prices", str(bad), check=False)
    assert res.returncode == 2, res
    assert res.stderr.count("\n") == 1 and "models.m.cache_write" in res.stderr, res.stderr
    assert not fresh.exists()


def test_a_reservation_is_never_below_the_cost_of_a_cache_write(table):
    """A prompt written to the cache costs more than input (1.25x here): a purchase reserved
    at the input price could cost more than its reservation."""
    r, priced = table.reservation("cache-model", 1000, 10)
    assert priced and r == pytest.approx((1000 * 1250 + 10 * 2000) / 1e6)
    for prompt, read, write, completion in ((1000, 0, 1000, 10), (1000, 500, 500, 0),
                                            (1000, 1000, 0, 10), (7, 3, 9, 1)):
        cost, _ = table.cost("cache-model", prompt, completion, cache_read_tokens=read,
                             cache_write_tokens=write)
        assert cost <= table.reservation("cache-model", prompt, completion)[0]
    assert table.reservation("test-model", 1000, 10) == table.cost("test-model", 1000, 10)
    assert table.reservation("no-such-model", 1000, 10) == (0.0, False)
    # a table whose cache read is dearer than input (its mistake) is still reserved above
    # the cost (review of c7b92ba: 0.001 reserved, 0.005 spent)
    odd = parse_prices('[models."m"]\ninput = 1\noutput = 1\ncache_read = 5\n')
    assert odd.cost("m", 1000, 0, cache_read_tokens=1000)[0] <= odd.reservation("m", 1000, 0)[0]


async def test_a_purchase_in_flight_is_reserved_at_the_cache_write_price(gw, provider,
                                                                          nursery):
    port = await nursery.start(gw.serve_session, "s1")
    provider.delay = 1.0
    body = dict(chat_body("reserve me", model="cache-model"), max_tokens=10)
    prompt = len(json.dumps(body)) // 4  # as the gateway reckons a request (one token / 4 B)
    nursery.start_soon(call, port, body)
    with trio.fail_after(5):
        while not (recs := gw.db.pending()):
            await trio.sleep(0.02)
    ((_, _, _, rec),) = recs
    assert rec["cost_usd"] == pytest.approx((prompt * 1250 + 10 * 2000) / 1e6), rec
    with trio.fail_after(10):
        while gw.db.pending():
            await trio.sleep(0.05)


# --- a USD budget ---------------------------------------------------------------------------------


async def test_a_usd_budget_is_charged_the_cached_price(gw, ledger, provider, nursery):
    """0.3 USD a call: a second call starts under a 0.5 USD budget (at the input price the
    first had cost 1.02 and the second was refused), and the third is refused."""
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", usd=0.5)
    provider.usage_as = OPENAI_USAGE
    assert (await call(port, chat_body("first", model="cache-model"))).status_code == 200
    assert (await call(port, chat_body("second", model="cache-model"))).status_code == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(2 * OPENAI_USD, abs=1e-12), u
    assert u["cache_read_tokens"] == 1600 and u["over_budget"] is True
    assert (await call(port, chat_body("third", model="cache-model"))).status_code == 402
    assert provider.count() == 2


# --- records from before cache tokens were counted ------------------------------------------------

OLD_TOTALS = {"by_model": {"cache-model": {"calls": 1, "completion_tokens": 7, "cost_usd": 0.017,
                                           "priced": True, "prompt_tokens": 3}},
              "completion_tokens": 7, "cost_usd": 0.017, "paid_calls": 1, "prompt_tokens": 3,
              "refused": 0, "replays": 0, "total_tokens": 10, "unknown_usage_calls": 0,
              "unpriced_calls": 0, "upstream_errors": 0}


def put_old_totals(store: ChunkStore, ledger: Ledger, session: str) -> None:
    """A gw_usage record as a gateway from before cache tokens were counted wrote it."""
    dbs = [store.env.open_db(name, create=True)
           for name in (b"gw_responses", b"gw_usage", b"gw_budgets")]
    with store.env.begin(write=True) as txn:
        txn.put(lineage_bytes(ledger.session(session).lineage),
                json.dumps(OLD_TOTALS).encode(), db=dbs[1])


async def test_an_old_usage_record_reads_and_counts_on(store, ledger, gw, provider, nursery):
    put_old_totals(store, ledger, "s1")
    u = read_usage(store, ledger, "s1")
    assert (u["paid_calls"], u["prompt_tokens"], u["cost_usd"]) == (1, 3, 0.017)
    assert (u["cache_read_tokens"], u["cache_write_tokens"]) == (0, 0)
    # one shape for scripts before the model's next call too (review of 2083af7)
    assert u["by_model"]["cache-model"]["cache_read_tokens"] == 0
    assert u["by_model"]["cache-model"]["cache_write_tokens"] == 0
    port = await nursery.start(gw.serve_session, "s1")
    provider.usage_as = OPENAI_USAGE
    assert (await call(port, chat_body("after", model="cache-model"))).status_code == 200
    u = gw.usage("s1")
    assert (u["paid_calls"], u["prompt_tokens"], u["cache_read_tokens"]) == (2, 1003, 800)
    assert u["cost_usd"] == pytest.approx(0.017 + OPENAI_USD, abs=1e-12)
    m = u["by_model"]["cache-model"]
    assert (m["calls"], m["prompt_tokens"], m["cache_read_tokens"], m["cache_write_tokens"]) \
        == (2, 1003, 800, 0)


def test_ksfs_usage_shows_an_old_record_and_the_cache_tokens(tmp_path):
    from ksfs.gateway import GatewayStore
    from ksfs.gateway.calls import Usage

    path = tmp_path / "store"
    with ChunkStore.open(path, create=True) as s:
        led = Ledger(s)
        with led.env.begin(write=True) as txn:
            led.create_session(txn, "s1")
        put_old_totals(s, led, "s1")
    human = ksfs(path, "usage", "s1").stdout
    assert "3 in, 7 out, 10 total" in human, human  # as before: no cache line to show
    assert json.loads(ksfs(path, "usage", "s1", "--json").stdout)["cache_read_tokens"] == 0
    with ChunkStore.open(path) as s:
        led = Ledger(s)
        used = Usage("cache-model", 3500, 50, 3550, known=True, cache_read_tokens=3000,
                     cache_write_tokens=400)
        GatewayStore(s, led).record_unstored_call("s1", led.session("s1").lineage,
                                                  b"k" * 32, used, 1.0, True, 200,
                                                  "not_an_answer")
    human = ksfs(path, "usage", "s1").stdout
    assert "3503 in (3000 read from the cache, 400 written to it), 57 out" in human, human
    u = json.loads(ksfs(path, "usage", "s1", "--json").stdout)
    assert (u["cache_read_tokens"], u["cache_write_tokens"]) == (3000, 400)
    with ChunkStore.open(path) as s:
        check_clean(s, Ledger(s))


# --- Anthropic's one-hour cache: writes at their own price ----------------------------------------

# hour-model: as cache-model, and a write to the one-hour cache at $2000 per 1M (2x input).
HOUR_PRICES = CACHE_PRICES + """
[models."hour-model"]
input = 1000.0
output = 2000.0
cache_read = 100.0
cache_write = 1250.0
cache_write_1h = 2000.0
"""
# ANTHROPIC_USAGE with its 400 written tokens split as Anthropic splits them: 100 kept five
# minutes, 300 an hour. (100 * 1000 + 3000 * 100 + 100 * 1250 + 300 * 2000 + 50 * 2000) / 1e6
# = 1.225 USD (1.0 with every write at the five-minute price).
HOUR_USAGE = dict(ANTHROPIC_USAGE, cache_creation={"ephemeral_5m_input_tokens": 100,
                                                   "ephemeral_1h_input_tokens": 300})
HOUR_USD = 1.225


@pytest.mark.parametrize("streamed", [False, True], ids=["json", "stream"])
async def test_anthropic_one_hour_cache_writes_are_priced_at_their_own_price(
        store, ledger, scripted, nursery, streamed):
    table = parse_prices(HOUR_PRICES, "test")
    if streamed:
        # a message_delta naming the split again with zeros (a later, partial figure) must not
        # wipe message_start's split: figures merge key by key, as the flat ones do
        stream = helpers.anthropic_stream("hour-model", dict(HOUR_USAGE, output_tokens=1),
                                          HOUR_USAGE["output_tokens"])
        stream = stream.replace(b'"usage": {"output_tokens": 50}', (
            b'"usage": {"output_tokens": 50, "cache_creation": '
            b'{"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}'))
        assert b"ephemeral_1h_input_tokens\": 0" in stream
        scripted.answer = ("text/event-stream", stream)
    else:
        scripted.answer = ("application/json", json.dumps({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "hour-model",
            "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
            "usage": HOUR_USAGE}).encode())
    gw = Gateway(store, ledger, scripted.url, table, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = {"model": "hour-model", "max_tokens": 100, "stream": streamed,
            "messages": [{"role": "user", "content": "hi"}]}
    assert await post(port, MESSAGES, body) == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == pytest.approx(HOUR_USD, abs=1e-12), u
    assert (u["prompt_tokens"], u["cache_read_tokens"], u["cache_write_tokens"],
            u["cache_write_1h_tokens"]) == (3500, 3000, 400, 300), u
    assert u["by_model"]["hour-model"]["cache_write_1h_tokens"] == 300
    ev = only_call(ledger)
    assert (ev["cache_write_tokens"], ev["cache_write_1h_tokens"]) == (400, 300), ev
    assert ev["cost_usd"] == pytest.approx(HOUR_USD, abs=1e-12)
    check_clean(store, ledger)


def test_one_hour_cache_price_in_the_table(table):
    hour = parse_prices(HOUR_PRICES, "test")
    p = hour.price("hour-model")
    assert (p.cache_write, p.cache_write_1h) == (1250.0, 2000.0)
    assert hour.cost("hour-model", 3500, 50, cache_read_tokens=3000, cache_write_tokens=400,
                     cache_write_1h_tokens=300)[0] == pytest.approx(HOUR_USD, abs=1e-12)
    # the one-hour part is a part of the writes: never more than they are
    assert hour.cost("hour-model", 1000, 0, cache_write_tokens=100,
                     cache_write_1h_tokens=500)[0] == pytest.approx(
        (900 * 1000 + 100 * 2000) / 1e6)
    # without cache_write_1h a one-hour write costs cache_write (as before the split was
    # read), and without either, input: never a guessed price
    assert table.cost("cache-model", 3500, 50, cache_read_tokens=3000, cache_write_tokens=400,
                      cache_write_1h_tokens=300)[0] == pytest.approx(ANTHROPIC_USD, abs=1e-12)
    assert table.cost("test-model", 1000, 0, cache_write_tokens=400,
                      cache_write_1h_tokens=300) == table.cost("test-model", 1000, 0)
    # a reservation covers a prompt written whole to the one-hour cache
    assert hour.reservation("hour-model", 1000, 10)[0] == pytest.approx(
        (1000 * 2000 + 10 * 2000) / 1e6)
    assert hour.cost("hour-model", 1000, 10, cache_write_tokens=1000,
                     cache_write_1h_tokens=1000)[0] <= hour.reservation("hour-model", 1000, 10)[0]
    with pytest.raises(BadInput) as info:
        parse_prices('[models."m"]\ninput = 1\noutput = 2\ncache_write_1h = -2\n', "bad.toml")
    assert "models.m.cache_write_1h must be a number >= 0" in str(info.value)


def test_usage_parses_the_one_hour_part_of_the_writes():
    from ksfs.gateway.calls import usage_from

    u = usage_from({"usage": HOUR_USAGE}, "m")
    assert (u.cache_write_tokens, u.cache_write_1h_tokens) == (400, 300)
    # a split past the writes it splits is no part of them; a split that is no object, none
    odd = dict(ANTHROPIC_USAGE, cache_creation={"ephemeral_1h_input_tokens": 9000})
    assert usage_from({"usage": odd}, "m").cache_write_1h_tokens == 400
    for bad in ([300], "300", {"ephemeral_1h_input_tokens": "300"},
                {"ephemeral_1h_input_tokens": -3}):
        assert usage_from({"usage": dict(ANTHROPIC_USAGE, cache_creation=bad)},
                          "m").cache_write_1h_tokens == 0
    assert usage_from({"usage": OPENAI_USAGE}, "m").cache_write_1h_tokens == 0


def test_ksfs_usage_says_the_one_hour_writes(tmp_path):
    from ksfs.gateway import GatewayStore
    from ksfs.gateway.calls import Usage

    path = tmp_path / "store"
    with ChunkStore.open(path, create=True) as s:
        led = Ledger(s)
        with led.env.begin(write=True) as txn:
            led.create_session(txn, "s1")
        put_old_totals(s, led, "s1")  # a record from before the one-hour part was counted
    assert json.loads(ksfs(path, "usage", "s1", "--json").stdout)["cache_write_1h_tokens"] == 0
    with ChunkStore.open(path) as s:
        led = Ledger(s)
        used = Usage("cache-model", 3500, 50, 3550, known=True, cache_read_tokens=3000,
                     cache_write_tokens=400, cache_write_1h_tokens=300)
        GatewayStore(s, led).record_unstored_call("s1", led.session("s1").lineage,
                                                  b"k" * 32, used, 1.0, True, 200,
                                                  "not_an_answer")
    human = ksfs(path, "usage", "s1").stdout
    assert ("3503 in (3000 read from the cache, 400 written to it, 300 of them for an hour)"
            in human), human
    u = json.loads(ksfs(path, "usage", "s1", "--json").stdout)
    assert (u["cache_write_tokens"], u["cache_write_1h_tokens"]) == (400, 300)
    assert u["by_model"]["cache-model"]["cache_write_1h_tokens"] == 300
