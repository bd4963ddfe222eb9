"""Holding back new purchases that calls already in flight might push past a budget.

A call's cost is known only once its response is in, so a budget checked at the door alone lets
every call that starts while others are in flight through: ten concurrent calls on a budget with
room for one were all bought. ``BudgetGate`` lets a new purchase of a lineage that has a budget
start only when the budget still has room for it and for every purchase already in flight. Each
is reckoned at the larger of what its request says it may cost (``calls.estimated_tokens``: its
size and its own completion cap, priced by the table) and the largest cost a completed call of
this gateway has had on that lineage (as the provider reported it or, for an answer that
carried no usage, as the gateway estimated it from the answer's text). A request without a
completion cap, on a lineage with no completed call to size it by, has no reckoning: it starts
only when nothing else is in flight, and nothing starts beside it (the rule before requests
were sized). A purchase held back waits
(the guest's request stays open) until one in flight ends, then is checked again, and refused
with 402 if the budget is then used up.

What is left: a single call can still go past the budget by its own size (as a provider's own
limits allow), and one with no completion cap can cost more than the largest call before it.
The gate is per process: a standalone ``ksfs gateway`` beside the daemon does not see the
daemon's calls in flight. Without a budget nothing is held back.
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


@dataclass
class _Lineage:
    flying: int = 0
    flying_tokens: int = 0
    flying_usd: float = 0.0
    flying_unknown: int = 0  # purchases in flight that no reckoning bounds
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

    def reckon(self, lineage: str, tokens: int, usd: float | None, capped: bool) -> Reckoning:
        """A new purchase's reckoning: its request's estimate, at least the largest completed
        call's. ``capped``: the request bounds its completion, so the estimate is an upper
        bound; without a cap it is only a floor, and with no completed call to size it by the
        purchase has no reckoning (None). ``usd`` None: its model has no price."""
        state = self._lineages.get(lineage) or _Lineage()
        t = tokens if capped else None
        u = usd if capped else None
        if state.largest_tokens is not None:
            t = max(tokens, state.largest_tokens)
        if state.largest_usd is not None and usd is not None:
            u = max(usd, state.largest_usd)
        return Reckoning(t, u)

    def may_start(self, lineage: str, budget: dict[str, Any] | None,
                  used: dict[str, Any], new: Reckoning) -> bool:
        """Whether a new purchase fits beside those in flight (``used`` is what is spent)."""
        state = self._lineages.get(lineage)
        if budget is None or state is None or state.flying == 0:
            return True
        for kind, reckoned, flying in (("tokens", new.tokens, state.flying_tokens),
                                       ("usd", new.usd, state.flying_usd)):
            if budget.get(kind) is None:
                continue
            if reckoned is None or state.flying_unknown:
                return False  # a size nothing bounds: one at a time
            if used[kind] + flying + reckoned > budget[kind]:
                return False
        return True

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
        state.flying_unknown += 1 if new.tokens is None or new.usd is None else 0

    def landed(self, lineage: str, held: Reckoning, tokens: int | None = None,
               usd: float | None = None) -> None:
        """A purchase reckoned at ``held`` ended; ``tokens``/``usd`` are its cost when it
        completed and was counted."""
        state = self._of(lineage)
        state.flying -= 1
        state.flying_tokens -= held.tokens or 0
        state.flying_usd -= held.usd or 0.0
        state.flying_unknown -= 1 if held.tokens is None or held.usd is None else 0
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
