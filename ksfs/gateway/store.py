"""The gateway's records in the store's LMDB environment: stored responses, usage, budgets.

Named dbs ``gw_responses`` ((lineage id, key) -> one completed response and the seq of the
``gateway.call`` event that stored it), ``gw_usage`` (lineage id -> running totals) and
``gw_budgets`` (lineage id -> the budget), and ``gw_pending`` (a purchase recorded before it is
sent upstream, until what became of it is). Every write here commits in one transaction with the
ledger event that explains it, so the store and the event log never disagree (a ``gw_pending``
record is cleared in the transaction of the event that says what became of its purchase).
Synchronous: the service calls the writers through ``trio.to_thread``. It must never store or
log an API key, a request's text, or a response it was not handed complete.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import lmdb

from ksfs.errors import (
    BadInput,
    IntegrityError,
    KsfsError,
    NoSpace,
    ReadOnly,
    from_foreign,
)
from ksfs.gateway.calls import CHAT_PATH, Usage, derived_key
from ksfs.ledger.keys import LINEAGE_BYTES, lineage_bytes
from ksfs.model import Event

DBS = (b"gw_responses", b"gw_usage", b"gw_budgets")
# Purchases sent upstream and not yet recorded: (lineage id, key, purchase id) -> what each is
# reserved at and which process makes it; made at the first purchase (older stores lack it).
PENDING_DB = b"gw_pending"
PURCHASE_ID_BYTES = 8
log = logging.getLogger("ksfs.gateway")
_META_LEN = struct.Struct(">I")

MAX_TOKEN_BUDGET = 2**53  # the largest integer a JSON reader's double holds exactly
MIN_USD_BUDGET = 1e-12  # costs are rounded to 12 decimals: a smaller budget counts nothing


@dataclass(frozen=True)
class StoredResponse:
    """A completed upstream response, exactly as every caller of its key gets it."""

    lineage: str
    session: str
    key: str  # hex
    seq: int  # of the gateway.call event stored with it
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    model: str | None
    stream: bool
    request_digest: str
    created: float

    def encode(self) -> bytes:
        meta = asdict(self)
        del meta["body"]
        raw = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode("utf-8")
        return _META_LEN.pack(len(raw)) + raw + self.body

    @classmethod
    def decode(cls, raw: bytes) -> StoredResponse:
        raw = bytes(raw)
        try:
            (n,) = _META_LEN.unpack_from(raw)
            meta = json.loads(raw[4 : 4 + n].decode("utf-8"))
            meta["headers"] = [(str(k), str(v)) for k, v in meta["headers"]]
            return cls(body=raw[4 + n :], **meta)
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"a stored gateway response does not decode: {exc}") from None


@dataclass(frozen=True)
class View:
    """What one session may read: its own lineage whole, each ancestor up to its fork seq."""

    session: str
    lineage: str
    chain: tuple[tuple[str, int | None], ...]  # (lineage, highest visible seq or None = all)


# The prompt-cache figures a call, a lineage's totals and each model in them count; records
# from before a figure was counted have 0 of it.
CACHE_FIGURES = ("cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens")


@dataclass
class Totals:
    """Running usage of one lineage (its session), kept in ``gw_usage``."""

    paid_calls: int = 0
    replays: int = 0
    refused: int = 0
    upstream_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Parts of prompt_tokens read from and written to the provider's prompt cache (priced at
    # the model's cache prices); a record from before they were counted has neither: 0.
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0  # the part of the writes kept an hour (Anthropic)
    cost_usd: float = 0.0
    unpriced_calls: int = 0
    unknown_usage_calls: int = 0

    @property
    def spent(self) -> dict[str, Any]:
        """What a budget is held against: tokens and USD."""
        return {"tokens": self.total_tokens, "usd": self.cost_usd}
    by_model: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_raw(cls, raw: bytes | None) -> Totals:
        if raw is None:
            return cls()
        try:
            totals = cls(**json.loads(bytes(raw).decode("utf-8")))
        except (ValueError, TypeError) as exc:
            raise IntegrityError(f"gateway usage record does not decode: {exc}") from None
        for m in totals.by_model.values() if isinstance(totals.by_model, dict) else ():
            if isinstance(m, dict):  # (a record from before cache tokens were counted)
                for name in CACHE_FIGURES:
                    m.setdefault(name, 0)
        return totals

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode("utf-8")

    def add_call(self, usage: Usage, cost: float, priced: bool) -> None:
        self.paid_calls += 1
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.total_tokens += usage.total_tokens
        self.cache_read_tokens += usage.cache_read_tokens
        self.cache_write_tokens += usage.cache_write_tokens
        self.cache_write_1h_tokens += usage.cache_write_1h_tokens
        self.cost_usd = round(self.cost_usd + cost, 12)
        self.unpriced_calls += 0 if priced else 1
        self.unknown_usage_calls += 0 if usage.known else 1
        model = _cut(usage.model, MODEL_CHARS) or "?"
        if model not in self.by_model and len(self.by_model) >= BY_MODEL_MAX:
            # The record is rewritten on every call: a guest naming a new model each time
            # must not make it grow without end.
            model = "(other)"
        m = self.by_model.setdefault(model, {
            "calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost_usd": 0.0,
            "priced": priced})
        m["calls"] += 1
        m["priced"] = m["priced"] and priced  # ("(other)" holds several models)
        m["prompt_tokens"] += usage.prompt_tokens
        m["completion_tokens"] += usage.completion_tokens
        for name in CACHE_FIGURES:  # (0 in a record from before)
            m[name] = m.get(name, 0) + getattr(usage, name)
        m["cost_usd"] = round(m["cost_usd"] + cost, 12)


def _budget_dict(tokens: int | None, usd: float | None) -> dict[str, Any]:
    return {"tokens": tokens, "usd": usd}


def used_up(budget: dict[str, Any] | None, used: dict[str, Any]) -> bool:
    """Whether ``used`` has reached the budget in tokens or in USD (never without a budget)."""
    if budget is None:
        return False
    if budget.get("tokens") is not None and used["tokens"] >= budget["tokens"]:
        return True
    return budget.get("usd") is not None and used["usd"] >= budget["usd"]


class GatewayStore:
    """Synchronous access to the gateway's dbs; shared by the service, the keeper and the CLI."""

    def __init__(self, store: Any, ledger: Any) -> None:
        self.env: lmdb.Environment = store.env
        self.ledger = ledger
        self.path = getattr(store, "path", None)
        # Made by the first write, not here: a read (`ksfs usage` of a store the gateway never
        # served, a store on a read-only file system) must change nothing. None until then.
        self._resp = self._usage = self._budgets = self._pending = None
        self._open_dbs(create=False)
        # (lineage, key, reason) -> (when its last budget.refused was written, refusals of it
        # counted since without an event of their own): see record_refusal
        self._refused: dict[tuple[str, bytes, str], tuple[float, int]] = {}
        self._refused_lock = threading.Lock()
        # This gateway's own name in the purchases it records: another GatewayStore (another
        # gateway, in this process or another) tells them from its own by it.
        self.instance = secrets.token_hex(8)

    def _open_dbs(self, create: bool) -> None:
        if create and self.env.flags().get("readonly"):
            # (a store on a read-only file system is opened read-only: said as every verb
            # that would write says it, exit 12; LMDB's own words were "Permission denied")
            raise ReadOnly(what=f"the file system of the store at {self.path}")
        try:
            if create:
                self._resp, self._usage, self._budgets, self._pending = (
                    self.env.open_db(name, create=True) for name in (*DBS, PENDING_DB))
                return
            # Looked for in a read transaction first (the main database names every named
            # one): py-lmdb's open_db takes the store's write lock even to find nothing, and
            # this runs on the gateway's loop at every call until the first write.
            with self.env.begin() as txn:
                if any(txn.get(name) is None for name in DBS):
                    return
                pending = txn.get(PENDING_DB) is not None
            self._resp, self._usage, self._budgets = (
                self.env.open_db(name, create=False) for name in DBS)
            if pending:
                self._pending = self.env.open_db(PENDING_DB, create=False)
        except lmdb.NotFoundError:
            if create:
                raise KsfsError(f"cannot make the gateway's databases in {self.path}") from None
        except lmdb.Error as exc:
            # damage is the index's (exit 6), a full disk NoSpace, as for the store's own
            # databases (QA, nineteenth session: exit 1 for a damaged page)
            known = from_foreign(exc, self.path, "opening the gateway's databases")
            if known is not None and type(known) is not KsfsError:
                raise known from exc
            raise KsfsError(f"cannot open the gateway's databases in {self.path}: {exc}") from exc

    def _ready(self) -> bool:
        """Whether the databases exist (looked for again while not: another process, a CLI
        `ksfs budget` beside a standalone gateway, may have made them meanwhile)."""
        if self._resp is None:
            self._open_dbs(create=False)
        return self._resp is not None

    def _write(self):  # -> a write transaction, lmdb errors as ksfs errors
        if self._resp is None or self._pending is None:
            self._open_dbs(create=True)
        return _Txn(self.env, self.path)

    # --- reading ------------------------------------------------------------------------------

    def view(self, session: str) -> View:
        """The session's lineage and the ancestors it may read (NoSuchSession if none)."""
        with self.env.begin() as txn:
            rec = self.ledger.session(session, txn)
            hops = self.ledger.lineage(session, txn)
        chain = [(rec.lineage, None)] + [(fp.lineage, fp.seq) for fp in hops]
        return View(session, rec.lineage, tuple(chain))

    def find(self, view: View, hkey: bytes | None, canon: bytes) -> StoredResponse | None:
        """The response this view sees for the call (header key, else derived per lineage)."""
        if not self._ready():
            return None
        with self.env.begin() as txn:
            for lineage, limit in view.chain:
                key = hkey if hkey is not None else derived_key(lineage, canon)
                raw = txn.get(lineage_bytes(lineage) + key, db=self._resp)
                if raw is None:
                    continue
                stored = StoredResponse.decode(raw)
                if limit is None or stored.seq <= limit:
                    return stored
        return None

    def collect(self, live_lineages: set[str]) -> tuple[int, int]:
        """Delete stored responses of lineages nothing can replay from any more (no session,
        kept or live, has them in its chain). Returns (responses, bytes) freed. Usage totals
        and budgets stay: they are small and tell the history."""
        if not self._ready():
            return 0, 0
        live = {lineage_bytes(lin) for lin in live_lineages}
        freed = nbytes = 0
        with self._write() as txn:
            dead = [(bytes(k), len(v)) for k, v in txn.cursor(db=self._resp)
                    if bytes(k[:LINEAGE_BYTES]) not in live]
            for key, size in dead:
                if txn.delete(key, db=self._resp):
                    freed += 1
                    nbytes += len(key) + size
        return freed, nbytes

    def totals(self, lineage: str) -> Totals:
        if not self._ready():
            return Totals()
        with self.env.begin() as txn:
            return Totals.from_raw(txn.get(lineage_bytes(lineage), db=self._usage))

    def budget_of(self, lineage: str) -> dict[str, Any] | None:
        if not self._ready():
            return None
        with self.env.begin() as txn:
            raw = txn.get(lineage_bytes(lineage), db=self._budgets)
        return None if raw is None else json.loads(bytes(raw).decode("utf-8"))

    def budget(self, session: str) -> dict[str, Any] | None:
        """The session's budget {"tokens": N|None, "usd": X|None}, or None when it has none."""
        return self.budget_of(self.ledger.session(session).lineage)

    def spending(self, lineage: str) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(budget or None, used): what the lineage may spend and has spent, in tokens and USD."""
        if not self._ready():
            return None, Totals().spent
        with self.env.begin() as txn:
            raw = txn.get(lineage_bytes(lineage), db=self._budgets)
            t = Totals.from_raw(txn.get(lineage_bytes(lineage), db=self._usage))
        budget = None if raw is None else json.loads(bytes(raw).decode("utf-8"))
        return budget, t.spent

    def usage(self, session: str) -> dict[str, Any]:
        """The session's usage and budget as one JSON-able dict (sessions/S/usage, ksfs usage)."""
        rec = self.ledger.session(session)
        t = self.totals(rec.lineage)
        budget = self.budget_of(rec.lineage)
        out: dict[str, Any] = {"session": session, "lineage": rec.lineage, **asdict(t),
                               "budget": budget, "remaining": None, "over_budget": False}
        if budget is not None:
            rem: dict[str, Any] = {"tokens": None, "usd": None}
            if budget.get("tokens") is not None:
                rem["tokens"] = max(0, budget["tokens"] - t.total_tokens)
            if budget.get("usd") is not None:
                rem["usd"] = round(max(0.0, budget["usd"] - t.cost_usd), 12)
            out["remaining"] = rem
            out["over_budget"] = used_up(budget, t.spent)
        return out

    # --- writing (each with its event, in one transaction) ------------------------------------

    def commit_call(self, session: str, lineage: str, key: bytes, response: StoredResponse,
                    usage: Usage, cost: float, priced: bool,
                    path: str = CHAT_PATH, purchase: bytes | None = None) -> StoredResponse:
        """Store a completed response under (lineage, key) with its ``gateway.call`` event.

        If the key is already stored (a second process raced us) the first response is kept and
        returned; the call is still counted, since it was paid.
        """
        body = _paid_call_body(key, usage, cost, priced, response.status, path,
                               stream=response.stream, stored=True)
        dbkey = lineage_bytes(lineage) + key
        with self._write() as txn:
            existing = txn.get(dbkey, db=self._resp)
            if existing is not None:
                body["stored"] = False
            event = self.ledger.append(txn, session, "gateway.call", body)
            self._count_paid(txn, lineage, usage, cost, priced)
            self._settled(txn, lineage, key, purchase)
            if existing is not None:
                return StoredResponse.decode(existing)
            stored = StoredResponse(**{**asdict(response), "seq": event.seq})
            txn.put(dbkey, stored.encode(), db=self._resp)
            return stored

    def record_unstored_call(self, session: str, lineage: str, key: bytes, usage: Usage,
                             cost: float, priced: bool, status: int, error: str,
                             path: str = CHAT_PATH, purchase: bytes | None = None) -> Event:
        """A call the provider answered (and billed) but that is not stored: a stream that
        carried an error or stopped short. Its usage, when it reported one, counts against
        the budget like any paid call's; it is also counted as an upstream error."""
        body = _paid_call_body(key, usage, cost, priced, status, path, error=error,
                               stored=False)
        with self._write() as txn:
            event = self.ledger.append(txn, session, "gateway.call", body)
            self._count_paid(txn, lineage, usage, cost, priced, upstream_error=True)
            self._settled(txn, lineage, key, purchase)
            return event

    def record_replay(self, session: str, lineage: str, key: bytes,
                      stored: StoredResponse) -> Event:
        body = {"key": key.hex(), "model": _cut(stored.model, MODEL_CHARS),
                "status": stored.status,
                "stream": stored.stream, "from_session": stored.session,
                "from_lineage": stored.lineage, "from_seq": stored.seq, "cost_usd": 0.0}
        if stored.key != key.hex():
            # a fork's key is its own lineage's; the purchase's event names the ancestor's
            # (QA, eighteenth session: only from_seq linked them)
            body["from_key"] = stored.key
        with self._write() as txn:
            event = self.ledger.append(txn, session, "gateway.replay", body)
            self._bump(txn, lineage, "replays")
            return event

    def record_refusal(self, session: str, lineage: str, key: bytes, model: str | None,
                       budget: dict[str, Any], used: dict[str, Any],
                       path: str = CHAT_PATH, reason: str = "used_up") -> Event | None:
        """Count a refused call, with a ``budget.refused`` event; the same call refused again
        within REFUSAL_QUIET_S of its last event is counted without one, and the next event
        of it says how many were (``"repeats"``). QA (eighteenth session): a guest retrying
        its call every 0.4 s wrote an event each time, about 200,000 a day."""
        now, slot = time.monotonic(), (lineage, key, reason)
        with self._refused_lock:
            last, folded = self._refused.get(slot, (None, 0))
            quiet = last is not None and now - last < REFUSAL_QUIET_S
            if len(self._refused) >= REFUSALS_KEPT and slot not in self._refused:
                self._refused.clear()  # many calls refused once each: start afresh
            self._refused[slot] = (last, folded + 1) if quiet else (now, 0)
        with self._write() as txn:
            self._bump(txn, lineage, "refused")
            if quiet:
                return None
            body = {"key": key.hex(), "model": _cut(model, MODEL_CHARS), "budget": budget,
                    "used": used, "path": _cut(path, PATH_CHARS), "reason": reason}
            if folded:
                body["repeats"] = folded  # refusals of this call since its last event
            return self.ledger.append(txn, session, "budget.refused", body)

    def record_upstream_error(self, session: str, lineage: str, key: bytes, model: str | None,
                              status: int, error: str, path: str = CHAT_PATH,
                              purchase: bytes | None = None) -> Event:
        """A call that did not complete: counted, logged as ``gateway.call`` with stored=False."""
        body = {"key": key.hex(), "model": _cut(model, MODEL_CHARS), "status": status,
                "error": _cut(error, ERROR_CHARS),
                "stored": False, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                **dict.fromkeys(CACHE_FIGURES, 0),
                "cost_usd": 0.0, "path": _cut(path, PATH_CHARS)}
        with self._write() as txn:
            event = self.ledger.append(txn, session, "gateway.call", body)
            self._bump(txn, lineage, "upstream_errors")
            self._settled(txn, lineage, key, purchase)
            return event

    def set_budget(self, session: str, tokens: int | None = None,
                   usd: float | None = None) -> Event:
        """Replace the session's budget (both None: no budget) and record ``budget.set``."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                   or tokens < 0):
            raise BadInput(f"a token budget must be a whole number >= 0, not {tokens!r}")
        if tokens is not None and tokens > MAX_TOKEN_BUDGET:
            # (what JSON readers hold exactly as an integer is bounded; a budget beyond any
            # usage is no budget, which --clear says)
            raise BadInput(f"a token budget must be at most {MAX_TOKEN_BUDGET}, not {tokens}; "
                           f"`ksfs budget SESSION --clear` removes the budget")
        if usd is not None:
            given = usd
            try:
                usd = float(usd)
            except (TypeError, ValueError):
                raise BadInput(f"a USD budget must be a number >= 0, not {usd!r}") from None
            if not usd >= 0 or usd == float("inf"):
                # (as given: 1e400 is "inf" once a float, which the user never wrote)
                raise BadInput(f"a USD budget must be a finite number >= 0, not {given!s}")
            if usd == 0 and isinstance(given, str) and any(c in "123456789" for c in
                                                            given.lower().split("e")[0]):
                # (QA, eighteenth session: 1e-400 became a budget of 0, refusing every call)
                raise BadInput(f"a USD budget of {given} is too small to count: it would be 0")
            if 0 < usd < MIN_USD_BUDGET:
                # (QA F13: 1e-320, a subnormal float, was a budget, though costs are counted
                # to 1e-12 USD: no cost can be told apart from it)
                raise BadInput(f"a USD budget of {given} is too small to count: costs are "
                               f"counted to {MIN_USD_BUDGET:g} USD (give 0 to refuse every "
                               "paid call)")
            usd += 0.0  # -0.0 is 0 (QA: "usd": -0.0 was recorded as given)
        self.ledger.session(session)  # a bad or unknown name: refused before any write
        with self._write() as txn:
            rec = self.ledger.session(session, txn)
            lin = lineage_bytes(rec.lineage)
            if tokens is None and usd is None:
                txn.delete(lin, db=self._budgets)
            else:
                txn.put(lin, json.dumps(_budget_dict(tokens, usd)).encode(), db=self._budgets)
            return self.ledger.append(txn, session, "budget.set", _budget_dict(tokens, usd))

    # --- purchases in flight, recorded before they are made (QA F7) ----------------------------

    def begin_purchase(self, session: str, lineage: str, key: bytes, model: str | None,
                       path: str, prompt_tokens: int, completion_tokens: int, cost: float,
                       priced: bool) -> bytes:
        """Record, before it is sent upstream, a purchase and what it is reserved at; returns
        its id. Whatever becomes of it is recorded with its id (``purchase=``), which clears
        this record in the same transaction. A record whose process died (kill -9, a crash,
        a power cut) is counted at its reservation when a gateway next starts on the store
        (``settle_lost``): so a call bought just before the end is never left uncounted."""
        purchase = secrets.token_bytes(PURCHASE_ID_BYTES)
        rec = {"session": session, "model": _cut(model, MODEL_CHARS),
               "path": _cut(path, PATH_CHARS), "prompt_tokens": prompt_tokens,
               "completion_tokens": completion_tokens, "cost_usd": cost, "priced": priced,
               "owner": {**_this_process(), "gateway": self.instance},
               "created": time.time()}
        with self._write() as txn:
            txn.put(lineage_bytes(lineage) + key + purchase,
                    json.dumps(rec, separators=(",", ":")).encode("utf-8"), db=self._pending)
        return purchase

    def pending(self) -> list[tuple[str, bytes, bytes, dict[str, Any]]]:
        """(lineage, key, purchase id, record) of every purchase recorded and not settled."""
        if not self._ready() or self._pending is None:
            return []
        with self.env.begin() as txn:
            out = []
            for k, v in txn.cursor(db=self._pending):
                k = bytes(k)
                try:
                    rec = json.loads(bytes(v).decode("utf-8"))
                except ValueError:
                    rec = {}
                out.append((k[:LINEAGE_BYTES].hex(), k[LINEAGE_BYTES:-PURCHASE_ID_BYTES],
                            k[-PURCHASE_ID_BYTES:], rec))
            return out

    def reserved_elsewhere(self, lineage: str) -> tuple[int, int, float, int]:
        """(calls, tokens, USD, lost) of the purchases of ``lineage`` other gateways recorded
        and have not settled: ``calls`` those of live processes, ``lost`` those whose process
        is gone (for ``settle_lost``); tokens and USD what all of them reserved. Synchronous
        and small: read on the gateway's loop like ``spending``."""
        if not self._ready() or self._pending is None:
            return 0, 0, 0.0, 0
        prefix = lineage_bytes(lineage)
        calls = tokens = lost = 0
        usd = 0.0
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._pending)
            if not cur.set_range(prefix):
                return 0, 0, 0.0, 0
            for k, v in cur:
                if not bytes(k).startswith(prefix):
                    break
                try:
                    rec = json.loads(bytes(v).decode("utf-8"))
                    owner = rec.get("owner")
                    if isinstance(owner, dict) and owner.get("gateway") == self.instance:
                        continue  # this gateway's own: its gate counts them
                    size = int(rec.get("prompt_tokens", 0)) + int(
                        rec.get("completion_tokens", 0))
                    cost = float(rec.get("cost_usd", 0.0))
                    if not _alive(owner):
                        # Not a call in flight, but what it reserved is counted until it is
                        # settled (``settle_lost``): it may have been spent.
                        lost += 1
                        tokens, usd = tokens + size, usd + cost
                        continue
                    calls += 1
                    tokens, usd = tokens + size, usd + cost
                except (ValueError, TypeError, AttributeError):
                    lost += 1  # (damaged: settle_lost says so)
        return calls, tokens, usd, lost

    def holders(self, lineage: str) -> list[int]:
        """The pids of the other live gateways holding purchases of ``lineage`` in flight."""
        pids = set()
        for lin, _key, _purchase, rec in self.pending():
            owner = rec.get("owner")
            if lin == lineage and isinstance(owner, dict) and \
                    owner.get("gateway") != self.instance and isinstance(owner.get("pid"), int):
                pids.add(owner["pid"])
        return sorted(pids)

    def settle_lost(self) -> int:
        """Count every purchase recorded by a process that is gone, at its reservation: a
        ``gateway.call`` with ``stored: false, error: "gateway_lost"``, in ``paid_calls``,
        ``upstream_errors``, the tokens and the cost, and its record cleared, in one
        transaction each. Returns how many were. Purchases of live processes are theirs."""
        settled = 0
        for lineage, key, purchase, rec in self.pending():
            if _alive(rec.get("owner")):
                continue
            try:
                self.settle(lineage, key, purchase, "gateway_lost", rec)
                settled += 1
            except KsfsError as exc:  # a removed session, a full disk: said, tried next start
                log.error("could not count a purchase lost by a gateway that stopped: %s", exc)
        return settled

    def settle(self, lineage: str, key: bytes, purchase: bytes, error: str,
               rec: dict[str, Any] | None = None) -> Event | None:
        """Count one recorded purchase at its reservation and clear its record (None when it
        was settled already)."""
        dbkey = lineage_bytes(lineage) + key + purchase
        with self._write() as txn:
            raw = txn.get(dbkey, db=self._pending)
            if raw is None:
                return None
            if rec is None:
                rec = json.loads(bytes(raw).decode("utf-8"))
            prompt, completion = int(rec.get("prompt_tokens", 0)), int(
                rec.get("completion_tokens", 0))
            usage = Usage(rec.get("model"), prompt, completion, prompt + completion,
                          known=False, estimated=True)
            cost, priced = float(rec.get("cost_usd", 0.0)), bool(rec.get("priced", False))
            body = _paid_call_body(key, usage, cost, priced, 0, rec.get("path") or CHAT_PATH,
                                   error=error, stored=False, reserved=True)
            event = self.ledger.append(txn, rec.get("session") or "", "gateway.call", body)
            self._count_paid(txn, lineage, usage, cost, priced, upstream_error=True)
            txn.delete(dbkey, db=self._pending)
            return event

    def _settled(self, txn: lmdb.Transaction, lineage: str, key: bytes,
                 purchase: bytes | None) -> None:
        if purchase is not None and self._pending is not None:
            txn.delete(lineage_bytes(lineage) + key + purchase, db=self._pending)

    def _count_paid(self, txn: lmdb.Transaction, lineage: str, usage: Usage, cost: float,
                    priced: bool, upstream_error: bool = False) -> None:
        totals = Totals.from_raw(txn.get(lineage_bytes(lineage), db=self._usage))
        totals.add_call(usage, cost, priced)
        totals.upstream_errors += 1 if upstream_error else 0
        txn.put(lineage_bytes(lineage), totals.encode(), db=self._usage)

    def _bump(self, txn: lmdb.Transaction, lineage: str, counter: str) -> None:
        totals = Totals.from_raw(txn.get(lineage_bytes(lineage), db=self._usage))
        setattr(totals, counter, getattr(totals, counter) + 1)
        txn.put(lineage_bytes(lineage), totals.encode(), db=self._usage)


# A model name, a request path or an error text is whatever the guest or the provider sent: cut
# so that an event body stays far under the ledger's limit (a 70 000-character model name made
# the event, and so the paid call's storing and counting, fail).
# The same call refused again within this many seconds of its last budget.refused event is
# counted without an event of its own; REFUSALS_KEPT bounds the calls remembered for it.
REFUSAL_QUIET_S = 60.0
REFUSALS_KEPT = 10_000
MODEL_CHARS = 200
PATH_CHARS = 1000
ERROR_CHARS = 1000
BY_MODEL_MAX = 100  # models counted apart in usage's by_model; the rest under "(other)"


def _this_process() -> dict[str, Any]:
    """Who makes a purchase: pid, its start time and the boot, so that a pid used again by
    another process (or after a reboot) is not taken for the one that recorded it."""
    pid = os.getpid()
    return {"pid": pid, "start": _proc_start(pid), "boot": _boot_id()}


def _proc_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat), -1 for a zombie (a
    process killed and not yet reaped is gone), None when not known."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()  # after "pid (comm) ": state first
        return -1 if fields[0] == b"Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _alive(owner: Any) -> bool:
    """Whether the process that recorded a purchase may still be making it."""
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    boot = _boot_id()
    if owner.get("boot") and boot and owner["boot"] != boot:
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    start = _proc_start(owner["pid"])
    if start == -1:
        return False
    return owner.get("start") is None or start is None or start == owner["start"]


def _cut(text: str | None, limit: int) -> str | None:
    return text if text is None or len(text) <= limit else text[:limit]


def _paid_call_body(key: bytes, usage: Usage, cost: float, priced: bool, status: int,
                    path: str, **more: Any) -> dict[str, Any]:
    """The body of the ``gateway.call`` event of a call the provider answered and billed."""
    if "error" in more:
        more["error"] = _cut(more["error"], ERROR_CHARS)
    if usage.clamped:
        more["usage_clamped"] = True  # a figure past calls.USAGE_MAX, counted as that
    return {"key": key.hex(), "model": _cut(usage.model, MODEL_CHARS), "status": status,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cache_read_tokens": usage.cache_read_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "cache_write_1h_tokens": usage.cache_write_1h_tokens,
            "usage_known": usage.known, "cost_usd": cost,
            "priced": priced, "path": _cut(path, PATH_CHARS), **more}


class _Txn:
    """A write transaction whose lmdb errors come out as ksfs errors naming the store."""

    def __init__(self, env: lmdb.Environment, path: object) -> None:
        self.env, self.path = env, path

    def __enter__(self) -> lmdb.Transaction:
        try:
            self.txn = self.env.begin(write=True)
        except lmdb.Error as exc:
            # As for every verb: a read-only store is ReadOnly (exit 12), a full disk NoSpace,
            # damage IntegrityError, anything else a KsfsError (never None for LMDB's errors)
            raise from_foreign(exc, self.path, "a gateway write") from exc
        return self.txn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is not None:
            self.txn.abort()
            return False
        try:
            self.txn.commit()
        except lmdb.MapFullError as e:
            raise NoSpace(path=self.path, why="the LMDB map is full") from e
        except lmdb.Error as e:
            raise from_foreign(e, self.path, "a gateway commit") from e
        return False
