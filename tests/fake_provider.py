"""A small real model provider on 127.0.0.1 for tests: OpenAI-style chat completions (JSON and
server-sent events, with usage), embeddings, the Responses API (``/v1/responses``, JSON and its
typed server-sent events, usage as input/output tokens), file uploads and batches (objects that
name no model and carry no usage), a models list, a configurable delay and
error mode, and counters of what it was asked.

It is deliberately built on the standard library's http.server (a thread per connection), not on
the gateway's own stack, so a test of the gateway never checks that stack against itself. It never
listens anywhere but loopback. Use it as a context manager:

    with FakeProvider(delay=0.2) as up:
        up.url                     # http://127.0.0.1:PORT  (the gateway's --upstream)
        up.count("/v1/chat/completions")
        up.requests[-1].headers    # what the last request carried (e.g. Authorization)
        up.error = 500             # next calls answer 500; "hang" never answers; "close" drops
        up.reset()

or standalone (for an end-to-end test with a guest): ``python tests/fake_provider.py --port 0
[--delay S]`` prints ``listening on http://127.0.0.1:PORT`` and serves until killed.
"""

from __future__ import annotations

import argparse
import gzip
import http.server
import json
import threading
import time
from dataclasses import dataclass

COMPLETION_WORDS = ["this", "is", "the", "fake", "provider", "answering", "you"]


@dataclass(frozen=True)
class Seen:
    """One request the provider received."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes


class FakeProvider:
    """The server; attributes may be changed between calls (they are read per request)."""

    def __init__(self, delay: float = 0.0, error: int | str | None = None,
                 stream_usage: bool = True, chunk_delay: float = 0.0) -> None:
        self.delay = delay
        self.error = error
        # True: as OpenAI, a stream's usage (and "usage": null on its other chunks) only when
        # the request asks with stream_options.include_usage; False: never.
        self.stream_usage = stream_usage
        self.json_usage = True  # False: JSON chat answers carry no usage (some servers' way)
        self.usage_as = None  # a dict: the usage chat answers carry instead ({}, nulls)
        self.chunk_delay = chunk_delay
        # "no_done": no [DONE]; "error_event": fails mid-way; "drop": the connection is closed
        # after three events, the chunked body never ended (a provider or a proxy that dies)
        self.stream_end: str | None = None
        self.gzip = False  # compress JSON answers although asked for identity
        self.reject_stream_options = False  # 400 for stream_options, as some servers do
        self.stream_as_json = False  # answer a stream request with one JSON body
        self.answer_model: str | None = None  # the model named in answers (a router's name)
        self.words = list(COMPLETION_WORDS)  # the completion's words (JSON-escaped as sent)
        # A 200 that is no completion: "error_object" ({"error": ...}) or "html" (a front
        # server's page), as some providers and proxies answer.
        self.ok_but: str | None = None
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._serial = 0
        self.active = 0  # requests inside their delay now
        self.most_active = 0  # the most that ever were at once (reset() clears it)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, port: int = 0) -> FakeProvider:
        provider = self

        class Handler(_Handler):
            fake = provider

        self._server = QuietServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wakes handlers sleeping in a delay or a hang
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(10)
            self._server = None

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- what it was asked ------------------------------------------------------------------

    def count(self, path: str = "/v1/chat/completions") -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.path.split("?")[0] == path)

    def reset(self) -> None:
        """Forget what was asked, restore the defaults and release any handler still hanging."""
        with self._lock:
            self.requests.clear()
        old, self._stop = self._stop, threading.Event()
        old.set()
        self.delay, self.error, self.stream_usage, self.chunk_delay = 0.0, None, True, 0.0
        self.json_usage, self.usage_as = True, None
        self.stream_end, self.gzip, self.reject_stream_options = None, False, False
        self.stream_as_json = False
        self.answer_model, self.words, self.ok_but = None, list(COMPLETION_WORDS), None
        self.most_active = 0

    def _note(self, seen: Seen) -> int:
        with self._lock:
            self.requests.append(seen)
            self._serial += 1
            return self._serial

    def sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def delayed(self) -> None:
        """The configured delay, counted in ``active``/``most_active`` while it runs."""
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            self.sleep(self.delay)
        finally:
            with self._lock:
                self.active -= 1


class QuietServer(http.server.ThreadingHTTPServer):
    """A threaded HTTP server that takes a client going away mid-answer (a gateway cancelling a
    call, a test closing its connection) as the normal event it is here, not a traceback on
    the test run's output; any other error is printed as before."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    fake: FakeProvider
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet in test output
        pass

    def _read(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _json(self, status: int, obj: object, split_at: int | None = None) -> None:
        """``split_at``: the body goes out in two writes, cut there, a moment apart."""
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if self.fake.gzip:
            raw = gzip.compress(raw)
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("X-Request-Id", f"req-{time.monotonic_ns()}")
        self.end_headers()
        cut = len(raw) if split_at is None else split_at
        for piece in (raw[:cut], raw[cut:]):
            self.wfile.write(piece)
            if split_at is not None:
                self.wfile.flush()
                time.sleep(0.05)

    def _seen(self, body: bytes) -> int:
        headers = {k.lower(): v for k, v in self.headers.items()}
        return self.fake._note(Seen(self.command, self.path, headers, body))

    def _bad_key(self) -> None:
        """As OpenAI answers a wrong key: the key it was given, partly masked."""
        given = self.headers.get("Authorization", "").removeprefix("Bearer ")
        self._json(401, {"error": {"type": "invalid_request_error", "code": "invalid_api_key",
                                   "message": "Incorrect API key provided: "
                                              f"{given[:8]}{'*' * 20}{given[-4:]}."}})

    def do_GET(self) -> None:
        self._seen(b"")
        if self.fake.error == 401:
            self._bad_key()
        elif self.path.split("?")[0] == "/v1/whoami":  # a debug route that echoes the request
            self._json(200, {"authorization": self.headers.get("Authorization", "")},
                       split_at=30)  # the key split between two writes
        elif self.path.split("?")[0] == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model"}],
                             "query": self.path.partition("?")[2]})
        else:
            self._json(404, {"error": {"type": "not_found", "message": self.path}})

    def do_POST(self) -> None:
        body = self._read()
        serial = self._seen(body)
        fake = self.fake
        route = self.path.split("?")[0]
        if route in ("/v1/files", "/v1/batches"):
            self._resource(route, body, serial)
            return
        if route not in ("/v1/chat/completions", "/v1/embeddings", "/v1/responses"):
            self._json(404, {"error": {"type": "not_found", "message": self.path}})
            return
        if fake.delay:
            fake.delayed()
        if fake.error == "hang":
            fake.sleep(60)
            self.close_connection = True
            return
        if fake.error == "close":
            self.close_connection = True
            return
        if fake.error == 401:
            self._bad_key()
            return
        if isinstance(fake.error, int):
            self._json(fake.error, {"error": {"type": "server_error",
                                              "message": f"fake failure {serial}"}})
            return
        if fake.ok_but == "error_object":
            self._json(200, {"error": {"type": "server_error", "message": "overloaded"}})
            return
        if fake.ok_but == "html":
            page = b"<html><body>502 Bad Gateway</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return
        req = json.loads(body)
        model = fake.answer_model or req.get("model", "unknown")
        if fake.reject_stream_options and "stream_options" in req:
            self._json(400, {"error": {"type": "invalid_request_error", "param": None,
                                       "message": "Unrecognized request argument supplied: "
                                                  "stream_options"}})
            return
        if route == "/v1/embeddings":
            self._embeddings(req, model)
            return
        if route == "/v1/responses":
            self._responses(req, model, serial)
            return
        words = sum(len(str(m.get("content", "")).split()) for m in req.get("messages", []))
        usage = {"prompt_tokens": words, "completion_tokens": len(fake.words),
                 "total_tokens": words + len(fake.words)}
        if fake.usage_as is not None:
            usage = dict(fake.usage_as)
        cid = f"chatcmpl-{serial}-{time.monotonic_ns()}"  # differs on every real call
        if req.get("stream") and not fake.stream_as_json:
            asked = (req.get("stream_options") or {}).get("include_usage") is True
            self._stream(cid, model, usage if asked and self.fake.stream_usage else None)
            return
        answer = {
            "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant",
                                     "content": " ".join(fake.words)}}],
        }
        self._json(200, dict(answer, usage=usage) if fake.json_usage else answer)

    def _stream(self, cid: str, model: str, usage: dict | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        if usage is not None:
            base["usage"] = None  # as OpenAI: every chunk has it once usage is asked for
        events = [dict(base, choices=[{"index": 0, "delta": {"content": w + " "}}])
                  for w in self.fake.words]
        if self.fake.stream_end == "error_event":  # as OpenAI reports a failure mid-stream
            events = events[:3] + [{"error": {"type": "server_error", "code": None,
                                              "message": "The server had an error"}}]
        else:
            events.append(dict(base, choices=[{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]))
        if usage is not None and self.fake.stream_end != "error_event":
            events.append(dict(base, choices=[], usage=usage))
        if self.fake.stream_end == "drop":
            events = events[:3]
        for ev in events:
            self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if self.fake.chunk_delay:
                self.fake.sleep(self.fake.chunk_delay)
        if self.fake.stream_end == "drop":
            self.close_connection = True  # no last chunk: the body never ends
            return
        if self.fake.stream_end is None:
            self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _resource(self, route: str, body: bytes, serial: int) -> None:
        """As the real endpoints answer a file upload and a batch's creation: an object that
        names no model and carries no usage (what a batch costs is billed as it runs)."""
        now = int(time.time())
        if route == "/v1/files":
            self._json(200, {"id": f"file-{serial}", "object": "file", "bytes": len(body),
                             "created_at": now, "filename": "upload", "purpose": "batch"})
            return
        req = json.loads(body or b"{}")
        self._json(200, {"id": f"batch_{serial}", "object": "batch", "status": "validating",
                         "endpoint": req.get("endpoint"), "created_at": now,
                         "input_file_id": req.get("input_file_id"),
                         "completion_window": req.get("completion_window")})

    def _embeddings(self, req: dict, model: str) -> None:
        # As the real endpoint: one vector per input string, usage with prompt and total only.
        inputs = req.get("input", "")
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        tokens = sum(len(str(i).split()) for i in inputs)
        self._json(200, {
            "object": "list", "model": model,
            "data": [{"object": "embedding", "index": n,
                      "embedding": [round(0.001 * (n + 1) * (d + 1), 6) for d in range(8)]}
                     for n in range(len(inputs))],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    def _responses(self, req: dict, model: str, serial: int) -> None:
        # The Responses API: usage says input_tokens/output_tokens; a stream is typed events
        # ("event: NAME" + "data: {...}") ending in response.completed, with no [DONE].
        given = req.get("input", "")
        if isinstance(given, list):
            given = " ".join(str(m.get("content", "")) if isinstance(m, dict) else str(m)
                             for m in given)
        words = len(str(given).split())
        rid = f"resp_{serial}_{time.monotonic_ns()}"
        text = " ".join(COMPLETION_WORDS)
        usage = {"input_tokens": words, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": len(COMPLETION_WORDS),
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": words + len(COMPLETION_WORDS)}
        message = {"type": "message", "id": f"msg_{serial}", "status": "completed",
                   "role": "assistant",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}
        done = {"id": rid, "object": "response", "created_at": int(time.time()),
                "status": "completed", "model": model, "output": [message], "usage": usage}
        if not req.get("stream"):
            self._json(200, done)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        started = dict(done, status="in_progress", output=[], usage=None)
        events = [{"type": "response.created", "response": started}]
        events += [{"type": "response.output_text.delta", "item_id": f"msg_{serial}",
                    "output_index": 0, "content_index": 0, "delta": w + " "}
                   for w in COMPLETION_WORDS]
        events.append({"type": "response.completed", "response": done})
        for n, ev in enumerate(events):
            ev = dict(ev, sequence_number=n)
            self._chunk(f"event: {ev['type']}\n".encode() + b"data: "
                        + json.dumps(ev).encode() + b"\n\n")
            if self.fake.chunk_delay:
                self.fake.sleep(self.fake.chunk_delay)
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description="fake OpenAI-style provider on 127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args()
    fake = FakeProvider(delay=args.delay).start(args.port)
    print(f"listening on {fake.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        fake.stop()


if __name__ == "__main__":
    main()
