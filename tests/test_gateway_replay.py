"""The gateway's replay store over real sockets: a call is bought once per key, duplicates and
retries get identical bytes, sessions cannot see each other's calls, forks see their parent's
calls up to the branch point only."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
from test_gateway_helpers import (  # with the shared fixtures, by name
    MARKER_KEY,
    call,
    chat_body,
    client,
    events,
    fork,
    ledger,
    provider,
    store,
    take_checkpoint,
    upstream,
)

from ksfs.errors import NoSuchSession
from ksfs.gateway import Gateway


@pytest.fixture
def gw(store, ledger, provider):
    return Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=10)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_same_key_sequential_is_bought_once(gw, ledger, provider, nursery, stream):
    port = await nursery.start(gw.serve_session, "s1")
    assert gw.ports == {"s1": port}
    first = await call(port, chat_body(stream=stream), key="k-1")
    second = await call(port, chat_body(stream=stream), key="k-1")
    assert first.status_code == second.status_code == 200
    assert provider.count() == 1
    assert first.content == second.content
    assert first.headers["x-ksfs-replay"] == "false"
    assert second.headers["x-ksfs-replay"] == "true"
    ctype = "text/event-stream" if stream else "application/json"
    assert first.headers["content-type"].startswith(ctype)
    assert second.headers["content-type"] == first.headers["content-type"]
    if stream:
        assert first.content.endswith(b"data: [DONE]\n\n")
        assert b'"usage"' in first.content
    else:
        assert json.loads(first.content)["usage"]["completion_tokens"] == 7
    (paid,) = events(ledger, "s1", "gateway.call")
    (replay,) = events(ledger, "s1", "gateway.replay")
    assert paid.body["key"] == replay.body["key"] == first.headers["x-ksfs-key"]
    assert paid.body["stored"] is True and paid.body["stream"] is stream
    assert replay.body["from_seq"] == paid.seq and replay.body["cost_usd"] == 0
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"]) == (1, 1)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_same_key_concurrent_waits_for_the_first(gw, ledger, provider, nursery, stream):
    provider.delay = 0.5  # all duplicates arrive while the first is in flight
    port = await nursery.start(gw.serve_session, "s1")
    results: list = []

    async def one() -> None:
        results.append(await call(port, chat_body(stream=stream), key="same"))

    async with trio.open_nursery() as n:
        for _ in range(4):
            n.start_soon(one)
    assert provider.count() == 1
    assert len({r.content for r in results}) == 1
    assert all(r.status_code == 200 for r in results)
    # A stream's duplicates follow it while in flight, before it is stored: "joined".
    assert sorted(r.headers["x-ksfs-replay"] for r in results) == ["false"] + [
        "joined" if stream else "true"] * 3
    assert len(events(ledger, "s1", "gateway.call")) == 1
    assert len(events(ledger, "s1", "gateway.replay")) == 3


async def test_derived_key_without_header(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("derive me a key")
    a = await call(port, body)
    # The same request written differently (key order, spacing) is the same call.
    b = await call(port, body, raw=json.dumps(body, indent=2, sort_keys=True).encode())
    c = await call(port, chat_body("a different request"))
    assert provider.count() == 2
    assert a.content == b.content != c.content
    assert a.headers["x-ksfs-key"] == b.headers["x-ksfs-key"] != c.headers["x-ksfs-key"]
    assert b.headers["x-ksfs-replay"] == "true"
    stream = chat_body("derive me a key", stream=True)
    s1, s2 = await call(port, stream), await call(port, stream)
    assert provider.count() == 3 and s1.content == s2.content


async def test_reused_header_key_with_other_request_is_refused(gw, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    assert (await call(port, chat_body("one"), key="k")).status_code == 200
    r = await call(port, chat_body("two"), key="k")
    assert r.status_code == 422
    assert r.json()["error"]["type"] == "idempotency_key_reused"
    assert provider.count() == 1


async def test_a_header_key_in_flight_for_another_request_is_refused_at_once(
        gw, provider, nursery):
    """QA (eleventh session): the second request waited for the first's purchase and, when
    that failed, got its upstream error instead of 422."""
    port = await nursery.start(gw.serve_session, "s1")
    provider.delay, provider.error = 4.0, 500
    got: dict[str, object] = {}

    async def first() -> None:
        got["first"] = await call(port, chat_body("one"), key="k")

    async with trio.open_nursery() as inner:
        inner.start_soon(first)
        with trio.fail_after(10):
            while provider.active == 0:  # the first is being bought (a fixed sleep raced)
                await trio.sleep(0.01)
        with trio.fail_after(3):  # before the first's answer comes
            got["second"] = await call(port, chat_body("two"), key="k")
    assert got["second"].status_code == 422
    assert got["second"].json()["error"]["type"] == "idempotency_key_reused"
    assert got["first"].status_code == 500 and provider.count() == 1


async def test_sessions_do_not_see_each_other(gw, ledger, provider, nursery):
    p1 = await nursery.start(gw.serve_session, "s1")
    p2 = await nursery.start(gw.serve_session, "s2")
    assert p1 != p2
    for key in ("shared-key", None):  # header keys and derived keys alike
        a = await call(p1, chat_body("private"), key=key)
        b = await call(p2, chat_body("private"), key=key)
        assert a.content != b.content
        assert a.headers["x-ksfs-replay"] == b.headers["x-ksfs-replay"] == "false"
    assert provider.count() == 4
    assert events(ledger, "s2", "gateway.replay") == []
    assert gw.usage("s2")["paid_calls"] == 2


async def test_fork_sees_parent_calls_up_to_branch_only(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    before = await call(port, chat_body("before the checkpoint"))
    before_key = await call(port, chat_body("keyed before"), key="kb")
    take_checkpoint(ledger, "s1", "c1")
    after = await call(port, chat_body("after the checkpoint"))
    fork(ledger, "s1", "c1", "f1")
    take_checkpoint(ledger, "f1", "fc1")
    fork(ledger, "f1", "fc1", "g1")  # a grandchild sees through both hops
    asked = provider.count()
    for child in ("f1", "g1"):
        fport = await nursery.start(gw.serve_session, child)
        r1 = await call(fport, chat_body("before the checkpoint"))
        r2 = await call(fport, chat_body("keyed before"), key="kb")
        assert (r1.content, r2.content) == (before.content, before_key.content)
        assert r1.headers["x-ksfs-replay"] == r2.headers["x-ksfs-replay"] == "true"
        assert provider.count() == asked
        r3 = await call(fport, chat_body("after the checkpoint"))
        assert r3.headers["x-ksfs-replay"] == "false" and r3.content != after.content
        assert provider.count() == asked + 1
        asked += 1
        (replay, _) = events(ledger, child, "gateway.replay")
        assert replay.body["from_session"] == "s1"
        # the purchase is found by its own key too (QA, eighteenth session)
        paid = next(e for e in events(ledger, "s1", "gateway.call")
                    if e.seq == replay.body["from_seq"])
        assert replay.body["from_key"] == paid.body["key"] != replay.body["key"]
    # The fork's own purchase is its own: the parent still gets its own stored answer.
    again = await call(port, chat_body("after the checkpoint"))
    assert again.content == after.content and provider.count() == asked


async def test_restored_session_sees_all_its_own_calls(gw, ledger, provider, nursery):
    # A restore keeps the session's lineage, so a call made after the checkpoint is still a
    # replay when the guest repeats it from the restored state.
    port = await nursery.start(gw.serve_session, "s1")
    take_checkpoint(ledger, "s1", "c1")
    a = await call(port, chat_body("made after c1"))
    ledger.record("s1", "restore.done", {"checkpoint": "c1"})
    b = await call(port, chat_body("made after c1"))
    assert a.content == b.content and provider.count() == 1


async def test_other_paths_pass_through_unstored(gw, ledger, provider, nursery):
    port = await nursery.start(gw.serve_session, "s1")
    async with client(port) as c:
        r1 = await c.get("/v1/models?limit=5", headers={"authorization": "Bearer guest"})
        r2 = await c.get("/v1/models?limit=5")
        missing = await c.get("/v1/nothing")
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["data"][0]["id"] == "gpt-4o-mini" and r1.json()["query"] == "limit=5"
    assert missing.status_code == 404
    assert provider.count("/v1/models") == 2
    assert "x-ksfs-replay" not in r1.headers
    assert provider.requests[0].headers["authorization"] == f"Bearer {MARKER_KEY}"
    assert [e.type for e in ledger.events("s1")] == ["session.created"]


async def test_bad_requests_and_unknown_session(gw, provider, nursery):
    with pytest.raises(NoSuchSession):
        await nursery.start(gw.serve_session, "nobody")
    port = await nursery.start(gw.serve_session, "s1")
    r = await call(port, {}, raw=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert provider.count() == 0


async def test_guest_that_hangs_up_mid_call_gets_the_stored_answer(gw, ledger, provider,
                                                                   nursery):
    # What a save/restore does to a guest's open call: the connection goes away. The purchase
    # goes on, is stored, and the guest's retry is a replay.
    provider.delay = 0.8
    port = await nursery.start(gw.serve_session, "s1")
    async with trio.open_nursery() as guest:
        guest.start_soon(call, port, chat_body("interrupted call"), "cut")
        with trio.fail_after(20):
            while provider.count() == 0:  # hang up once the purchase is under way
                await trio.sleep(0.01)
        guest.cancel_scope.cancel()
    retry = await call(port, chat_body("interrupted call"), key="cut")  # waits, then replays
    assert retry.status_code == 200 and retry.headers["x-ksfs-replay"] == "true"
    assert provider.count() == 1
    u = gw.usage("s1")
    assert (u["paid_calls"], u["replays"]) == (1, 1)
    assert (await call(port, chat_body("the server is still fine"))).status_code == 200


async def test_stored_answers_outlive_the_gateway(store, ledger, provider, nursery):
    first = Gateway(store, ledger, provider.url, api_key=MARKER_KEY)
    async with trio.open_nursery() as inner:
        port = await inner.start(first.serve_session, "s1")
        a = await call(port, chat_body("remember me", stream=True))
        inner.cancel_scope.cancel()
    assert first.ports == {}
    second = Gateway(store, ledger, provider.url, api_key=MARKER_KEY)
    port = await nursery.start(second.serve_session, "s1")
    b = await call(port, chat_body("remember me", stream=True))
    assert a.content == b.content and b.headers["x-ksfs-replay"] == "true"
    assert provider.count() == 1


async def test_stream_is_passed_through_and_ends_only_once_stored(gw, ledger, provider,
                                                                  nursery):
    provider.chunk_delay = 0.15
    port = await nursery.start(gw.serve_session, "s1")
    got = b""
    stored_when_first_bytes = stored_when_done = None
    async with client(port) as c:
        async with c.stream("POST", "/v1/chat/completions",
                            json=chat_body("stream me", stream=True)) as r:
            assert r.headers["x-ksfs-replay"] == "false"
            async for chunk in r.aiter_raw():
                if not got:
                    stored_when_first_bytes = len(events(ledger, "s1", "gateway.call"))
                got += chunk
                if b"[DONE]" in got and stored_when_done is None:
                    stored_when_done = len(events(ledger, "s1", "gateway.call"))
    # The guest saw the stream start before it was complete (nothing stored yet) and saw its
    # end only after it was stored.
    assert (stored_when_first_bytes, stored_when_done) == (0, 1)
    again = await call(port, chat_body("stream me", stream=True))
    assert again.content == got and again.headers["x-ksfs-replay"] == "true"
    assert provider.count() == 1


async def test_stream_cut_by_upstream_is_not_stored(store, ledger, provider, nursery):
    gw = Gateway(store, ledger, provider.url, api_key=MARKER_KEY, timeout=1.5)
    provider.chunk_delay = 0.4  # the whole stream takes longer than the timeout
    port = await nursery.start(gw.serve_session, "s1")
    r = await call(port, chat_body("too slow", stream=True))
    assert r.status_code == 200  # the headers were already out
    assert b"[DONE]" not in r.content
    assert r.content.rstrip().endswith(b'"type": "upstream_timeout"}}')
    assert events(ledger, "s1", "gateway.call")[0].body["stored"] is False
    provider.chunk_delay = 0
    ok = await call(port, chat_body("too slow", stream=True))
    assert ok.content.endswith(b"data: [DONE]\n\n") and provider.count() == 2


async def test_session_token_keeps_other_guests_out(gw, ledger, provider, nursery):
    # Every guest reaches every loopback port through QEMU user networking, so a session's
    # server can demand its own token as the guest's API key.
    port = await nursery.start(partial(gw.serve_session, "s1", token="tok-s1"))
    assert (await call(port, chat_body())).status_code == 401
    wrong = await call(port, chat_body(), headers={"authorization": "Bearer tok-s2"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_api_key"
    async with client(port) as c:
        assert (await c.get("/v1/models")).status_code == 401
    assert provider.requests == []
    ok = await call(port, chat_body(), headers={"authorization": "Bearer tok-s1"})
    assert ok.status_code == 200
    assert provider.requests[0].headers["authorization"] == f"Bearer {MARKER_KEY}"
    assert [e.type for e in ledger.events("s1")] == ["session.created", "gateway.call"]


async def test_guest_that_hangs_up_mid_stream_gets_it_whole_on_retry(gw, ledger, provider,
                                                                     nursery):
    provider.chunk_delay = 0.1
    port = await nursery.start(gw.serve_session, "s1")
    body = chat_body("a stream cut short", stream=True)
    async with client(port) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for first in r.aiter_raw():
                assert first.startswith(b"data: ")
                break  # hang up after the first bytes
    retry = await call(port, body)  # joins the stream still in flight
    assert retry.status_code == 200 and retry.headers["x-ksfs-replay"] == "joined"
    assert retry.content.startswith(first) and retry.content.endswith(b"data: [DONE]\n\n")
    assert provider.count() == 1 and gw.usage("s1")["replays"] == 1  # a replay once stored
    assert (await call(port, chat_body("still serving"))).status_code == 200


async def test_gc_frees_responses_no_session_can_replay(gw, store, ledger, provider, nursery):
    """`gc` drops the stored responses of a removed session nothing descends from, and keeps
    those of a removed parent whose fork may still replay them."""
    from ksfs.keeper import Keeper

    p1 = await nursery.start(gw.serve_session, "s1")
    p2 = await nursery.start(gw.serve_session, "s2")
    kept = await call(p1, chat_body("the parent's call"))
    await call(p2, chat_body("a call of a session that goes"))
    take_checkpoint(ledger, "s1", "c1")
    fork(ledger, "s1", "c1", "f1")
    for name in ("s1", "s2"):
        with store.env.begin(write=True) as txn:
            ledger.remove_session(txn, name)
    with Keeper(store.path) as k:
        result = k.gc()
    assert result["gateway_responses_freed"] == 1 and result["gateway_bytes_freed"] > 0
    asked = provider.count()
    fport = await nursery.start(gw.serve_session, "f1")
    again = await call(fport, chat_body("the parent's call"))
    assert again.content == kept.content and again.headers["x-ksfs-replay"] == "true"
    assert provider.count() == asked
    with Keeper(store.path) as k:
        assert k.gc()["gateway_responses_freed"] == 0
