"""The gateway service: one HTTP server per session, on its own loopback port, over one store.

``Gateway.serve_session`` runs hypercorn (trio worker) with a small raw-ASGI app for one session;
the daemon runs one per session in its nursery, the CLI one for a standalone gateway. A paid call
(a chat completion, or any other request that may cost money: every POST and every request with
a body) is looked up in the store first (a replay costs nothing), then checked against the
budget, then bought from the provider exactly once per key: the upstream call runs as a task of
the session's nursery, not of the request, so a guest that drops its connection (a save, a
restore) does not lose a response it already paid for, and duplicates wait on it. This module
must never hand a guest a completed response that is not yet committed to the store, and never
let the API key reach the store, an event or a log line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

from ksfs.errors import BadInput
from ksfs.gateway.admission import BudgetGate, Elsewhere, Reckoning
from ksfs.gateway.app import asgi_app
from ksfs.gateway.calls import (
    CAP_MAX,
    CHAT_PATH,
    USAGE_MAX,
    Usage,
    answer_text_bytes,
    derived_key,
    estimated_tokens,
    estimated_usage,
    form_model,
    header_key,
    is_chat,
    not_an_answer,
    paid_body,
    request_digest,
    route_scope,
    usage_of_json,
)
from ksfs.gateway.inflight import (
    Call,
    StreamThrough,
    header,
    ksfs_headers,
    reply_of,
    stopped_reply,
)
from ksfs.gateway.prices import PriceTable, load_prices
from ksfs.gateway.sse import (
    RESPONSES_PATH,
    HiddenUsage,
    ended,
    generated_text_bytes,
    incomplete,
    usage_of_sse,
    wants_usage_added,
    with_usage,
)
from ksfs.gateway.store import GatewayStore, StoredResponse, View, used_up
from ksfs.gateway.upstream import (
    NOT_STORED,
    CutShort,
    Fetched,
    Headers,
    Reply,
    Upstream,
    error_reply,
    keep_headers,
    without_keys,
)
from ksfs.ledger.keys import lineage_bytes

log = logging.getLogger("ksfs.gateway")

MAX_BODY = 16 * 1024 * 1024
# The completion tokens reserved, while it is in flight, for a request that sets no cap of its
# own (max_tokens, max_completion_tokens, max_output_tokens): admission.BudgetGate.
DEFAULT_COMPLETION_RESERVE = 4096
# How long a request's body may go without a byte arriving (then 408; its whole time is bound
# too: app.body_deadline), and how many requests one gateway reads and answers at once, all
# its sessions together (past it, 503): QA F4.
READ_TIMEOUT = 60.0
KEEP_ALIVE_S = 5.0  # hypercorn's own default
MAX_CONNECTIONS = 256
DEFAULT_TIMEOUT = 300.0
DRAIN_POLL_S = 0.02
# How long a purchase the budget gate holds back (calls in flight may spend what is left)
# waits for room before it is answered 429 held_back_by_calls_in_flight.
ADMISSION_WAIT = 60.0
ELSEWHERE_POLL_S = 0.25  # how often a purchase held back by another gateway's looks again
STOP_DRAIN_S = 30.0  # how long a stop waits for calls in flight to be stored
ABORT_WRITE_S = 1.0  # after a second signal, how long the answers still open have to end
API_KEY_ENV = ("KSFS_UPSTREAM_API_KEY", "OPENAI_API_KEY")


def api_key_from_env() -> str | None:
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


@dataclass
class Served:
    """What one session's server holds while it runs."""

    session: str
    nursery: trio.Nursery
    upstream: Upstream
    token: str | None = None  # when set, every request must carry "Authorization: Bearer TOKEN"


@dataclass(frozen=True)
class Route:
    """Where a paid call goes upstream: method, path and raw query, as the guest sent them."""

    method: str
    path: str
    query: bytes = b""
    wire: str = ""  # the path as sent upstream: the guest's, still percent-encoded


@dataclass(frozen=True)
class Order:
    """One purchase as the buyer task makes it."""

    route: Route
    headers: Headers
    body: bytes  # as the guest sent it
    model: str | None
    stream: bool
    digest: str
    ask_usage: bool = False  # a chat stream sent with include_usage added on the guest's behalf
    prompt_bytes: int = 0  # the size of a JSON request, a prompt's if the answer has no usage
    # (prompt tokens, completion tokens, USD, priced) the purchase is reserved at
    reserved: tuple[int, int, float, bool] = (0, 0, 0.0, False)


def check_upstream(upstream_url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """BadInput unless the provider's URL is http(s)://HOST[...] and the timeout positive."""
    from urllib.parse import urlsplit

    if not upstream_url.startswith(("http://", "https://")):
        raise BadInput(f"upstream URL {upstream_url!r} must start with http:// or https://")
    try:
        host = urlsplit(upstream_url).hostname
    except ValueError:
        host = None
    if not host:
        raise BadInput(f"upstream URL {upstream_url!r} names no host")
    if not timeout > 0:
        raise BadInput(f"upstream timeout must be > 0 seconds, not {timeout!r}")


class Gateway:
    """Model-call gateway over one store. Invariant: a completed response reaches a guest only
    after it and its ``gateway.call`` event are committed, and a key is bought at most once
    per lineage while its stored response exists."""

    def __init__(self, store: Any, ledger: Any, upstream_url: str,
                 prices: PriceTable | str | Path | None = None, api_key: str | None = None,
                 *, timeout: float = DEFAULT_TIMEOUT, max_body: int = MAX_BODY,
                 completion_reserve: int = DEFAULT_COMPLETION_RESERVE,
                 read_timeout: float = READ_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS,
                 admission_wait: float = ADMISSION_WAIT) -> None:
        check_upstream(upstream_url, timeout)
        if not (isinstance(read_timeout, int | float) and 0 < read_timeout < float("inf")):
            raise BadInput(f"the read timeout must be a number of seconds > 0, not "
                           f"{read_timeout!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
                or max_connections < 1:
            raise BadInput(f"the connection limit must be a whole number >= 1, not "
                           f"{max_connections!r}")
        if not (isinstance(admission_wait, int | float) and not isinstance(admission_wait, bool)
                and 0 < admission_wait < float("inf")):
            raise BadInput(f"the admission wait must be a number of seconds > 0, not "
                           f"{admission_wait!r}")
        self.admission_wait = float(admission_wait)
        self.read_timeout = float(read_timeout)
        self.max_connections = max_connections
        self.open_requests = 0  # requests being read or answered, all sessions together
        self.open_by_session: dict[str, int] = {}  # the same, per session
        if isinstance(completion_reserve, bool) or not isinstance(completion_reserve, int) \
                or not 0 < completion_reserve <= CAP_MAX:
            raise BadInput(f"the completion reserve must be a whole number of tokens from 1 "
                           f"to {CAP_MAX}, not {completion_reserve!r}")
        self.completion_reserve = completion_reserve
        self.db = GatewayStore(store, ledger)
        self.ledger = ledger
        self.upstream_url = upstream_url
        self.prices = prices if isinstance(prices, PriceTable) else load_prices(prices)
        self._api_key = api_key or api_key_from_env()
        self.timeout = timeout
        self.max_body = max_body
        self.ports: dict[str, int] = {}  # session -> bound port, while served
        # session -> what keeps its server from running (the daemon's supervisor says it here:
        # a port in use, tried again), shown in usage()
        self.problems: dict[str, str] = {}
        self._inflight: dict[bytes, Call] = {}
        self._gate = BudgetGate()
        self.stopping = False  # set by drain(): no new purchase starts
        self._settling = False  # a settle_lost under way
        self.answering = 0  # paid requests being answered (the app counts them)

    def __repr__(self) -> str:  # never show the key
        return f"Gateway({self.upstream_url!r}, sessions={sorted(self.ports)})"

    # --- the synchronous face (keeper, mount, CLI) --------------------------------------------

    def usage(self, session: str) -> dict[str, Any]:
        """JSON-able usage of ``session``: paid calls, replays, tokens, cost, budget, and
        ``server``: whether this gateway serves it now, on which port, and what keeps it from
        doing so (e.g. a port in use, being tried again)."""
        out = self.db.usage(session)
        out["server"] = {"listening": session in self.ports, "port": self.ports.get(session),
                         "problem": self.problems.get(session)}
        return out

    def budget(self, session: str) -> dict[str, Any] | None:
        return self.db.budget(session)

    def set_budget(self, session: str, tokens: int | None = None, usd: float | None = None):
        """Replace the session's budget (None, None removes it); records ``budget.set``."""
        return self.db.set_budget(session, tokens=tokens, usd=usd)

    # --- serving ------------------------------------------------------------------------------

    def session_connections(self) -> int:
        """How many of max_connections one session's requests may hold: all of them when it
        is the only session served, else all but a quarter (at least one), kept for the
        others."""
        if len(self.ports) <= 1:
            return self.max_connections
        return max(1, self.max_connections - max(1, self.max_connections // 4))

    def inflight_count(self) -> int:
        return len(self._inflight)

    @property
    def stop_wait(self) -> float:
        """How long a stop (`gateway serve` signalled, the daemon unmounted) waits for the
        purchases in flight: STOP_DRAIN_S, or the upstream timeout when shorter, since no
        purchase takes longer than that."""
        return min(STOP_DRAIN_S, self.timeout)

    async def drain(self, timeout: float) -> int:
        """Start no new purchase and wait (up to ``timeout`` s) for those in flight to be
        stored, so a stop does not throw away calls already paid for; returns how many are
        still in flight. Replays, and duplicates of calls in flight, are still answered."""
        self.stopping = True
        with trio.move_on_after(timeout):
            # Until every purchase is stored and every paid answer written out to its guest.
            while self._inflight or self.answering:
                await trio.sleep(DRAIN_POLL_S)
        return len(self._inflight)

    async def stop_now(self, write_s: float = ABORT_WRITE_S) -> None:
        """``abort``, then give the answers it ended up to ``write_s`` seconds to be written
        out before the caller cancels the servers (a second signal to `ksfs gateway serve`
        or to the daemon)."""
        self.abort()
        with trio.move_on_after(write_s):
            while self.answering:
                await trio.sleep(0.02)

    def abort(self) -> None:
        """Stop at once (a second signal): every answer still waiting on a purchase in flight
        ends now with the gateway's 503 ``gateway_stopping`` (a stream with it as its last
        event) instead of being cut off when the servers are cancelled (QA F12); the callers
        give the answers a moment to be written (``answering``) before cancelling."""
        self.stopping = True
        for call in list(self._inflight.values()):
            call.abort()

    async def _settle_lost(self) -> None:
        """Count the purchases gateways killed under them left recorded (QA F7)."""
        self._settling = True
        try:
            lost = await trio.to_thread.run_sync(self.db.settle_lost)
        finally:
            self._settling = False
        if lost:
            log.warning("counted %d call(s) a gateway that stopped under them had made, at "
                        "what each was reserved at", lost)

    async def serve_session(self, session: str, port: int = 0, host: str = "127.0.0.1", *,
                            token: str | None = None,
                            task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                            ) -> None:
        """Serve ``session`` on host:port (0: any free port) until cancelled.

        ``await nursery.start(gw.serve_session, "s1")`` returns the bound port; it is also in
        ``gw.ports`` while the server runs. With ``token``, a request must carry
        ``Authorization: Bearer TOKEN`` (the guest's "API key") or gets 401: every guest can
        reach every loopback port, so the port alone does not keep sessions apart.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            # (QA F13: 99999 went as far as the bind, an OverflowError in a nursery's group)
            raise BadInput(f"port {port!r} is not a TCP port: give 1 to 65535, or 0 for any "
                           "free one")
        self.db.view(session)  # NoSuchSession now, not on the first call
        # Purchases a gateway killed under them left recorded: counted now (QA F7).
        await self._settle_lost()
        if session in self.ports:
            raise BadInput(f"session {session!r} is already served on port {self.ports[session]}")
        config = hypercorn.config.Config()
        config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("ksfs.gateway.http")
        config.include_server_header = False
        config.graceful_timeout = 1.0
        # A connection with no request under way (none yet, its headers trickling in, or idle
        # between two) is closed after this; a request's body has read_timeout (the app).
        config.keep_alive_timeout = min(KEEP_ALIVE_S, self.read_timeout)
        upstream = Upstream(self.upstream_url, self._api_key, self.timeout)
        try:
            async with trio.open_nursery() as nursery:
                served = Served(session, nursery, upstream, token)
                app = partial(asgi_app, self, served)
                binds = await nursery.start(partial(hypercorn.trio.serve, app, config,
                                                    mode="asgi"))
                bound = int(binds[0].rsplit(":", 1)[1])
                self.ports[session] = bound
                log.info("gateway for session %s on %s", session, binds[0])
                task_status.started(bound)
        finally:
            self.ports.pop(session, None)
            with trio.CancelScope(shield=True):
                await upstream.aclose()

    # --- one paid call ------------------------------------------------------------------------

    async def paid_call(self, served: Served, method: str, path: str, query: bytes,
                        headers: Headers, body: bytes, wire: str | None = None,
                        gone: trio.Event | None = None
                        ) -> tuple[Reply | StreamThrough, Headers]:
        """The answer to one call that may cost money, and the ksfs headers that go with it.

        Chat completions and every other paid route take the same path (store, budget, buy
        once), so no endpoint can spend past a budget or go uncounted; the route is part of the
        key, so one body sent to two endpoints is two calls. ``gone`` is set when the guest
        hangs up: a call still held back by the budget gate is then not bought.
        """
        route = Route(method, path, query, wire or path)
        # Other routes are keyed by the path as sent upstream: /v1/files/a%2Fb and /v1/files/a/b
        # are two resources, so two calls.
        scope = route_scope(method, path if path == CHAT_PATH else route.wire, query)
        try:
            canon, obj = paid_body(scope, body, header(headers, "content-type"))
            hval = header(headers, "idempotency-key")
            hkey = header_key(hval, scope) if hval is not None else None
        except BadInput as exc:
            return error_reply(400, "invalid_request_error", str(exc)), []
        view = self.db.view(served.session)
        key = hkey if hkey is not None else derived_key(view.lineage, canon)
        digest = request_digest(canon)
        model = obj.get("model") if isinstance(obj.get("model"), str) else \
            form_model(body, header(headers, "content-type")) if not obj else None
        stream = obj.get("stream") is True
        # A body that is no JSON (an upload, audio) is not sized as a prompt.
        prompt_bytes = len(body) if obj else 0
        # What the purchase may cost, reserved while it is in flight (admission.BudgetGate,
        # and in the store: GatewayStore.begin_purchase): its prompt, reckoned from the JSON
        # request's size, and its completion cap, or the default reserve when it sets none
        # (QA F2: its prompt alone, no bound of what it may generate, let concurrent calls
        # spend about 5x the budget); either times its "n".
        prompt, completion = estimated_tokens(obj, prompt_bytes, self.completion_reserve)
        if completion is None:  # (never: there is a default cap)
            completion = self.completion_reserve
        # (its prompt at the higher of the input and cache-write prices: a prompt the provider
        # writes to its cache costs more than input, and which part it caches is not known yet)
        est_usd, priced = self.prices.reservation(model, prompt, completion)
        order = Order(route, headers, body, model, stream, digest,
                      ask_usage=is_chat(path) and wants_usage_added(obj),
                      prompt_bytes=prompt_bytes, reserved=(prompt, completion, est_usd, priced))
        ikey = lineage_bytes(view.lineage) + key
        mine = False
        settled_once = False  # lost records met are settled at most once per call
        deadline: float | None = None  # when a call held back by calls in flight gives up
        while True:
            call = self._inflight.get(ikey)
            if call is None:
                # No await between this lookup and registering the call below: in trio that
                # makes "look in the store, else become the one buyer" atomic per key.
                stored = self.db.find(view, hkey, canon)
                if stored is not None:
                    return await self._replay(view, key, stored, digest)
                if self.stopping:
                    return (error_reply(503, "gateway_stopping",
                                        "the gateway is stopping; retry the call shortly"),
                            ksfs_headers(key, "error"))
                budget, used = self.db.spending(view.lineage)
                # A named model without a price, or a request naming none (a chat completion
                # the provider's default model answers, a batch that runs what its file
                # names): its cost could not be counted, so a USD budget would not hold.
                unpriced = (budget is not None and budget.get("usd") is not None
                            and not priced)
                if used_up(budget, used) or unpriced:
                    return (await self._refuse(view, key, model, path, budget, used, unpriced),
                            ksfs_headers(key, "refused"))
                held = self._gate.reckon(view.lineage, prompt + completion,
                                         est_usd if priced else None)
                elsewhere = Elsewhere()
                if budget is not None:
                    # Other gateways' purchases in flight on this lineage (QA F2: the gate saw
                    # only its own process's), and any a dead one left, counted before this
                    # call is admitted (review: settled in the background, the call went
                    # through alone beside them, past the budget): then looked at again.
                    calls, tokens, usd, lost = self.db.reserved_elsewhere(view.lineage)
                    if lost and not settled_once:
                        settled_once = True
                        if self._settling:  # another request's settle: wait for it
                            while self._settling:
                                await trio.sleep(DRAIN_POLL_S)
                        else:
                            try:
                                await self._settle_lost()
                            except Exception as exc:  # noqa: BLE001 - then counted in flight
                                log.error("could not count the calls lost gateways left: %s",
                                          exc)
                        continue
                    # A lost record that could not be settled (a removed session, a full
                    # disk) still counts as in flight: its reservation may have been spent.
                    elsewhere = Elsewhere(calls + lost, tokens, usd)
                if not self._gate.may_start(view.lineage, budget, used, held, elsewhere):
                    # Calls in flight may spend what is left: wait for one, then look again,
                    # for at most admission_wait (review: a record of a stopped gateway held
                    # a call back for ever, with no answer).
                    if deadline is None:
                        deadline = trio.current_time() + self.admission_wait
                    await self._wait_for_room(view.lineage, bool(elsewhere.calls), deadline,
                                              gone)
                    if gone is not None and gone.is_set():
                        # The guest hung up while held back: nothing is bought for it.
                        return (error_reply(499, "client_closed",
                                            "the client closed the request while it waited"),
                                ksfs_headers(key, "error"))
                    if trio.current_time() >= deadline:
                        return (self._held_back(view, elsewhere),
                                ksfs_headers(key, "refused"))
                    continue
                call = self._inflight[ikey] = Call(digest=digest)
                mine = True
                self._gate.started(view.lineage, held)
                served.nursery.start_soon(self._buy, call, served, view, key, ikey, order,
                                          held)
                if stream:
                    return StreamThrough(call, key), []
            elif not mine and call.digest != digest:
                # The key of a purchase in flight, for another request: refused as a stored
                # one would be, whatever becomes of that purchase.
                return _key_reused(), []
            elif stream and not mine and call.digest == digest:
                # A duplicate of a stream in flight (a guest retrying after a restore, or
                # after its own read timeout) follows it as it arrives, end withheld until
                # stored like the buyer's, instead of waiting for the whole of it.
                async def replayed(stored: StoredResponse) -> None:
                    await trio.to_thread.run_sync(self.db.record_replay, view.session,
                                                  view.lineage, key, stored)

                return StreamThrough(call, key, replayed), []
            if not await call.settled():  # the gateway stops at once: said, not cut off
                return stopped_reply(), ksfs_headers(key, "error")
            if call.error is not None:
                return call.error, ksfs_headers(key, "error")
            if mine and call.stored is not None:
                return reply_of(call.stored), ksfs_headers(key, "false")
            # A duplicate: the buyer's response is committed now; loop to replay it.

    async def _wait_for_room(self, lineage: str, poll: bool, deadline: float,
                             gone: trio.Event | None) -> None:
        """Until a purchase of ``lineage`` in flight here lands, ``deadline``, the guest hangs
        up (``gone``), or, when other gateways hold purchases in flight (``poll``: their end
        is not signalled here), ELSEWHERE_POLL_S."""
        limit = min(deadline, trio.current_time() + ELSEWHERE_POLL_S) if poll else deadline
        with trio.move_on_at(limit):
            async with trio.open_nursery() as waits:
                async def landing() -> None:
                    if self._gate.flying(lineage):
                        await self._gate.wait_for_landing(lineage)
                    elif poll:
                        await trio.sleep_forever()
                    waits.cancel_scope.cancel()

                async def hung_up() -> None:
                    assert gone is not None
                    await gone.wait()
                    waits.cancel_scope.cancel()

                waits.start_soon(landing)
                if gone is not None:
                    waits.start_soon(hung_up)

    def _held_back(self, view: View, elsewhere: Elsewhere) -> Reply:
        """429: the call waited admission_wait for calls in flight to leave room in the
        budget, and they did not (one of a stopped gateway, a settle that failed)."""
        pids = self.db.holders(view.lineage) if elsewhere.calls else []
        where = (f"calls in flight by another gateway on the store (pid "
                 f"{', '.join(map(str, pids))})" if pids else
                 "calls in flight elsewhere" if elsewhere.calls else
                 "this gateway's calls in flight")
        return error_reply(
            429, "held_back_by_calls_in_flight",
            f"session {view.session!r}: this call was held back {self.admission_wait:g} s by "
            f"{where}, which may spend what is left of its budget; nothing was sent upstream; "
            "retry later", session=view.session, holders=pids)

    async def _replay(self, view: View, key: bytes, stored: StoredResponse, digest: str
                      ) -> tuple[Reply, Headers]:
        if stored.request_digest != digest:
            return _key_reused(), []
        await trio.to_thread.run_sync(self.db.record_replay, view.session, view.lineage, key,
                                      stored)
        return reply_of(stored), ksfs_headers(key, "true")

    async def _refuse(self, view: View, key: bytes, model: str | None, path: str,
                      budget: dict[str, Any], used: dict[str, Any], unpriced: bool = False
                      ) -> Reply:
        await trio.to_thread.run_sync(self.db.record_refusal, view.session, view.lineage, key,
                                      model, budget, used, path,
                                      "unpriced_model" if unpriced else "used_up")
        if unpriced:
            # Its cost could not be counted, so a USD budget would not hold against it.
            what = (f"model {model!r} has no price in the gateway's price table" if model
                    else "the request names no model, so it would be answered (a chat "
                         "completion by the provider's default model, a batch or a run by "
                         "what it refers to) at a price the gateway cannot know")
            why = (f"{what}, so session {view.session!r}'s budget of {_fmt_budget(budget)} "
                   "cannot be kept against it; name a model the table prices, add the model "
                   "to the table (--prices) or remove the USD budget; nothing was sent upstream")
        else:
            why = (f"session {view.session!r} has used {used['tokens']} tokens and "
                   f"{used['usd']:.6f} USD of its budget of {_fmt_budget(budget)}; "
                   "nothing was sent upstream")
        return error_reply(402, "budget_exceeded", why, session=view.session, budget=budget,
                           used=used, reason="unpriced_model" if unpriced else "used_up")

    async def _buy(self, call: Call, served: Served, view: View, key: bytes, ikey: bytes,
                   order: Order, held: Reckoning) -> None:
        """Call upstream once, commit a completed response with its event, wake the waiters."""
        cost: tuple[int | None, float | None] = (None, None)
        route = order.route
        purchase: bytes | None = None
        try:
            try:
                # Recorded before it is sent, so that a gateway killed under it (kill -9, a
                # crash) leaves it to be counted when one starts again (QA F7).
                purchase = await trio.to_thread.run_sync(
                    self.db.begin_purchase, view.session, view.lineage, key, order.model,
                    route.path, *order.reserved)
            except Exception as exc:  # noqa: BLE001 - a full disk, a read-only store
                log.error("session %s: could not record a purchase before making it: %s",
                          view.session, exc)
                call.error = error_reply(
                    500, "gateway_error", "the gateway could not record the call before "
                    f"making it, so it was not made (nothing was sent upstream): {exc}")
                return
            got, hidden = await self._fetch(call, served.upstream, order)
            if isinstance(got, CutShort) and got.begun is not None \
                    and 200 <= got.begun.status < 300 and self._ended(got.begun, order):
                # Broken off (or timed out) after its end: the answer is whole, and bought
                # (QA F10: what followed [DONE] kept it from being stored).
                log.warning("session %s: the provider's stream broke off after its end; "
                            "stored as whole", view.session)
                got = got.begun
            if isinstance(got, Fetched) and 200 <= got.status < 300:
                # Off the loop: a long stream's whole body is scanned (and filtered) here.
                stored, refused, cost = await trio.to_thread.run_sync(
                    self._commit, view, key, got, hidden, order, purchase)
                if refused is not None:
                    # A 2xx that is no whole answer: passed on, never stored.
                    call.ended_cleanly = True
                    call.error = refused
                else:
                    call.stored = stored
                return
            if isinstance(got, CutShort) and got.begun is not None \
                    and 200 <= got.begun.status < 300:
                # Broken off after it began: billed as far as it went, so counted.
                call.error = Reply(got.status, got.headers, got.body)
                cost = await trio.to_thread.run_sync(self._count_cut, view, key, got.begun,
                                                     _error_type(call.error), order, purchase)
                return
            if isinstance(got, Reply) or not 200 <= got.status < 300:
                call.error = got if isinstance(got, Reply) else _passed_back(got)
                why = _error_type(call.error)
                await trio.to_thread.run_sync(partial(
                    self.db.record_upstream_error, view.session, view.lineage, key,
                    order.model, call.error.status, why, route.path, purchase=purchase))
                return
        except trio.Cancelled:
            # The server is stopping under a call it may already have paid for: at least say
            # so in the log of the session (the retry buys it again).
            call.error = error_reply(503, "gateway_stopping",
                                     "the gateway stopped before the call completed")
            with trio.CancelScope(shield=True):
                try:
                    if call.status is not None and 200 <= call.status < 300:
                        # The answer had begun: billed as far as it went, so counted.
                        begun = Fetched(call.status, call.headers, b"".join(call.chunks))
                        cost = await trio.to_thread.run_sync(
                            self._count_cut, view, key, begun, "gateway_stopped", order,
                            purchase)
                    else:
                        await trio.to_thread.run_sync(partial(
                            self.db.record_upstream_error, view.session, view.lineage, key,
                            order.model, 503, "gateway_stopped", route.path,
                            purchase=purchase))
                except Exception as exc:  # noqa: BLE001 - a removed session, a full disk:
                    # the stop must go on, and an error here would replace the cancellation
                    log.error("could not record the call stopped under session %s: %s",
                              view.session, exc)
            raise
        except Exception as exc:  # a bug or a store failure must not take the server down
            log.error("gateway call for session %s failed: %s", view.session, exc)
            if purchase is not None:
                # It may have been bought: counted at its reservation, unless recorded.
                with trio.CancelScope(shield=True):
                    try:
                        await trio.to_thread.run_sync(self.db.settle, view.lineage, key,
                                                      purchase, "gateway_error")
                    except Exception as again:  # noqa: BLE001 - counted at the next start
                        log.error("could not count the call of session %s: %s",
                                  view.session, again)
            if call.error is None:
                call.error = error_reply(
                    500, "gateway_error",
                    f"the gateway could not store the response, so it is not returned: {exc}")
                call.stored = None
        finally:
            # Unregister before waking: a waiter that loops must find the committed response.
            self._inflight.pop(ikey, None)
            self._gate.landed(view.lineage, held, *cost)
            call.done.set()
            call.notify()

    async def _fetch(self, call: Call, upstream: Upstream, order: Order
                     ) -> tuple[Fetched | Reply, bool]:
        """The upstream answer, and whether it carries a usage chunk asked on the guest's
        behalf (which only the gateway reads: ``HiddenUsage`` takes it out of what the guest
        gets, as it arrives and in what is stored)."""
        route = order.route
        if order.ask_usage:
            hidden = HiddenUsage()

            def on_chunk(data: bytes) -> None:
                if out := hidden.feed(data):
                    call.on_chunk(out)

            refusals: list[tuple[int, Headers]] = []

            def on_start(status: int, headers: Headers) -> None:
                # A refusal may be of stream_options: held back, so that the guest's stream
                # of the second attempt still streams.
                if status in (400, 422):
                    refusals.append((status, headers))
                else:
                    call.on_start(status, headers)

            got = await upstream.fetch(route.method, route.wire, order.headers,
                                       with_usage(json.loads(order.body)), on_start,
                                       on_chunk, route.query)
            if not isinstance(got, Fetched) or got.status not in (400, 422) \
                    or b"stream_options" not in got.body:
                if refusals:
                    call.on_start(*refusals[0])
                if tail := hidden.flush():
                    call.on_chunk(tail)
                return got, True
            # A provider that does not know stream_options: ask as the guest did.
            call.chunks.clear()
        got = await upstream.fetch(route.method, route.wire, order.headers, order.body,
                                   call.on_start, call.on_chunk, route.query)
        return got, False

    def _commit(self, view: View, key: bytes, got: Fetched, hidden: bool, order: Order,
                purchase: bytes | None = None
                ) -> tuple[StoredResponse | None, Reply | None,
                           tuple[int | None, float | None]]:
        """Store a 2xx response as the guest gets it; returns (the stored response, None, its
        (tokens, USD)), each None when not known. A response that is no whole answer (a stream
        cut short, an error object in a 200) is not stored but counted: (None, what the guest
        gets instead, cost)."""
        ctype = header(got.headers, "content-type") or ""
        sse = _is_sse(ctype, order)
        usage, cost, priced, learned = self._counted(got, order)
        path = order.route.path
        if sse and (why := incomplete(got.body, path)) is not None:
            self.db.record_unstored_call(view.session, view.lineage, key, usage, cost, priced,
                                         got.status, "stream_incomplete", path, purchase)
            return None, error_reply(
                502, "upstream_stream_incomplete",
                f"the model provider's stream {why}; it was not stored, so a retry buys it "
                "again"), learned
        if not sse and (why := not_an_answer(got.body, ctype, path)) is not None:
            self.db.record_unstored_call(view.session, view.lineage, key, usage, cost, priced,
                                         got.status, "not_an_answer", path, purchase)
            log.warning("session %s: the provider's %d answer %s; passed on, not stored",
                        view.session, got.status, why)
            return None, _passed_back(got), learned
        try:
            visible = HiddenUsage.apply(got.body) if hidden else got.body
            resp = StoredResponse(
                lineage=view.lineage, session=view.session, key=key.hex(), seq=-1,
                status=got.status, headers=keep_headers(got.headers, NOT_STORED), body=visible,
                model=usage.model, stream=sse, request_digest=order.digest, created=_now())
            stored = self.db.commit_call(view.session, view.lineage, key, resp, usage, cost,
                                         priced, path, purchase)
        except Exception:
            # Bought but not kept (a bug, a full disk): still counted against the budget, and
            # said in the session's log, before the guest gets its error.
            try:
                self.db.record_unstored_call(view.session, view.lineage, key, usage, cost,
                                             priced, got.status, "gateway_error", path,
                                             purchase)
            except Exception as exc:  # noqa: BLE001 - the first failure is the one to report
                log.error("could not record the call of session %s: %s", view.session, exc)
            raise
        return stored, None, learned

    def _counted(self, got: Fetched, order: Order
                 ) -> tuple[Usage, float, bool, tuple[int | None, float | None]]:
        """(usage, USD, priced, what the gate may learn) of an answer, whole or as far as it
        came: the usage it reported, else the estimate from its sizes."""
        ctype = header(got.headers, "content-type") or ""
        sse = _is_sse(ctype, order)
        usage = (usage_of_sse if sse else usage_of_json)(got.body, order.model)
        if usage.clamped:
            log.warning("the provider reported a usage past %d tokens for a call of model %r; "
                        "counted as %d", USAGE_MAX, usage.model, USAGE_MAX)
        if not usage.known or usage.total_tokens == 0:
            # (a usage of no tokens at all is no figure: QA, eighteenth session, a provider's
            # "usage": {} let every call past a token budget)
            usage = _estimated(usage, got.body, sse, ctype, order)
        cost, priced = self._cost(usage, order.model)
        # What the gate may learn a call's size from: figures the provider reported, or the
        # estimate from the answer's own text; never a 0 that stands for "not known" (an
        # unpriced model's cost, an upload's estimate: its body is no prompt), which would let
        # every later call start at once.
        counted = usage.known or (usage.estimated and usage.total_tokens > 0)
        learned = (usage.total_tokens if counted else None, cost if counted and priced else None)
        return usage, cost, priced, learned

    @staticmethod
    def _ended(got: Fetched, order: Order) -> bool:
        """Whether a 2xx stream that broke off had reached its end ([DONE], or a Responses
        stream's response.completed) first: then it is a whole answer."""
        ctype = header(got.headers, "content-type") or ""
        return _is_sse(ctype, order) and (is_chat(order.route.path)
                                          or order.route.path == RESPONSES_PATH) \
            and ended(got.body) is True

    def _count_cut(self, view: View, key: bytes, begun: Fetched, error: str, order: Order,
                   purchase: bytes | None = None) -> tuple[int | None, float | None]:
        """Record an answer that had begun (2xx) and then broke off, or was stopped under:
        the provider bills what it generated, so it counts, at what it reported or at the
        estimate from its sizes, in ``paid_calls`` and ``upstream_errors`` (review: it counted
        0, so a provider that always broke off before the end spent past any budget)."""
        usage, cost, priced, learned = self._counted(begun, order)
        self.db.record_unstored_call(view.session, view.lineage, key, usage, cost, priced,
                                     begun.status, error, order.route.path, purchase)
        return learned

    def _cost(self, usage: Any, request_model: str | None) -> tuple[float, bool]:
        """(USD, priced) of a call's usage: at the price of the model the answer names, and
        when that has none, at the price of the model asked for, which the budget's check
        before the purchase used. A router names the vendor's model ("openai/gpt-4o-mini" for
        "gpt-4o-mini"), a proxy an alias or a deployment: counted as nothing, such answers
        spent past any USD budget (QA, eighteenth session). A model with a price of its own
        is counted at it, whatever was asked for (review, eleventh session)."""
        figures = (usage.prompt_tokens, usage.completion_tokens, usage.unattributed,
                   usage.cache_read_tokens, usage.cache_write_tokens,
                   usage.cache_write_1h_tokens)
        cost, priced = self.prices.cost(usage.model, *figures)
        if not priced and request_model:
            cost, priced = self.prices.cost(request_model, *figures)
        return cost, priced


# --- small helpers ----------------------------------------------------------------------------


def _is_sse(content_type: str, order: Order) -> bool:
    """Whether an answer is a stream; a provider may answer a stream request with one JSON
    body, and that is the answer, whole."""
    return content_type.startswith("text/event-stream") or (
        order.stream and not content_type.startswith("application/json"))


def _estimated(usage: Usage, body: bytes, sse: bool, content_type: str, order: Order) -> Usage:
    """A 2xx answer without usage counted at an estimate, not 0 tokens: else a provider that
    ignores ``include_usage``, or never reports usage, could spend past any budget. Whatever
    the route and whether it names a model (QA: a batch's creation, naming none, counted 0
    while said to be estimated): a JSON request is sized as a prompt, an upload's body is not,
    and an answer's generated text as its completion."""
    made = generated_text_bytes(body) if sse else answer_text_bytes(body, content_type)
    return estimated_usage(usage, order.prompt_bytes, made)


def _key_reused() -> Reply:
    return error_reply(422, "idempotency_key_reused",
                       "this Idempotency-Key was used before for a different request")


def _passed_back(got: Fetched) -> Reply:
    return Reply(got.status, keep_headers(got.headers, NOT_STORED), without_keys(got.body))


def _error_type(reply: Reply) -> str:
    if reply.status in (502, 504) and b"upstream_" in reply.body:
        return "upstream_timeout" if reply.status == 504 else "upstream_unreachable"
    return f"upstream_status_{reply.status}"


def _fmt_budget(budget: dict[str, Any]) -> str:
    parts = []
    if budget.get("tokens") is not None:
        parts.append(f"{budget['tokens']} tokens")
    if budget.get("usd") is not None:
        parts.append(f"{budget['usd']} USD")
    return " and ".join(parts) or "nothing"


def _now() -> float:
    return time.time()
