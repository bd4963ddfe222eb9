"""What crosses the wire to the provider (QA of the eighth session): the request target is a
path on the provider and nothing else, sent as the guest encoded it; streams are stored only
when they ended as a complete answer; a compressed answer is stored decoded."""

from __future__ import annotations

import contextlib
import json

import httpx
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

from ksfs.gateway import Gateway
from ksfs.gateway.sse import HiddenUsage


async def raw_request(port: int, target: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request with exactly ``target`` on its request line (httpx would fix it)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        head = (b"POST " + target + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
        await stream.send_all(head + body)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


async def test_a_target_that_is_not_a_path_is_refused_and_sent_nowhere(store, ledger, provider,
                                                                       nursery):
    # Appended to the provider's URL these would name another host (and take the API key
    # there): "http://127.0.0.1" + "0:18999/..." is 127.0.0.10:18999.
    gw = Gateway(store, ledger, "http://127.0.0.1", api_key=MARKER_KEY, timeout=5)
    port = await nursery.start(gw.serve_session, "s1")
    body = json.dumps(chat_body()).encode()
    for target in (b"0:18999/v1/chat/completions", b".evil.example/v1/chat/completions",
                   b"@127.0.0.1:18999/v1/models", b"http://127.0.0.1:1/v1/chat/completions"):
        status, answer = await raw_request(port, target, body)
        assert status == 400, target
        assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert provider.requests == []
    assert events(ledger, "s1", "gateway.call") == []


async def test_the_path_goes_upstream_as_the_guest_encoded_it(store, ledger, provider, nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=5)
    port = await nursery.start(gw.serve_session, "s1")
    async with client(port) as c:
        await c.get("/v1/models/a%2Fb%3Fc=1?limit=2")  # passed through
        await c.post("/v1/files/x%2Fy", content=b'{"purpose": "t"}')  # paid
    assert [r.path for r in provider.requests] == ["/v1/models/a%2Fb%3Fc=1?limit=2",
                                                   "/v1/files/x%2Fy"]


# --- streams: usage asked on the guest's behalf, and only whole answers stored ------------------


def data_events(body: bytes) -> list:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


async def test_a_stream_that_did_not_ask_for_usage_is_still_counted(store, ledger, provider,
                                                                     nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    gw.set_budget("s1", tokens=20)
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("one two three", stream=True)
    del body["stream_options"]  # the openai client's default for stream=True
    first = await call(port, body)
    # The provider was asked for the usage; the guest got the stream it asked for.
    sent = json.loads(provider.requests[-1].body)
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == body["messages"]
    got = data_events(first.content)
    assert got[-1] == "[DONE]" and len(got) == 9
    assert all("usage" not in ev and ev["choices"] for ev in got[:-1])
    assert "".join(ev["choices"][0]["delta"].get("content", "") for ev in got[:-1]).split() \
        == ["this", "is", "the", "fake", "provider", "answering", "you"]
    u = gw.usage("s1")
    assert (u["total_tokens"], u["unknown_usage_calls"]) == (3 + 7, 0)
    # Stored as the guest got it: a replay is the same bytes, and costs nothing.
    again = await call(port, body)
    assert again.headers["x-ksfs-replay"] == "true" and again.content == first.content
    # The budget sees streams: 10 + 10 reaches 20, the next is refused.
    assert (await call(port, dict(body, n=2))).status_code == 200
    assert (await call(port, dict(body, n=3))).status_code == 402
    assert provider.count() == 2


async def test_a_provider_that_refuses_stream_options_is_asked_as_the_guest_did(
        store, ledger, provider, nursery):
    provider.reject_stream_options = True
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("no options please", stream=True)
    del body["stream_options"]
    r = await call(port, body)
    assert r.status_code == 200 and data_events(r.content)[-1] == "[DONE]"
    assert [json.loads(x.body).get("stream_options") for x in provider.requests] == [
        {"include_usage": True}, None]
    assert gw.usage("s1")["unknown_usage_calls"] == 1


async def test_a_stream_that_fails_or_stops_short_is_passed_on_but_not_stored(
        store, ledger, provider, nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    for n, end in enumerate(("error_event", "no_done")):
        provider.stream_end = end
        body = chat_body(f"doomed {n}", stream=True)
        r = await call(port, body)
        assert r.status_code == 200  # the headers were out before the stream went wrong
        got = data_events(r.content)
        errors = [ev["error"] for ev in got if isinstance(ev, dict) and "error" in ev]
        assert errors[-1]["type"] == "upstream_stream_incomplete"
        if end == "error_event":  # the provider's own error reaches the guest too
            assert errors[0]["message"] == "The server had an error"
        provider.stream_end = None
        again = await call(port, body)  # not stored: bought again, and whole this time
        assert again.headers["x-ksfs-replay"] == "false"
        assert data_events(again.content)[-1] == "[DONE]"
    assert provider.count() == 4
    calls = events(ledger, "s1", "gateway.call")
    assert [(e.body["stored"], e.body.get("error")) for e in calls] == [
        (False, "stream_incomplete"), (True, None), (False, "stream_incomplete"), (True, None)]
    # What the provider billed counts even when the stream is not stored (review: a provider
    # that never sends [DONE] made every stream free and the budget void). The one that failed
    # before its usage chunk is counted at an estimate: its request's size, three words' text.
    guessed = len(json.dumps(chat_body("doomed 0", stream=True))) // 4 + len("this is the ") // 4
    assert [e.body["total_tokens"] for e in calls] == [guessed, 2 + 7, 2 + 7, 2 + 7]
    assert [e.body["usage_known"] for e in calls] == [False, True, True, True]
    u = gw.usage("s1")
    assert (u["total_tokens"], u["upstream_errors"], u["paid_calls"]) == (27 + guessed, 2, 4)


async def test_a_compressed_answer_is_stored_decoded(store, ledger, provider, nursery):
    provider.gzip = True
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("squeeze me")
    first = await call(port, body)
    assert "content-encoding" not in first.headers
    assert first.json()["choices"][0]["message"]["content"].startswith("this is")
    again = await call(port, body)
    assert again.headers["x-ksfs-replay"] == "true" and again.content == first.content
    assert gw.usage("s1")["total_tokens"] == 2 + 7


SAMPLE_STREAM = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"h\\u00e9"}}],"usage":null}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}'
    b'\r\n\r\n'
    b': a comment line\n\n'
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,'
    b'"total_tokens":3}}\n\n'
    b'data: [DONE]\n\n')


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, len(SAMPLE_STREAM)), max_size=12))
def test_hidden_usage_gives_the_same_stream_however_it_arrives(cuts: list[int]) -> None:
    whole = HiddenUsage.apply(SAMPLE_STREAM)
    assert data_events(whole) == [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "hé"}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        "[DONE]"]
    assert b": a comment line\n\n" in whole
    f, out, last = HiddenUsage(), [], 0
    for cut in sorted(cuts) + [len(SAMPLE_STREAM)]:
        out.append(f.feed(SAMPLE_STREAM[last:cut]))
        last = cut
    assert b"".join(out) + f.flush() == whole


async def test_the_guest_sees_no_part_of_the_key_and_picks_no_billing(store, ledger, provider,
                                                                       nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    provider.error = 401
    r = await call(port, chat_body("bad key"),
                   headers={"OpenAI-Organization": "org-guest", "OpenAI-Project": "proj-guest"})
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "Incorrect API key provided: sk-***."
    assert MARKER_KEY[-4:] not in r.text and MARKER_KEY[:8] not in r.text
    seen = provider.requests[-1].headers
    assert seen["authorization"] == f"Bearer {MARKER_KEY}"
    assert "openai-organization" not in seen and "openai-project" not in seen
    # Passed through (a GET), and compressed as the guest's client allows: masked all the same.
    provider.gzip = True
    async with client(port) as c:
        r = await c.get("/v1/models", headers={"accept-encoding": "gzip"})
    assert r.status_code == 401 and "sk-***" in r.text and MARKER_KEY[-4:] not in r.text


async def test_a_server_stopped_under_a_call_of_a_removed_session_stops_cleanly(
        store, ledger, provider):
    """Review (eighth session): the daemon stops a removed session's server; the record of the
    call it stopped under failed (the session is read-only now), and that error escaped the
    cancellation and took the daemon down."""
    from ksfs.daemon.gateways import _serve_one

    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    provider.delay = 3.0
    async with trio.open_nursery() as n:
        scope = await n.start(_serve_one, gw, "s1", 0, None)
        while "s1" not in gw.ports:
            await trio.sleep(0.01)
        async def doomed() -> None:
            with contextlib.suppress(httpx.HTTPError):  # its server goes away under it
                await call(gw.ports["s1"], chat_body("doomed"))

        n.start_soon(doomed)
        while provider.active == 0:
            await trio.sleep(0.01)
        with ledger.env.begin(write=True) as txn:
            ledger.remove_session(txn, "s1", keep_checkpoints=True)
        scope.cancel()
        await trio.sleep(0.3)
        n.cancel_scope.cancel()
    assert "s1" not in gw.ports


async def test_two_paths_that_decode_alike_are_two_calls(store, ledger, provider, nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = json.dumps({"model": "test-embed", "input": "same body"}).encode()
    async with client(port) as c:
        one = await c.post("/v1/embeddings/a%2Fb", content=body)
        two = await c.post("/v1/embeddings/a/b", content=body)
    assert one.headers["x-ksfs-key"] != two.headers["x-ksfs-key"]
    assert [r.path for r in provider.requests] == ["/v1/embeddings/a%2Fb", "/v1/embeddings/a/b"]


def test_a_request_is_reckoned_within_bounds() -> None:
    from ksfs.gateway.calls import CAP_MAX, estimated_tokens

    assert estimated_tokens({"max_tokens": 10**400, "n": 10**9}, 400) == (100, CAP_MAX * 128)
    assert estimated_tokens({"max_completion_tokens": 50, "n": 2}, 40) == (10, 100)
    assert estimated_tokens({"max_tokens": True}, 40) == (10, None)  # a bool is no cap
    assert estimated_tokens({}, 40) == (10, None)
    # the gateway's completion reserve stands for a cap not given, times n too (QA F2)
    assert estimated_tokens({"n": 3}, 40, 4096) == (10, 3 * 4096)
    assert estimated_tokens({"max_tokens": 7}, 40, 4096) == (10, 7)


def test_stream_usage_is_read_from_whole_events() -> None:
    """The usage of a stream is found as the stream's events are parsed: a U+2028 inside a
    chunk's text and a usage object split over two data lines (both valid SSE) used to hide
    it from a line-by-line reader, and the call counted 0 tokens."""
    from ksfs.gateway.sse import usage_of_sse

    text = json.dumps({"choices": [{"delta": {"content": "a\u2028b"}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
                       "model": "m-1"}, ensure_ascii=False)
    u = usage_of_sse(f"data: {text}\n\ndata: [DONE]\n\n".encode(), "asked")
    assert (u.model, u.prompt_tokens, u.completion_tokens, u.total_tokens, u.known) == (
        "m-1", 3, 4, 7, True)
    split = (b'data: {"choices": [],\ndata: "usage": {"prompt_tokens": 5, '
             b'"completion_tokens": 6, "total_tokens": 11}}\r\n\r\ndata: [DONE]\n\n')
    assert usage_of_sse(split, "asked").total_tokens == 11
    none = usage_of_sse(b"data: {\"choices\": []}\n\ndata: [DONE]\n\n", "asked")
    assert (none.model, none.total_tokens, none.known) == ("asked", 0, False)


def test_the_text_an_answer_generated_is_sized_from_its_deltas_and_text_fields() -> None:
    """What a call without usage is counted at: the text it generated, not its JSON's size
    and not the whole-answer events of a Responses stream, which repeat its deltas."""
    from ksfs.gateway.calls import answer_text_bytes
    from ksfs.gateway.sse import generated_text_bytes

    chat = (b'data: {"choices":[{"delta":{"role":"assistant","content":"h\\u00e9 "}}]}\n\n'
            b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}'
            b'\n\ndata: [DONE]\n\n')
    assert generated_text_bytes(chat) == len("hé ".encode()) + 2
    done = {"type": "response.completed", "response": {"output": [{"content": [
        {"type": "output_text", "text": "one two"}]}]}}
    responses = "".join(f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n" for ev in (
        {"type": "response.output_text.delta", "delta": "one "},
        {"type": "response.output_text.delta", "delta": "two"},
        {"type": "response.output_text.done", "text": "one two"}, done)).encode()
    assert generated_text_bytes(responses) == len("one two")
    answer = {"model": "m", "choices": [{"message": {"content": "four", "refusal": None}}],
              "data": [{"b64_json": "QUJD" * 100}]}
    assert answer_text_bytes(json.dumps(answer).encode(), "application/json") == 4
    assert answer_text_bytes(b"1\n00:00 --> 00:01\nhi\n", "text/plain; charset=utf-8") == 21
    assert answer_text_bytes(b"<html>502</html>", "text/html") == 0
    assert answer_text_bytes(b"\xff\xfbMP3", "audio/mpeg") == 0


def test_one_event_of_many_mb_passes_whole_and_is_held_as_it_came() -> None:
    """QA: one huge event was copied onto what was held at every 64 KiB piece, so hiding the
    usage of its stream took time growing with the square of its size (a 40 MB event: 38 s).
    The pieces of an event not yet ended are held as they came, each joined once; its bytes
    come out right."""
    words = {"index": 0, "delta": {"content": "word " * 700_000}}  # 3.5 MB of text
    big = {"id": "c", "choices": [words], "usage": None}
    stream = (b"data: " + json.dumps(big).encode() + b"\n\n"
              + b"data: " + json.dumps({"id": "c", "choices": [words]}).encode() + b"\r\n\r\n"
              + b'data: {"id":"c","choices":[],"usage":{"total_tokens":3}}\n\n'
              + b"data: [DONE]\n\n")
    f, out = HiddenUsage(), []
    pieces = [stream[at:at + 65536] for at in range(0, len(stream), 65536)]
    first_end = stream.index(b"\n\n")
    for n, piece in enumerate(pieces):
        out.append(f.feed(piece))
        if (n + 1) * 65536 < first_end:  # the first event not ended yet: nothing copied
            assert out[-1] == b"" and all(
                a is b for a, b in zip(f._held, pieces[:n + 1], strict=True))
    got = b"".join(out) + f.flush()
    big.pop("usage")
    assert got == (b"data: " + json.dumps(big, separators=(",", ":")).encode() + b"\n\n"
                   + b"data: " + json.dumps({"id": "c", "choices": [words]}).encode()
                   + b"\r\n\r\ndata: [DONE]\n\n")
    assert got == HiddenUsage.apply(stream)


def test_filler_after_the_end_of_a_stream_does_not_release_it() -> None:
    """Review (eighth session): bytes that only trail [DONE] (a blank line, a keep-alive
    comment), arriving as a chunk of their own, let the guest see [DONE] before the commit."""
    from ksfs.gateway.inflight import Call

    c = Call()
    for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n", b"\n", b": keep-alive\n\n"):
        c.on_chunk(chunk)
    assert c.chunks == [b"data: 1\n\n", b"data: [DONE]\n\n\n: keep-alive\n\n"]


async def test_a_duplicate_of_a_stream_in_flight_follows_it(store, ledger, provider, nursery):
    """QA (eighth session): a retry of a stream still in flight got no byte, not even its
    headers, until the whole stream was in: a generation longer than the client's read timeout
    timed out on every retry."""
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=30)
    port = await nursery.start(gw.serve_session, "s1")
    provider.chunk_delay = 0.25  # 10 events: about 2.5 s
    body = chat_body("slow stream", stream=True)
    got: dict[str, tuple[float, bytes, dict]] = {}

    async def one(name: str) -> None:
        start = trio.current_time()
        first = None
        data = b""
        async with client(port) as c, c.stream("POST", "/v1/chat/completions", json=body,
                                                headers={"idempotency-key": "k1"}) as r:
            async for chunk in r.aiter_raw():
                first = trio.current_time() - start if first is None else first
                data += chunk
        got[name] = (first, data, dict(r.headers))

    async with trio.open_nursery() as n:
        n.start_soon(one, "buyer")
        with trio.fail_after(10):
            while not provider.requests:  # the buyer's purchase is under way (not a sleep)
                await trio.sleep(0.01)
        await trio.sleep(0.3)  # and has streamed something
        n.start_soon(one, "retry")
    assert provider.count() == 1
    assert got["retry"][1] == got["buyer"][1] and data_events(got["retry"][1])[-1] == "[DONE]"
    assert got["retry"][0] < 1.5  # its first bytes came while the stream was still going
    # Its headers went out before the purchase was stored: "joined", not yet a replay; it is
    # counted as one once its end (stored) goes out.
    assert got["retry"][2]["x-ksfs-replay"] == "joined"
    assert got["buyer"][2]["x-ksfs-replay"] == "false"
    assert gw.usage("s1")["replays"] == 1 and len(events(ledger, "s1", "gateway.replay")) == 1


async def test_a_stream_request_answered_with_one_json_body_is_stored(store, ledger, provider,
                                                                      nursery):
    provider.stream_as_json = True
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("json please", stream=True)
    first = await call(port, body)
    assert first.status_code == 200 and first.json()["object"] == "chat.completion"
    again = await call(port, body)
    assert again.headers["x-ksfs-replay"] == "true" and again.content == first.content
    assert provider.count() == 1 and gw.usage("s1")["total_tokens"] == 2 + 7


@pytest.mark.parametrize("end", ["error_event", "drop"])
async def test_a_follower_of_a_stream_that_fails_is_not_told_it_was_a_replay(
        store, ledger, provider, nursery, end):
    """QA (last session): a duplicate that joined a stream in flight got `x-ksfs-replay: true`
    whatever became of the purchase; when it then failed (an error event, the connection
    dropped) nothing was bought to replay, yet its headers said it was a replay."""
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=30)
    port = await nursery.start(gw.serve_session, "s1")
    # a second between events: the follower, started 0.4 s in, joins long before the end
    provider.chunk_delay, provider.stream_end = 1.0, end
    body = chat_body(f"doomed to {end}", stream=True)
    got: dict[str, tuple[bytes, dict]] = {}

    async def one(name: str) -> None:
        async with client(port) as c, c.stream("POST", "/v1/chat/completions", json=body,
                                                headers={"idempotency-key": "k1"}) as r:
            got[name] = (b"".join([chunk async for chunk in r.aiter_raw()]), dict(r.headers))

    async with trio.open_nursery() as n:
        n.start_soon(one, "buyer")
        with trio.fail_after(10):
            while not provider.requests:  # the purchase is under way
                await trio.sleep(0.01)
        await trio.sleep(0.4)  # and has streamed something
        n.start_soon(one, "follower")
    assert provider.count() == 1
    (data, headers), (bought, buyer) = got["follower"], got["buyer"]
    assert data == bought  # the same attempt, so the same bytes and the same failure
    ends = data_events(data)
    assert "[DONE]" not in ends and ends[-1]["error"]["type"] in (
        "upstream_stream_incomplete", "upstream_unreachable")
    assert buyer["x-ksfs-replay"] == "false"
    assert headers["x-ksfs-replay"] == "joined", headers  # not "true": nothing was replayed
    assert headers["x-ksfs-key"] == buyer["x-ksfs-key"]
    assert events(ledger, "s1", "gateway.replay") == [] and gw.usage("s1")["replays"] == 0
    # A retry once it failed buys it again (nothing stored), as a fresh purchase.
    provider.chunk_delay, provider.stream_end = 0, None
    again = await call(port, body, key="k1")
    assert again.headers["x-ksfs-replay"] == "false" and data_events(again.content)[-1] == "[DONE]"
    assert provider.count() == 2


async def test_a_stream_broken_off_after_it_began_is_counted(store, ledger, provider, nursery):
    """Review (item 3): a stream the provider (or the path to it) broke off after it began
    (the connection dropped, the gateway's timeout) was recorded with 0 tokens and counted in
    no total, though the provider bills what it generated: a provider that always breaks off
    before [DONE] spent past any budget, each retry buying it again for free."""
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=30)
    gw.set_budget("s1", tokens=100)
    port = await nursery.start(gw.serve_session, "s1")
    provider.stream_end = "drop"
    codes = []
    for n in range(6):
        r = await call(port, chat_body(f"dropped {n}", stream=True))
        codes.append(r.status_code)
        if r.status_code == 200:  # the headers were out: the failure is in the stream
            err = data_events(r.content)[-1]["error"]
            assert err["type"] == "upstream_unreachable" and "broke off" in err["message"]
    # Each counted at an estimate (its request's size, three words' text): 37 tokens.
    assert codes == [200] * 3 + [402] * 3, codes
    calls = events(ledger, "s1", "gateway.call")
    guessed = len(json.dumps(chat_body("dropped 0", stream=True))) // 4 + len("this is the ") // 4
    assert [(e.body["stored"], e.body["error"], e.body["usage_known"]) for e in calls] == [
        (False, "upstream_unreachable", False)] * 3
    assert calls[0].body["total_tokens"] == guessed
    u = gw.usage("s1")
    assert (u["paid_calls"], u["upstream_errors"], u["total_tokens"]) == (3, 3, 3 * guessed)
    # One cut by the gateway's own timeout after it began is counted the same way.
    slow = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=1.0)
    provider.stream_end, provider.chunk_delay = None, 0.3
    sport = await nursery.start(slow.serve_session, "s2")
    r = await call(sport, chat_body("too slow", stream=True))
    assert data_events(r.content)[-1]["error"]["type"] == "upstream_timeout"
    (cut,) = events(ledger, "s2", "gateway.call")
    assert (cut.body["error"], cut.body["usage_known"]) == ("upstream_timeout", False)
    assert cut.body["total_tokens"] > len(json.dumps(chat_body("too slow", stream=True))) // 4
    assert slow.usage("s2")["paid_calls"] == 1


async def test_a_stream_the_gateway_stops_under_is_counted(store, ledger, provider):
    """Review (item 3): a stop under a stream that had begun recorded it with 0 tokens."""
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=30)
    provider.chunk_delay = 0.3
    async with trio.open_nursery() as n:
        port = await n.start(gw.serve_session, "s1")

        async def doomed() -> None:
            with contextlib.suppress(httpx.HTTPError):  # its server goes away under it
                await call(port, chat_body("stopped under", stream=True))

        n.start_soon(doomed)
        with trio.fail_after(10):  # some words are out, and the gateway has them
            while not any(call.status == 200 and call.chunks for call in gw._inflight.values()):
                await trio.sleep(0.01)
        await trio.sleep(0.5)
        n.cancel_scope.cancel()
    (cut,) = events(ledger, "s1", "gateway.call")
    assert (cut.body["error"], cut.body["stored"], cut.body["usage_known"]) == (
        "gateway_stopped", False, False)
    assert cut.body["total_tokens"] > len(json.dumps(chat_body("stopped under", stream=True))) // 4
    assert gw.usage("s1")["paid_calls"] == 1


async def test_only_codings_the_gateway_can_decode_are_asked_for_upstream(store, ledger,
                                                                         provider, nursery):
    """Review: the passthrough forwarded the guest's Accept-Encoding, and this httpx cannot
    decode br: a br answer went to the guest raw with its content-encoding dropped
    (undecodable bytes, and key masking could not see inside). Upstream is asked only for
    codings httpx decodes (identity when none is left), on every path."""
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)
    port = await nursery.start(gw.serve_session, "s1")
    decodable_here = {"identity", "gzip", "deflate", "zstd"}  # this venv's httpx: no br
    async with client(port) as c:
        for asked in ("br", "gzip, br;q=1.0, deflate", "*"):
            r = await c.get("/v1/models", headers={"accept-encoding": asked})
            assert r.status_code == 200
            sent = provider.requests[-1].headers["accept-encoding"]
            assert {x.split(";")[0].strip() for x in sent.split(",")} <= decodable_here, sent
        assert provider.requests[-1].headers["accept-encoding"] == "identity"
        assert provider.requests[-2].headers["accept-encoding"] == "gzip, deflate"
    r = await call(port, chat_body("paid"), headers={"accept-encoding": "br"})
    assert r.status_code == 200
    assert provider.requests[-1].headers["accept-encoding"] == "identity"
