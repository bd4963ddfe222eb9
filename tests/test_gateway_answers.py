"""Answers and requests at the edges (QA of the eleventh session): text JSON allows but UTF-8
cannot hold, a 200 that is no completion, a model name a router rewrites, a request body cut
short. Each must be bought at most once, counted, and never stored wrong."""

from __future__ import annotations

import itertools
import json

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gateway_helpers import (  # with the shared fixtures, by name
    MARKER_KEY,
    call,
    chat_body,
    client,
    events,
    ledger,
    provider,
    store,
    upstream,
)

from ksfs.gateway import Gateway, parse_prices
from ksfs.gateway.upstream import KeyMask

LONE = "\ud83d"  # half of an emoji: JSON writes it as an escape, UTF-8 has no form for it


async def test_a_stream_with_a_lone_surrogate_is_stored_once_and_counted(store, ledger,
                                                                        provider, nursery):
    # The default client case: no stream_options, so the gateway asks for usage and rewrites
    # the chunks it takes usage out of.
    provider.words = ["cut", "emoji", LONE]
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = {"model": "gpt-4o-mini", "stream": True,
            "messages": [{"role": "user", "content": "say it"}]}
    first = await call(port, body)
    assert first.status_code == 200 and first.headers["x-ksfs-replay"] == "false"
    chunks = [ln[6:] for ln in first.content.decode("ascii").split("\n") if ln.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    said = "".join(json.loads(c)["choices"][0]["delta"].get("content", "")
                   for c in chunks[:-1] if json.loads(c)["choices"])
    assert said == f"cut emoji {LONE} "
    again = await call(port, body)
    assert again.headers["x-ksfs-replay"] == "true" and again.content == first.content
    assert provider.count() == 1
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"], u["completion_tokens"]) == (1, 1, 3)


async def test_a_request_json_cannot_put_in_utf8_is_bought_once(store, ledger, provider,
                                                                nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    raw = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"trunc \\ud83d"}]}'
    first = await call(port, {}, raw=raw)
    again = await call(port, {}, raw=raw)
    assert first.status_code == 200 and again.headers["x-ksfs-replay"] == "true"
    assert provider.count() == 1
    # nested past what the JSON reader takes: one clear 400, nothing bought
    deep = b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = await call(port, {}, raw=deep)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert provider.count() == 1


async def test_a_200_that_is_no_completion_is_passed_on_not_stored(store, ledger, provider,
                                                                  nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    for n, mode in enumerate(("error_object", "html")):
        provider.ok_but = mode
        body = chat_body(f"not an answer {n}")
        r = await call(port, body)
        assert r.status_code == 200  # as the provider sent it
        assert (b"overloaded" if mode == "error_object" else b"502 Bad Gateway") in r.content
        provider.ok_but = None
        again = await call(port, body)  # not stored: bought again, a real answer this time
        assert again.headers["x-ksfs-replay"] == "false"
        assert again.json()["choices"][0]["message"]["content"].startswith("this is")
    assert provider.count() == 4
    calls = events(ledger, "s1", "gateway.call")
    assert [(e.body["stored"], e.body.get("error")) for e in calls] == [
        (False, "not_an_answer"), (True, None), (False, "not_an_answer"), (True, None)]


async def test_a_router_model_name_is_priced_as_the_model_asked_for(store, ledger, provider,
                                                                   nursery):
    table = parse_prices('[models."gpt-4o-mini"]\ninput = 1000000\noutput = 1000000\n')
    provider.answer_model = "openai/gpt-4o-mini"
    gw = Gateway(store, ledger, provider.url, table, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", usd=12)
    r = await call(port, chat_body("two words"))  # 2 + 7 tokens at $1 each
    assert r.status_code == 200
    u = gw.usage("s1")
    assert u["cost_usd"] == 9.0 and u["by_model"]["openai/gpt-4o-mini"]["priced"] is True
    await call(port, chat_body("two more"))  # started under the budget: bought, now over it
    refused = await call(port, chat_body("a third"))
    assert refused.status_code == 402 and provider.count() == 2


async def test_a_body_cut_short_by_a_hang_up_is_not_bought(store, ledger, provider, nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    # Any route: on one whose body stands for itself (not parsed) a cut body would be bought.
    body = json.dumps({"model": "text-embedding-3-small", "input": "never whole"}).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n"
                              b"content-type: application/json\r\ncontent-length: "
                              + str(len(body)).encode() + b"\r\n\r\n" + body[:40])
    await trio.sleep(0.5)
    assert provider.count() == 0 and events(ledger, "s1", "gateway.call") == []
    r = await call(port, chat_body("this body never arrives whole"))  # the server goes on
    assert r.status_code == 200 and provider.count() == 1


async def test_edges_a_legitimate_provider_may_take(store, ledger, provider, nursery):
    """Review (eleventh session): a placeholder key ("index", as "EMPTY" or "ollama") was
    masked out of every answer holding that word, breaking its JSON; a 200 with
    "error": false was refused as an error; another model answering was priced as the one
    asked for."""
    table = parse_prices('[models."gpt-4o-mini"]\ninput = 1000000\noutput = 1000000\n')
    gw = Gateway(store, ledger, provider.url, table, api_key="index", timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    r = await call(port, chat_body("keep my index"))
    assert r.json()["choices"][0]["index"] == 0  # the word survives: no secret to mask
    provider.answer_model = "gpt-4o"  # not the model asked for, nor a vendor's name for it
    await call(port, chat_body("another model answers"))
    # with no price of its own, at the price of the model asked for (QA, eighteenth session:
    # counted as nothing, it spent past any USD budget)
    assert gw.usage("s1")["by_model"]["gpt-4o"] == {
        "calls": 1, "prompt_tokens": 3, "completion_tokens": 7, "cost_usd": 10.0, "priced": True,
        "cache_read_tokens": 0, "cache_write_tokens": 0,
        "cache_write_1h_tokens": 0}


async def test_an_answer_under_a_model_with_no_price_counts_against_a_usd_budget(
        store, ledger, provider, nursery):
    """QA (eighteenth session): a provider answering under an alias with no price (a
    deployment's name) was counted at $0, and a USD budget never stopped a call."""
    table = parse_prices('[models."gpt-4o-mini"]\ninput = 1000000\noutput = 1000000\n')
    provider.answer_model = "gpt-4o-mini-tuned-x"
    gw = Gateway(store, ledger, provider.url, table, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", usd=12)
    for text in ("two words", "two more", "a third", "a fourth"):
        await call(port, chat_body(text))
    assert provider.count() == 2  # 9 + 9 USD: the third is refused
    assert gw.usage("s1")["cost_usd"] == 18.0


@pytest.mark.parametrize("usage", [{}, {"prompt_tokens": None, "completion_tokens": None}])
async def test_a_usage_with_no_figures_is_counted_at_an_estimate(store, ledger, provider,
                                                                 nursery, usage):
    """QA (eighteenth session): "usage": {} (or nulls) counted as 0 tokens known, so a token
    budget never stopped a call."""
    provider.usage_as = usage
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    gw.set_budget("s1", tokens=5)
    for text in ("first call", "second call", "third call"):
        await call(port, chat_body(text))
    for stream in (True, False):
        await call(port, chat_body("a streamed one", stream=stream))
    assert provider.count() == 1  # the first, estimated at more than 5 tokens, spent it
    first = events(ledger, "s1", "gateway.call")[0].body
    assert first["usage_known"] is False and first["total_tokens"] > 5, first


def test_an_error_field_that_says_no_error_is_an_answer() -> None:
    from ksfs.gateway.calls import not_an_answer

    for body in (b'{"error": false, "id": 1}', b'{"error": 0}', b'{"error": []}',
                 b'{"error": null}', b'{"error": {}}'):
        assert not_an_answer(body, "application/json", "/v1/chat/completions") is None, body
    assert not_an_answer(b'{"error": "overloaded"}', "application/json", "/v1/x") is not None
    assert not_an_answer(b"[1, 2]", "application/json", "/v1/embeddings") is None


async def test_the_operators_key_echoed_back_never_reaches_the_guest(store, ledger, provider,
                                                                     nursery):
    """Twelfth session: an unpaid route passed through (a provider's debug route echoing the
    request) handed the guest the operator's key, and a streamed answer echoing it was sent
    live unmasked while stored masked, so the guest also got an error appended."""
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    async with client(port) as c:
        echoed = await c.get("/v1/whoami")
    assert echoed.status_code == 200 and echoed.json() == {"authorization": "Bearer ***"}
    provider.words = ["your", "key:", MARKER_KEY, "done"]
    live = await call(port, chat_body("echo my key", stream=True))
    again = await call(port, chat_body("echo my key", stream=True))
    assert again.headers["x-ksfs-replay"] == "true" and provider.count() == 1
    for r in (live, again):
        assert r.status_code == 200 and MARKER_KEY not in r.text and "***" in r.text
        assert "error" not in r.text and r.text.rstrip().endswith("data: [DONE]")
    assert live.text == again.text


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=6),
       text=st.sampled_from([b"", b"sk", b"x sk-ksfs", b"Bearer " + MARKER_KEY.encode() * 2]))
def test_the_key_mask_finds_the_key_however_the_body_is_cut(cuts, text) -> None:
    key = MARKER_KEY.encode()
    body = b"head " + text + b" mid " + key + b" sk-ksfs-test-MARK tail " + key[:-1]
    mask = KeyMask(MARKER_KEY)
    out = b""
    bounds = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    for a, b in itertools.pairwise(bounds):
        out += mask.feed(body[a:b])
    out += mask.end()
    assert out == body.replace(key, b"***")
    assert KeyMask("EMPTY").feed(b"EMPTY answer") == b"EMPTY answer"  # a placeholder, kept
