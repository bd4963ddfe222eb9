"""Holding back new purchases that calls already in flight might push past a budget.

A call's cost is known only once its response is in, so a budget checked at the door alone lets
every call that starts while others are in flight through: ten concurrent calls on a budget with
room for one were all bought. ``BudgetGate`` reserves for each purchase in flight what it may
cost, and lets a new purchase of a lineage that has a budget start only when what is spent, what
is reserved for the purchases in flight and its own reservation fit the budget, or when nothing
else of its lineage is in flight. A purchase is reserved at its prompt, reckoned from its
request's size, plus its completion: its own cap (``max_tokens`` and the like, times ``n``) when
it sets one, else the gateway's default completion reserve (``DEFAULT_COMPLETION_RESERVE``),
priced by the table (``PriceTable.reservation``: the prompt at the model's input price, or at its
cache-write price when that is higher, since a prompt written to the provider's cache costs more
and which part is cached is not known before; the completion at the output price); and at least
the largest cost a completed call of this gateway has had on that lineage. The reservation is
released when the purchase ends, and what it cost is counted in the store then (settled).

QA F2: a request without a cap was reckoned at its prompt alone (or the largest call before),
which is no bound of what it may generate: concurrent calls spent about 5x the budget. So what
is promised is exactly: spending ends past a budget only by (1) the one call that started alone,
nothing else of its lineage in flight, with less than its reservation left (by at most its own
cost), and (2) what a call costs beyond its reservation (a call with no cap that generates more
than the default reserve, a prompt of more than one token per 4 bytes of request). Other
gateways on the same store (the daemon and a standalone ``ksfs gateway``) are seen through the
purchases they record before making them (``GatewayStore.begin_purchase``): what those reserve
counts as in flight here too (``Elsewhere``), and a purchase that does not fit beside them
waits, looking again every ELSEWHERE_POLL_S; only a purchase recorded in the moment
(milliseconds) between another gateway's admission and its record is not seen. Without a budget
nothing is held back. A purchase held back waits (the guest's request stays open) until one in
flight ends, then is checked again, and refused with 402 if the budget is then used up; it waits
at most the gateway's admission wait, then gets 429 (``Gateway.paid_call``). A record a dead
gateway left is counted in the store before the call that meets it is admitted; a gateway in
another pid namespace is taken for dead (counted twice, never less). Admission is not in order:
a call larger than what is left may wait while smaller ones are admitted past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio


@dataclass(frozen=True)
class Reckoning:
    """What one purchase is held to count for while it is in flight; None: not known."""

    tokens: int | None
    usd: float | None


@dataclass(frozen=True)
class Elsewhere:
    """Purchases of a lineage that other gateways on the store (another process: the daemon
    beside a standalone ``ksfs gateway``) have recorded in flight, and what they reserved."""

    calls: int = 0
    tokens: int = 0
    usd: float = 0.0


@dataclass
class _Lineage:
    flying: int = 0
    flying_tokens: int = 0
    flying_usd: float = 0.0
    # purchases in flight that no reservation bounds, in tokens and in USD (a model with no
    # price has no USD reservation; a USD budget refuses it before it gets here)
    unknown_tokens: int = 0
    unknown_usd: int = 0
    largest_tokens: int | None = None
    largest_usd: float | None = None
    landed: trio.Event = field(default_factory=trio.Event)


class BudgetGate:
    """Per-lineage purchases in flight, what they are reckoned at, and the largest completed
    call's cost."""

    def __init__(self) -> None:
        self._lineages: dict[str, _Lineage] = {}

    def _of(self, lineage: str) -> _Lineage:
        return self._lineages.setdefault(lineage, _Lineage())

    def reckon(self, lineage: str, tokens: int, usd: float | None) -> Reckoning:
        """A new purchase's reservation: ``tokens``/``usd``, what its request may cost (its
        prompt and its completion cap, or the default reserve), at least the largest completed
        call's. ``usd`` None: its model has no price."""
        state = self._lineages.get(lineage) or _Lineage()
        t, u = tokens, usd
        if state.largest_tokens is not None:
            t = max(tokens, state.largest_tokens)
        if state.largest_usd is not None and usd is not None:
            u = max(usd, state.largest_usd)
        return Reckoning(t, u)

    def may_start(self, lineage: str, budget: dict[str, Any] | None,
                  used: dict[str, Any], new: Reckoning,
                  elsewhere: Elsewhere | None = None) -> bool:
        """Whether a new purchase fits beside those in flight (``used`` is what is spent):
        this gateway's, and ``elsewhere``, those other gateways on the store recorded."""
        state = self._lineages.get(lineage) or _Lineage()
        others = elsewhere or Elsewhere()
        if budget is None or (state.flying == 0 and others.calls == 0):
            return True
        for kind, reckoned, flying, unknown in (
                ("tokens", new.tokens, state.flying_tokens + others.tokens,
                 state.unknown_tokens),
                ("usd", new.usd, state.flying_usd + others.usd, state.unknown_usd)):
            if budget.get(kind) is None:
                continue
            if reckoned is None or unknown:
                return False  # a size nothing bounds: one at a time
            if used[kind] + flying + reckoned > budget[kind]:
                return False
        return True

    def flying(self, lineage: str) -> int:
        state = self._lineages.get(lineage)
        return state.flying if state is not None else 0

    async def wait_for_landing(self, lineage: str) -> None:
        """Until a purchase of ``lineage`` in flight ends (at once when none is)."""
        state = self._lineages.get(lineage)
        if state is not None and state.flying:
            await state.landed.wait()

    def started(self, lineage: str, new: Reckoning) -> None:
        state = self._of(lineage)
        state.flying += 1
        state.flying_tokens += new.tokens or 0
        state.flying_usd += new.usd or 0.0
        state.unknown_tokens += new.tokens is None
        state.unknown_usd += new.usd is None

    def landed(self, lineage: str, held: Reckoning, tokens: int | None = None,
               usd: float | None = None) -> None:
        """A purchase reckoned at ``held`` ended; ``tokens``/``usd`` are its cost when it
        completed and was counted."""
        state = self._of(lineage)
        state.flying -= 1
        state.flying_tokens -= held.tokens or 0
        state.flying_usd -= held.usd or 0.0
        state.unknown_tokens -= held.tokens is None
        state.unknown_usd -= held.usd is None
        if state.flying == 0:
            state.flying_tokens, state.flying_usd = 0, 0.0  # no float dust left behind
        if tokens is not None:
            state.largest_tokens = max(tokens, state.largest_tokens or 0)
        if usd is not None:
            state.largest_usd = max(usd, state.largest_usd or 0.0)
        state.landed.set()
        state.landed = trio.Event()
        if state.flying == 0 and state.largest_tokens is None and state.largest_usd is None:
            del self._lineages[lineage]  # nothing learned: keep no entry per idle lineage
