"""Holding back new purchases that calls already in flight might push past a budget.

A call's cost is known only once its response is in, so a budget checked at the door alone lets
every call that starts while others are in flight through: ten concurrent calls on a budget with
room for one were all bought. ``BudgetGate`` lets a new purchase of a lineage that has a budget
start only when the budget still has room for it and for every purchase already in flight, each
reckoned at the largest cost a completed call of this gateway has had on that lineage. Until one
has completed the size of a call is unknown, so such purchases run one at a time. A purchase held
back waits (the guest's request stays open) until one in flight ends, then is checked again, and
refused with 402 if the budget is then used up.

What is left: a single call can still go past the budget by its own size (as a provider's own
limits allow), and one larger than every call before it can go past its reckoned share. The
gate is per process: a standalone ``ksfs gateway`` beside the daemon does not see the daemon's
calls in flight. Without a budget nothing is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio


@dataclass
class _Lineage:
    flying: int = 0
    largest_tokens: int | None = None
    largest_usd: float | None = None
    landed: trio.Event = field(default_factory=trio.Event)


class BudgetGate:
    """Per-lineage count of purchases in flight and the largest completed call's cost."""

    def __init__(self) -> None:
        self._lineages: dict[str, _Lineage] = {}

    def _of(self, lineage: str) -> _Lineage:
        return self._lineages.setdefault(lineage, _Lineage())

    def may_start(self, lineage: str, budget: dict[str, Any] | None,
                  used: dict[str, Any]) -> bool:
        """Whether a new purchase fits beside those in flight (``used`` is what is spent)."""
        state = self._of(lineage)
        if budget is None or state.flying == 0:
            return True
        calls = state.flying + 1
        for kind, largest in (("tokens", state.largest_tokens), ("usd", state.largest_usd)):
            if budget.get(kind) is None:
                continue
            if largest is None or used[kind] + calls * largest > budget[kind]:
                return False  # a call's size unknown yet, or no room for one more
        return True

    async def wait_for_landing(self, lineage: str) -> None:
        """Until a purchase of ``lineage`` in flight ends (at once when none is)."""
        state = self._of(lineage)
        if state.flying:
            await state.landed.wait()

    def started(self, lineage: str) -> None:
        self._of(lineage).flying += 1

    def landed(self, lineage: str, tokens: int | None = None, usd: float | None = None) -> None:
        """A purchase ended; ``tokens``/``usd`` are its cost when it completed and was counted."""
        state = self._of(lineage)
        state.flying -= 1
        if tokens is not None:
            state.largest_tokens = max(tokens, state.largest_tokens or 0)
        if usd is not None:
            state.largest_usd = max(usd, state.largest_usd or 0.0)
        state.landed.set()
        state.landed = trio.Event()
        if state.flying == 0 and state.largest_tokens is None and state.largest_usd is None:
            del self._lineages[lineage]  # nothing learned: keep no entry per idle lineage
