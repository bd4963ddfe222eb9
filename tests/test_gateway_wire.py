"""What crosses the wire to the provider (QA of the eighth session): the request target is a
path on the provider and nothing else, sent as the guest encoded it; streams are stored only
when they ended as a complete answer; a compressed answer is stored decoded."""

from __future__ import annotations

import json

import trio
from test_gateway_helpers import (  # with the shared fixtures, by name
    MARKER_KEY,
    chat_body,
    client,
    events,
    ledger,
    provider,
    store,
    upstream,
)

from ksfs.gateway import Gateway


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
