"""Usage, cost, budgets, upstream failures and the API key's secrecy, over real sockets."""

from __future__ import annotations

import json
import logging
import os
import socket

import pytest
import trio
from test_gateway_helpers import (  # with the shared fixtures, by name
    MARKER_KEY,
    PRICES,
    call,
    chat_body,
    client,
    events,
    ledger,
    provider,
    store,
    upstream,
)

from ksfs.errors import BadInput
from ksfs.gateway import Gateway, load_prices, parse_prices


@pytest.fixture
def prices_file(tmp_path):
    p = tmp_path / "prices.toml"
    p.write_text(PRICES)
    return p


@pytest.fixture
def gw(store, ledger, provider, prices_file):
    return Gateway(store, ledger, provider.url, prices_file, api_key=MARKER_KEY, timeout=10)


# --- prices -------------------------------------------------------------------------------------


def test_price_table_lookup_and_errors(prices_file):
    table = load_prices(prices_file)
    assert table.cost("test-model", 3, 7) == (pytest.approx(0.017), True)
    assert table.cost("test-model-2025-01-01", 1_000_000, 0) == (1000.0, True)
    assert table.cost("test-modelx", 10, 10) == (0.0, False)
    assert table.cost(None, 10, 10) == (0.0, False)
    default = load_prices()
    assert default.cost("gpt-4o-mini", 1_000_000, 1_000_000) == (pytest.approx(0.75), True)
    assert default.price("gpt-4o-2024-08-06") == default.price("gpt-4o")
    assert default.price("gpt-4o-mini-2024-07-18") == default.price("gpt-4o-mini")
    assert default.price("gpt-3.5-turbo-0125") == default.price("gpt-3.5-turbo")
    assert default.price("chatgpt-4o-latest") is None
    assert default.price("gpt-4o-latest") == default.price("gpt-4o")
    for model in ("o1", "o3", "o4-mini", "gpt-4-turbo", "gpt-3.5-turbo", "gpt-5"):
        assert default.price(model) is not None, model
    # Other models that only share a prefix have their own prices: not guessed.
    for model in ("gpt-4o-audio-preview", "gpt-4o-realtime-preview-2024-12-17",
                  "gpt-4o-mini-tts", "o3-pro"):
        assert default.price(model) is None, model
    for bad in ("not toml [", "[x]\n", '[models."m"]\ninput = -1\noutput = 1\n',
                '[models."m"]\ninput = "cheap"\noutput = 1\n'):
        with pytest.raises(BadInput):
            parse_prices(bad)
    with pytest.raises(BadInput):
        load_prices(prices_file.parent / "missing.toml")


# --- usage --------------------------------------------------------------------------------------


async def test_usage_counts_paid_calls_replays_and_cost(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    one = chat_body("one two three", model="test-model")  # 3 prompt + 7 completion tokens
    await call(port, one)
    await call(port, one)  # replay
    await call(port, chat_body("four five", model="test-model", stream=True))  # 2 + 7
    await call(port, chat_body("x", model="unpriced-model"))  # 1 + 7, no price
    provider.stream_usage = False
    no_usage = chat_body("no usage here", model="test-model", stream=True)
    await call(port, no_usage)  # counted at an estimate: its size, and its text's
    guessed = (len(json.dumps(no_usage)) // 4, len("this is the fake provider answering you ") // 4)
    u = gw.usage("s1")
    assert provider.count() == 4
    assert (u["paid_calls"], u["replays"], u["refused"], u["upstream_errors"]) == (4, 1, 0, 0)
    assert (u["prompt_tokens"], u["completion_tokens"]) == (3 + 2 + 1 + guessed[0],
                                                            7 * 3 + guessed[1])
    assert u["total_tokens"] == 6 + 21 + sum(guessed)
    assert u["cost_usd"] == pytest.approx(
        ((5 + guessed[0]) * 1000 + (14 + guessed[1]) * 2000) / 1e6)
    assert (u["unpriced_calls"], u["unknown_usage_calls"]) == (1, 1)
    assert u["by_model"]["unpriced-model"]["priced"] is False
    assert u["by_model"]["test-model"]["calls"] == 3
    assert u["budget"] is None and u["over_budget"] is False
    costs = [e.body["cost_usd"] for e in events(ledger, "s1", "gateway.call")]
    assert sum(costs) == pytest.approx(u["cost_usd"])
    assert gw.usage("s2")["paid_calls"] == 0


# --- budgets ------------------------------------------------------------------------------------


async def test_over_token_budget_is_refused_without_asking_upstream(gw, ledger, provider,
                                                                    nursery):
    gw.set_budget("s1", tokens=10)
    assert gw.budget("s1") == {"tokens": 10, "usd": None}
    port = await nursery.start(gw.serve_session, "s1")
    first = await call(port, chat_body("one two three", model="test-model"))  # uses 10
    assert first.status_code == 200
    r = await call(port, chat_body("something new", model="test-model"))
    assert r.status_code == 402
    err = r.json()["error"]
    assert err["type"] == "budget_exceeded" and err["session"] == "s1"
    assert err["budget"] == {"tokens": 10, "usd": None}
    assert err["used"]["tokens"] == 10 and "s1" in err["message"]
    assert provider.count() == 1
    (refused,) = events(ledger, "s1", "budget.refused")
    assert refused.body["budget"] == {"tokens": 10, "usd": None}
    # A stored call still replays over budget: it costs nothing.
    again = await call(port, chat_body("one two three", model="test-model"))
    assert again.status_code == 200 and again.content == first.content
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"], u["refused"]) == (1, 1, 1)
    assert u["over_budget"] is True and u["remaining"] == {"tokens": 0, "usd": None}
    gw.set_budget("s1", tokens=100)
    assert (await call(port, chat_body("something new", model="test-model"))).status_code == 200
    gw.set_budget("s1")  # no budget at all
    assert gw.budget("s1") is None
    assert [e.body for e in events(ledger, "s1", "budget.set")] == [
        {"tokens": 10, "usd": None}, {"tokens": 100, "usd": None},
        {"tokens": None, "usd": None}]


async def test_usd_budget(gw, provider, nursery):
    gw.set_budget("s1", usd=0.01)
    port = await nursery.start(gw.serve_session, "s1")
    assert (await call(port, chat_body("a b c", model="test-model"))).status_code == 200
    r = await call(port, chat_body("d e f", model="test-model"))  # 0.017 USD >= 0.01
    assert r.status_code == 402 and r.json()["error"]["budget"]["usd"] == 0.01
    assert provider.count() == 1
    with pytest.raises(BadInput):
        gw.set_budget("s1", tokens=-1)
    with pytest.raises(BadInput):
        gw.set_budget("s1", usd="lots")


async def burst(port: int, bodies: list[dict]) -> list:
    """Every body sent at once; the replies in the order they came."""
    replies = []

    async def one(body: dict) -> None:
        replies.append(await call(port, body))

    async with trio.open_nursery() as calls:
        for body in bodies:
            calls.start_soon(one, body)
    return replies


async def test_calls_larger_than_any_before_are_held_to_their_own_size(gw, ledger, provider,
                                                                         nursery):
    # QA (eighth session): sized by the largest completed call alone, a burst of long
    # prompts after one short call all started together and spent 12x the budget.
    gw.set_budget("s1", tokens=500)
    port = await nursery.start(gw.serve_session, "s1")
    assert (await call(port, chat_body("short", model="test-model"))).status_code == 200
    provider.delay = 0.3
    long_prompt = " ".join(["word"] * 250)  # ~1,300 bytes of JSON: reckoned ~330 tokens
    replies = await burst(port, [chat_body(f"{i} {long_prompt}", model="test-model")
                                 for i in range(6)])
    # 251 + 7 tokens each: the second starts only after the first is counted (8 + 2 x 330
    # reckoned > 500), then the budget is used up; without the reckoning all six were bought.
    assert sorted(r.status_code for r in replies) == [200] * 2 + [402] * 4
    assert provider.most_active == 1
    assert gw.usage("s1")["total_tokens"] == (1 + 7) + 2 * (251 + 7)
    # A completion cap counts too: at max_tokens 4000 two fit beside each other in 10,000.
    gw.set_budget("s1", tokens=10_000)
    provider.most_active = 0
    async with trio.open_nursery() as calls:
        for i in range(3):
            calls.start_soon(call, port, dict(chat_body(f"capped {i}", model="test-model"),
                                              max_tokens=4000))
    assert provider.most_active == 2


async def test_calls_in_flight_cannot_spend_past_the_budget_together(gw, ledger, provider,
                                                                     nursery):
    # Each call is 2 prompt + 7 completion = 9 tokens; 25 tokens leave room for 3 calls' worth
    # of starts, not 8. Without the gate all 8 start at once and all 8 are bought.
    gw.set_budget("s1", tokens=25)
    provider.delay = 0.3
    port = await nursery.start(gw.serve_session, "s1")
    replies = await burst(port, [chat_body(f"call {i}", model="test-model") for i in range(8)])
    codes = sorted(r.status_code for r in replies)
    assert codes == [200] * 3 + [402] * 5
    assert provider.count() == 3 and provider.most_active == 1
    u = gw.usage("s1")
    assert (u["paid_calls"], u["refused"], u["total_tokens"]) == (3, 5, 27)
    assert len(events(ledger, "s1", "budget.refused")) == 5


async def test_a_call_refused_again_and_again_writes_few_events(gw, ledger, provider, nursery,
                                                               monkeypatch):
    """QA (eighteenth session): a guest retrying its refused call every 0.4 s wrote an event
    each time, about 200,000 a day. The same call refused again within a minute of its last
    event is counted without one; the next event says how many were."""
    from ksfs.gateway import store as gateway_store

    gw.set_budget("s1", tokens=0)
    port = await nursery.start(gw.serve_session, "s1")
    for _ in range(5):
        assert (await call(port, chat_body("again"))).status_code == 402
    assert (await call(port, chat_body("another call"))).status_code == 402
    refused = events(ledger, "s1", "budget.refused")
    assert len(refused) == 2 and "repeats" not in refused[0].body, refused
    assert gw.usage("s1")["refused"] == 6 and provider.count() == 0
    monkeypatch.setattr(gateway_store, "REFUSAL_QUIET_S", 0.0)  # as a minute later
    assert (await call(port, chat_body("again"))).status_code == 402
    last = events(ledger, "s1", "budget.refused")[-1].body
    assert last["repeats"] == 4 and last["key"] == refused[0].body["key"], last


async def test_a_call_that_cost_nothing_does_not_open_the_gate(gw, provider, nursery):
    # An unpriced model's call costs 0 USD, which says nothing about what a priced call costs:
    # priced calls without a cap still start one at a time. Under a USD budget it is not bought
    # at all: its cost could not be counted.
    gw.set_budget("s1", usd=0.04)
    port = await nursery.start(gw.serve_session, "s1")
    r = await call(port, chat_body("warm up", model="unpriced-model"))
    assert r.status_code == 402 and r.json()["error"]["reason"] == "unpriced_model"
    assert "'unpriced-model' has no price" in r.json()["error"]["message"]
    assert provider.count() == 0
    # Nor is a request naming no model, whatever its route (a batch may spend anything).
    async with client(port) as c:
        up = await c.post("/v1/embeddings", content=b'{"input": "no model named"}')
    assert up.status_code == 402 and up.json()["error"]["reason"] == "unpriced_model"
    assert provider.count("/v1/embeddings") == 0
    provider.delay = 0.3
    # 2 + 7 tokens of test-model each: 0.016 USD
    replies = await burst(port, [chat_body(f"priced {i}", model="test-model") for i in range(8)])
    assert sorted(r.status_code for r in replies) == [200] * 3 + [402] * 5
    # No cap and no priced call completed to size them by: one at a time.
    assert provider.most_active == 1 and gw.usage("s1")["cost_usd"] == pytest.approx(0.048)


async def test_calls_without_usage_are_counted_at_an_estimate(gw, ledger, provider, nursery):
    # QA: an answer without usage (a provider that ignores include_usage, a JSON answer with
    # none) counted 0 tokens, so no budget ever stopped such calls.
    provider.stream_usage = provider.json_usage = False
    port = await nursery.start(gw.serve_session, "s1")
    bodies = [chat_body(f"guess {n}", model="test-model", stream=n == 1) for n in range(2)]
    for body in bodies:
        assert (await call(port, body)).status_code == 200
    answer = len("this is the fake provider answering you")  # 39 bytes whole, 40 streamed
    for e, body, made in zip(events(ledger, "s1", "gateway.call"), bodies, (answer, answer + 1),
                             strict=True):
        prompt, completion = len(json.dumps(body)) // 4, -(-made // 4)
        assert (e.body["prompt_tokens"], e.body["completion_tokens"]) == (prompt, completion)
        assert e.body["usage_known"] is False and e.body["priced"] is True
        assert e.body["cost_usd"] == pytest.approx((prompt * 1000 + completion * 2000) / 1e6)
    u = gw.usage("s1")
    assert u["unknown_usage_calls"] == 2 and u["total_tokens"] > 2 * 10


async def test_calls_without_usage_are_held_to_the_budget(gw, ledger, provider, nursery):
    provider.stream_usage = provider.json_usage = False
    gw.set_budget("s1", tokens=200)  # about 30 tokens a call, by the estimate
    port = await nursery.start(gw.serve_session, "s1")
    codes = [(await call(port, chat_body(f"call {i}", model="test-model",
                                         stream=i % 2 == 1))).status_code for i in range(12)]
    bought = codes.count(200)
    assert codes == [200] * bought + [402] * (12 - bought) and 5 <= bought <= 8, codes
    assert provider.count() == bought
    assert 200 <= gw.usage("s1")["total_tokens"] < 200 + 45
    # In a burst the gate holds each purchase to its reservation: its prompt and its cap (a
    # request without one is reserved at 4096 completion tokens: QA F2), a few at once, then
    # refused once the budget is used up.
    used = gw.usage("s1")["total_tokens"]
    gw.set_budget("s1", tokens=used + 100)
    provider.delay = 0.3
    replies = await burst(port, [dict(chat_body(f"burst {i}", model="test-model"), max_tokens=12)
                                 for i in range(8)])
    assert 402 in [r.status_code for r in replies]
    assert gw.usage("s1")["total_tokens"] < used + 100 + 40
    assert provider.most_active > 1
    # A USD budget sees them too: about 0.04 USD each at test-model's price.
    gw.set_budget("s1", usd=gw.usage("s1")["cost_usd"] + 0.1)
    provider.delay = 0
    codes = [(await call(port, chat_body(f"priced {i}", model="test-model"))).status_code
             for i in range(6)]
    assert codes == [200] * 3 + [402] * 3, codes


async def test_calls_with_room_in_the_budget_still_run_at_once(gw, provider, nursery):
    gw.set_budget("s1", tokens=1000)
    provider.delay = 0.3
    port = await nursery.start(gw.serve_session, "s1")
    async with trio.open_nursery() as calls:  # the first two: no cap, reserved at 4096: one by one
        for i in range(2):
            calls.start_soon(call, port, chat_body(f"first {i}", model="test-model"))
    assert provider.most_active == 1
    provider.most_active = 0
    provider.delay = 1.0  # long enough for all six to be in flight at once on a busy machine
    async with trio.open_nursery() as calls:  # about 20 + 50 tokens each: 6 fit beside each other
        for i in range(6):
            calls.start_soon(call, port, dict(chat_body(f"then {i}", model="test-model"),
                                              max_tokens=50))
    assert provider.count() == 8 and provider.most_active == 6
    gw.set_budget("s1")  # no budget: nothing is held back
    provider.most_active = 0
    async with trio.open_nursery() as calls:
        for i in range(4):
            calls.start_soon(call, port, chat_body(f"free {i}", model="test-model"))
    assert provider.most_active == 4


# --- upstream failures --------------------------------------------------------------------------


async def test_upstream_error_is_passed_back_and_not_stored(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    provider.error = 500
    r1 = await call(port, chat_body("fail me"), key="k")
    assert r1.status_code == 500 and r1.json()["error"]["type"] == "server_error"
    r2 = await call(port, chat_body("fail me"), key="k")
    assert r2.status_code == 500 and provider.count() == 2  # the retry went upstream again
    provider.error = None
    ok = await call(port, chat_body("fail me"), key="k")
    assert ok.status_code == 200 and ok.headers["x-ksfs-replay"] == "false"
    assert provider.count() == 3
    calls = events(ledger, "s1", "gateway.call")
    assert [(e.body["status"], e.body["stored"]) for e in calls] == [
        (500, False), (500, False), (200, True)]
    assert gw.usage("s1")["upstream_errors"] == 2 and gw.usage("s1")["paid_calls"] == 1


async def test_upstream_timeout_and_unreachable(store, ledger, provider, nursery):
    impatient = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=0.5)
    async with trio.open_nursery() as inner:
        port = await inner.start(impatient.serve_session, "s1")
        provider.error = "hang"
        r = await call(port, chat_body("slow"))
        assert r.status_code == 504 and r.json()["error"]["type"] == "upstream_timeout"
        provider.error = "close"
        r = await call(port, chat_body("slow"))
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unreachable"
        # it had the request: not "could not be reached" (QA, eighteenth session)
        assert r.json()["error"]["message"].startswith(
            "the model provider closed the connection without answering"), r.json()
        inner.cancel_scope.cancel()
    provider.reset()
    patient = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=30)
    port = await nursery.start(patient.serve_session, "s1")
    r = await call(port, chat_body("slow"))
    assert r.status_code == 200 and provider.count() == 1  # nothing failed was stored
    assert r.headers["x-ksfs-replay"] == "false"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    gw2 = Gateway(store, ledger, dead, timeout=5)
    port2 = await nursery.start(gw2.serve_session, "s2")
    r = await call(port2, chat_body("nobody home"))
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unreachable"
    assert r.json()["error"]["message"].startswith("the model provider could not be reached")
    async with client(port2) as c:
        assert (await c.get("/v1/models")).status_code == 502


# --- secrets ------------------------------------------------------------------------------------


async def test_api_key_goes_only_upstream(gw, store, ledger, provider, nursery, caplog):
    caplog.set_level(logging.DEBUG)
    gw.set_budget("s2", tokens=1)
    port = await nursery.start(gw.serve_session, "s1")
    port2 = await nursery.start(gw.serve_session, "s2")
    guest_auth = {"authorization": "Bearer guest-own-secret"}
    for stream in (False, True):
        await call(port, chat_body(stream=stream), key=f"a{stream}", headers=guest_auth)
        await call(port, chat_body(stream=stream), key=f"a{stream}", headers=guest_auth)  # replay
    await call(port2, chat_body("s2 first"))
    await call(port2, chat_body("s2 refused"))  # 402
    provider.error = 500
    await call(port, chat_body("an error"))
    async with client(port) as c:
        await c.get("/v1/models", headers=guest_auth)
    assert provider.count() >= 4
    assert {r.headers.get("authorization") for r in provider.requests} == {
        f"Bearer {MARKER_KEY}"}
    assert repr(gw).find(MARKER_KEY) == -1
    marker = MARKER_KEY.encode()
    found = []
    for root, _, files in os.walk(store.path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                if marker in f.read():
                    found.append(name)
    assert found == []
    for session in ("s1", "s2"):
        for e in ledger.events(session):
            assert MARKER_KEY not in str(e.to_dict())
            assert "guest-own-secret" not in str(e.to_dict())
            assert "hello there" not in str(e.body)  # nor the request text
    assert MARKER_KEY not in caplog.text


async def test_api_key_from_environment(store, ledger, provider, nursery, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("KSFS_UPSTREAM_API_KEY", "sk-from-env")
    gw = Gateway(store, ledger, provider.url)
    port = await nursery.start(gw.serve_session, "s1")
    await call(port, chat_body(), headers={"authorization": "Bearer guest"})
    assert provider.requests[-1].headers["authorization"] == "Bearer sk-from-env"
    monkeypatch.delenv("KSFS_UPSTREAM_API_KEY")
    gw2 = Gateway(store, ledger, provider.url)
    port2 = await nursery.start(gw2.serve_session, "s2")
    await call(port2, chat_body(), headers={"authorization": "Bearer guest"})
    assert "authorization" not in provider.requests[-1].headers  # the guest's is never sent


async def test_a_model_name_of_any_length_is_stored_and_counted(gw, ledger, provider, nursery):
    """A 70 000-character model name made the call's event over the body limit: the paid
    answer was neither stored nor counted, and an upstream error was not recorded at all."""
    port = await nursery.start(gw.serve_session, "s1")
    long_model = "m" * 70_000
    r = await call(port, chat_body("hi", model=long_model), key="k1")
    assert r.status_code == 200, r.text
    again = await call(port, chat_body("hi", model=long_model), key="k1")
    assert again.headers["x-ksfs-replay"] == "true" and provider.count() == 1
    provider.error = 500
    r = await call(port, chat_body("hi", model="q" * 70_000), key="k2")
    assert r.status_code == 500
    calls = events(ledger, "s1", "gateway.call")
    assert [(e.body["status"], e.body["stored"]) for e in calls] == [(200, True), (500, False)]
    assert all(len(e.body["model"]) == 200 for e in calls)
    u = gw.usage("s1")
    assert (u["paid_calls"], u["upstream_errors"], u["replays"]) == (1, 1, 1)
    assert list(u["by_model"]) == ["m" * 200]


async def test_a_long_request_path_is_cut_in_its_event(gw, ledger, provider, nursery):
    """Review (seventeenth session): the path, as the guest sent it, went into the call's event
    whole, beside the model name and the error that were cut."""
    port = await nursery.start(gw.serve_session, "s1")
    path = "/v1/chat/completions/" + "x" * 5000
    async with client(port) as c:
        r = await c.post(path, content=json.dumps(chat_body("hi")),
                         headers={"content-type": "application/json"})
    (ev,) = events(ledger, "s1", "gateway.call")
    assert ev.body["status"] == r.status_code, (r.status_code, ev.body)
    assert ev.body["path"] == path[:1000]


async def test_by_model_keeps_at_most_100_names(gw, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    for i in range(103):
        assert (await call(port, chat_body("hi", model=f"model-{i}"))).status_code == 200
    assert (await call(port, chat_body("hi", model="test-model"))).status_code == 200
    by_model = gw.usage("s1")["by_model"]
    assert len(by_model) == 101 and by_model["(other)"]["calls"] == 4
    assert by_model["(other)"]["priced"] is False  # one priced among unpriced ones
    assert sum(m["calls"] for m in by_model.values()) == 104


def test_anthropic_usage_counts_message_start_and_cache_tokens() -> None:
    """Review: a /v1/messages stream's usage was its last usage event alone (message_delta:
    output_tokens only), so message_start's input_tokens=50000 counted as prompt 0, and the
    cache's input tokens (cache_read_input_tokens, cache_creation_input_tokens) never counted.
    message_start's usage is merged with message_delta's; cache tokens count as prompt, in the
    stream and in the JSON answer."""
    from test_gateway_helpers import anthropic_stream

    from ksfs.gateway.calls import usage_of_json
    from ksfs.gateway.sse import usage_of_sse

    start_usage = {"input_tokens": 50000, "cache_creation_input_tokens": 2000,
                   "cache_read_input_tokens": 30000, "output_tokens": 1}
    stream = anthropic_stream("claude-x", start_usage, 15)
    u = usage_of_sse(stream, "claude-x")
    assert (u.prompt_tokens, u.completion_tokens) == (82000, 15), u
    assert u.total_tokens == 82015 and u.known and u.model == "claude-x"
    whole = json.dumps({"id": "msg_1", "type": "message", "model": "claude-x", "content": [],
                        "usage": dict(start_usage, output_tokens=15)}).encode()
    j = usage_of_json(whole, "claude-x")
    assert (j.prompt_tokens, j.completion_tokens, j.total_tokens) == (82000, 15, 82015), j
    # OpenAI's own streams and answers are read as before: the last usage whole.
    chat = b"".join([
        b'data: {"choices": [{"delta": {"content": "a"}}], "usage": null}\n\n',
        b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, '
        b'"total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 4}}}\n\n',
        b"data: [DONE]\n\n"])
    c = usage_of_sse(chat, "gpt-4o-mini")
    assert (c.prompt_tokens, c.completion_tokens, c.total_tokens) == (9, 3, 12)
