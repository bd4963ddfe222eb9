"""Paid routes other than chat completions (QA F4): embeddings, the Responses API and any other
POST or request with a body are held to the budget, counted, and bought once, over real sockets.
Bodyless GETs still pass straight through."""

from __future__ import annotations

import json

import pytest
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

from ksfs.gateway import Gateway, canonical_body, derived_key

PRICES = """
[models."test-embed"]
input = 100.0
output = 0.0

[models."test-model"]
input = 1000.0
output = 2000.0
"""


@pytest.fixture
def gw(store, ledger, provider, tmp_path):
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES)
    return Gateway(store, ledger, provider.url, prices, api_key=MARKER_KEY, timeout=10)


async def post(port: int, path: str, body: dict | None = None, *, raw: bytes | None = None,
               method: str = "POST", headers: dict[str, str] | None = None):
    content = raw if raw is not None else json.dumps(body).encode()
    async with client(port) as c:
        return await c.request(method, path, content=content,
                               headers={"content-type": "application/json", **(headers or {})})


def embed_body(*texts: str) -> dict:
    return {"model": "test-embed", "input": list(texts) if len(texts) > 1 else texts[0]}


def responses_body(text: str, stream: bool = False) -> dict:
    body: dict = {"model": "test-model", "input": text}
    if stream:
        body["stream"] = True
    return body


# --- over budget: nothing that can cost money reaches the provider ------------------------------


async def test_every_paid_route_is_refused_over_budget(gw, ledger, provider, nursery):
    gw.set_budget("s1", tokens=5)
    port = await nursery.start(gw.serve_session, "s1")
    assert (await call(port, chat_body("one two three"))).status_code == 200  # 3 + 7 >= 5
    asked = len(provider.requests)
    tries = [
        ("POST", "/v1/embeddings", json.dumps(embed_body("x")).encode()),
        ("POST", "/v1/responses", json.dumps(responses_body("x")).encode()),
        ("POST", "/v1/responses", json.dumps(responses_body("x", stream=True)).encode()),
        ("POST", "/v1/images/generations", b'{"prompt": "a cat"}'),  # no route is exempt
        ("POST", "/v1/batches/b1/cancel", b""),  # a POST without a body
        ("POST", "/v1/audio/transcriptions", b"--b\r\nnot json at all\r\n--b--\r\n"),
        ("GET", "/v1/embeddings", json.dumps(embed_body("a GET with a body")).encode()),
    ]
    for method, path, raw in tries:
        r = await post(port, path, raw=raw, method=method)
        assert r.status_code == 402, (method, path, r.status_code)
        err = r.json()["error"]
        assert err["type"] == "budget_exceeded" and err["session"] == "s1"
        assert err["budget"] == {"tokens": 5, "usd": None} and err["used"]["tokens"] == 10
        assert r.headers["x-ksfs-replay"] == "refused"
    assert len(provider.requests) == asked  # the provider was asked nothing more
    refused = events(ledger, "s1", "budget.refused")
    assert [e.body["path"] for e in refused] == [p for _, p, _ in tries]
    assert gw.usage("s1")["refused"] == len(tries)
    # A bodyless GET costs nothing and still passes, over budget or not.
    async with client(port) as c:
        assert (await c.get("/v1/models")).status_code == 200
    assert provider.count("/v1/models") == 1


async def raw_status(port: int, target: str, body: bytes) -> int:
    """The status of a POST sent with ``target`` exactly as written (clients such as httpx
    resolve dot segments before sending)."""
    import trio

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        got = b""
        while b"\r\n" not in got:
            part = await stream.receive_some(4096)
            if not part:
                break
            got += part
    return int(got.split(b" ", 2)[1])


async def test_a_chat_completion_by_another_path_is_held_as_one(gw, ledger, provider, nursery):
    """QA: /v1/./chat/completions, //v1/chat/completions (which the provider takes for chat)
    and /v1/chat/completions?api-version=... were bought as other routes: a stream's usage was
    never asked for (so never counted, nor held to the budget) and a stream cut short was kept
    and replayed for ever."""
    port = await nursery.start(gw.serve_session, "s1")
    asked = len(provider.requests)
    body = json.dumps(chat_body("dot dot")).encode()
    for target in ("/v1/./chat/completions", "/v1/../v1/chat/completions",
                   "//v1/chat/completions", "/v1//chat/completions", "/v1/chat/completions/.."):
        assert await raw_status(port, target, body) == 400, target
    assert len(provider.requests) == asked  # nothing was sent on
    # a query (as Azure-style clients send the API version): still a chat completion
    streamed = chat_body("four words of prompt", stream=True)
    del streamed["stream_options"]  # as the openai client sends stream=True by default
    r = await post(port, "/v1/chat/completions?api-version=2024-06-01", streamed)
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert '"usage"' not in r.text  # asked for on the guest's behalf, and kept from it
    sent = json.loads(provider.requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}
    usage = gw.usage("s1")
    assert usage["total_tokens"] == 4 + 7 and usage["unknown_usage_calls"] == 0, usage
    # a stream cut short under that path is not kept
    provider.stream_end = "no_done"
    streamed["messages"][0]["content"] = "cut short"
    r = await post(port, "/v1/chat/completions?api-version=2024-06-01", streamed)
    assert "upstream_stream_incomplete" in r.text
    provider.stream_end = None
    r = await post(port, "/v1/chat/completions?api-version=2024-06-01", streamed)
    assert r.headers["x-ksfs-replay"] == "false" and "data: [DONE]" in r.text  # bought again


async def test_an_upload_naming_an_unpriced_model_is_refused_under_a_usd_budget(
        gw, ledger, provider, nursery):
    """QA: a multipart upload (image edits, transcriptions) naming a model with no price went
    upstream under a USD budget and cost 0, where the same call as JSON was refused."""
    gw.set_budget("s1", usd=1.0)
    port = await nursery.start(gw.serve_session, "s1")
    asked = len(provider.requests)

    def form(model: str) -> bytes:
        return (b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n"
                + model.encode() + b"\r\n--XyZ\r\nContent-Disposition: form-data; "
                b"name=\"image\"; filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n"
                b"\x89PNG fake\r\n--XyZ--\r\n")

    r = await post(port, "/v1/images/edits", raw=form("gpt-image-1"),
                   headers={"content-type": "multipart/form-data; boundary=XyZ"})
    assert r.status_code == 402 and r.json()["error"]["reason"] == "unpriced_model", r.text
    assert len(provider.requests) == asked
    # one naming a priced model goes on (the fake provider has no such endpoint: 404)
    r = await post(port, "/v1/images/edits", raw=form("test-model"),
                   headers={"content-type": "multipart/form-data; boundary=XyZ"})
    assert r.status_code == 404 and len(provider.requests) == asked + 1


async def test_a_chat_completion_naming_no_model_is_refused_under_a_usd_budget(
        gw, ledger, provider, nursery):
    """QA: a chat completion without "model" is answered by the provider's default model, at a
    price the table cannot know; it went upstream under a USD budget, cost 0, and the budget
    never tripped (the fake provider answers it as model "unknown")."""
    gw.set_budget("s1", usd=0.01)
    port = await nursery.start(gw.serve_session, "s1")
    nameless = {"messages": [{"role": "user", "content": "which model are you?"}]}
    for path in ("/v1/chat/completions", "/openai/deployments/d1/chat/completions"):
        r = await post(port, path, nameless)
        assert r.status_code == 402, (path, r.text)
        err = r.json()["error"]
        assert err["reason"] == "unpriced_model" and "names no model" in err["message"]
        assert "name a model the table prices" in err["message"]
    assert provider.requests == []
    assert [e.body["reason"] for e in events(ledger, "s1", "budget.refused")] == [
        "unpriced_model"] * 2
    # Under a budget in tokens alone the cost need not be known: it goes.
    gw.set_budget("s1", tokens=10_000)
    assert (await post(port, "/v1/chat/completions", nameless)).status_code == 200


UPLOAD = (b"--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
          b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
          b"Content-Type: application/jsonl\r\n\r\n" + b'{"custom_id": "1"}\n' * 40
          + b"\r\n--XyZ--\r\n")


async def test_a_call_of_any_route_naming_no_model_is_held_as_a_chat_completion_is(
        gw, ledger, provider, nursery):
    """QA (last session): a call that named no model and was no chat completion (a batch, a
    file upload) counted 0 tokens, yet was marked as counted at an estimate, and went
    upstream under a USD budget, where a chat completion naming no model is refused: a batch
    names no model and may spend anything."""
    port = await nursery.start(gw.serve_session, "s1")
    batch = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions",
             "completion_window": "24h"}
    form = {"content-type": "multipart/form-data; boundary=XyZ"}
    # No budget: bought, and counted at the estimate a chat completion without usage gets (its
    # JSON request's size; an upload's body is no prompt, and its answer generated no text).
    assert (await post(port, "/v1/batches", batch)).status_code == 200
    assert (await post(port, "/v1/files", raw=UPLOAD, headers=form)).status_code == 200
    made, sent = events(ledger, "s1", "gateway.call"), len(json.dumps(batch))
    assert [(e.body["usage_known"], e.body["total_tokens"]) for e in made] == [
        (False, sent // 4), (False, 0)]
    u = gw.usage("s1")
    assert (u["unknown_usage_calls"], u["unpriced_calls"], u["total_tokens"]) == (
        2, 2, sent // 4)
    # A USD budget: refused as a chat completion naming no model is, nothing sent upstream.
    gw.set_budget("s1", usd=1.0)
    asked = len(provider.requests)
    tries = [("/v1/batches", {"raw": json.dumps(dict(batch, input_file_id="file-2")).encode()}),
             ("/v1/files", {"raw": UPLOAD + b" ", "headers": form}),
             ("/v1/batches/b1/cancel", {"raw": b""})]
    for path, how in tries:
        r = await post(port, path, **how)
        assert r.status_code == 402, (path, r.text)
        err = r.json()["error"]
        assert err["reason"] == "unpriced_model" and "names no model" in err["message"]
    assert len(provider.requests) == asked
    assert [e.body["reason"] for e in events(ledger, "s1", "budget.refused")] == [
        "unpriced_model"] * 3
    # A token budget: they go, and their estimates spend it as a chat completion's would.
    gw.set_budget("s1", tokens=u["total_tokens"] + 60)
    codes = [(await post(port, "/v1/batches", dict(batch, input_file_id=f"f{n}"))).status_code
             for n in range(6)]
    assert codes == [200] * 3 + [402] * 3, codes  # 22 tokens each; the third crosses it
    assert events(ledger, "s1", "budget.refused")[-1].body["reason"] == "used_up"


# --- under budget: their usage is counted, and they are bought once ----------------------------


async def test_embeddings_and_responses_usage_is_counted(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    emb = await post(port, "/v1/embeddings", embed_body("one two", "three"))
    assert emb.status_code == 200 and emb.headers["x-ksfs-replay"] == "false"
    assert len(emb.json()["data"]) == 2 and emb.json()["usage"]["prompt_tokens"] == 3
    resp = await post(port, "/v1/responses", responses_body("four five"))
    assert resp.status_code == 200 and resp.json()["usage"]["input_tokens"] == 2
    async with client(port) as c:
        async with c.stream("POST", "/v1/responses",
                            json=responses_body("six seven eight", stream=True)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            streamed = b"".join([chunk async for chunk in r.aiter_raw()])
    assert b"event: response.completed" in streamed
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"], u["unknown_usage_calls"]) == (3, 0, 0)
    assert u["prompt_tokens"] == 3 + 2 + 3
    assert u["completion_tokens"] == 0 + 7 + 7
    assert u["total_tokens"] == 3 + 9 + 10
    assert u["cost_usd"] == pytest.approx((3 * 100 + 5 * 1000 + 14 * 2000) / 1e6)
    assert u["by_model"]["test-embed"]["calls"] == 1
    calls = events(ledger, "s1", "gateway.call")
    assert [e.body["path"] for e in calls] == ["/v1/embeddings", "/v1/responses",
                                               "/v1/responses"]
    assert [e.body["total_tokens"] for e in calls] == [3, 9, 10]
    # The same calls again are replays from the store: the provider is not asked twice.
    again = await post(port, "/v1/embeddings", embed_body("one two", "three"))
    assert again.content == emb.content and again.headers["x-ksfs-replay"] == "true"
    async with client(port) as c:
        replayed = await c.post("/v1/responses",
                                json=responses_body("six seven eight", stream=True))
    assert replayed.content == streamed
    assert provider.count("/v1/embeddings") == 1 and provider.count("/v1/responses") == 2
    assert gw.usage("s1")["replays"] == 2 and gw.usage("s1")["total_tokens"] == 22


async def test_usage_counted_from_other_routes_reaches_the_budget(gw, provider, nursery):
    gw.set_budget("s1", tokens=10)
    port = await nursery.start(gw.serve_session, "s1")
    assert (await post(port, "/v1/responses", responses_body("a b c"))).status_code == 200
    r = await call(port, chat_body("now over"))  # 3 + 7 from /v1/responses used it up
    assert r.status_code == 402 and provider.count() == 0


async def test_route_is_part_of_the_key(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    same = {"model": "test-model", "input": "same body"}
    a = await post(port, "/v1/embeddings", same)
    b = await post(port, "/v1/responses", same)
    assert a.status_code == b.status_code == 200
    assert a.headers["x-ksfs-key"] != b.headers["x-ksfs-key"]
    assert provider.count("/v1/embeddings") == provider.count("/v1/responses") == 1
    # One Idempotency-Key on two routes names two calls, not a reuse (no 422).
    k = {"idempotency-key": "agent-step-1"}
    c1 = await call(port, chat_body("keyed"), key="agent-step-1")
    e1 = await post(port, "/v1/embeddings", embed_body("keyed"), headers=k)
    assert c1.status_code == e1.status_code == 200
    assert e1.json()["object"] == "list" and c1.json()["object"] == "chat.completion"
    # Chat completions keep the keys they always had, so responses stored before still replay.
    canon, _ = canonical_body(json.dumps(chat_body("plain chat")).encode())
    plain = await call(port, chat_body("plain chat"))
    assert plain.headers["x-ksfs-key"] == derived_key(ledger.session("s1").lineage, canon).hex()


async def test_upstream_errors_on_other_routes_are_passed_back_not_stored(gw, ledger, provider,
                                                                         nursery):
    port = await nursery.start(gw.serve_session, "s1")
    raw = b"--b\r\nnot json\r\n--b--\r\n"  # a non-JSON body goes upstream as it is
    r = await post(port, "/v1/nothing", raw=raw)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    assert provider.requests[-1].body == raw
    r2 = await post(port, "/v1/nothing", raw=raw)
    assert r2.status_code == 404 and provider.count("/v1/nothing") == 2  # not stored
    (first, _) = events(ledger, "s1", "gateway.call")
    assert first.body["stored"] is False and first.body["path"] == "/v1/nothing"
    assert gw.usage("s1")["upstream_errors"] == 2 and gw.usage("s1")["paid_calls"] == 0
