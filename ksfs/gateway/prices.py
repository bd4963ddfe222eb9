"""The gateway's price table: USD per million input and output tokens, per model, from TOML.

It turns a response's token counts into a cost. It must never guess a price: a model with no
entry costs 0 and is reported as unpriced, so a missing price shows up in the usage instead of
hiding in a wrong total. No I/O beyond reading the table file.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ksfs.errors import BadInput


@dataclass(frozen=True)
class Price:
    """USD per 1,000,000 tokens."""

    input: float
    output: float


class PriceTable:
    """Model name -> Price. Lookup is exact, else the longest entry the name extends with '-'."""

    def __init__(self, prices: dict[str, Price], source: str = "") -> None:
        self.prices = dict(prices)
        self.source = source

    def price(self, model: str | None) -> Price | None:
        if not model:
            return None
        if model in self.prices:
            return self.prices[model]
        best = None
        for name in self.prices:
            if model.startswith(name + "-") and (best is None or len(name) > len(best)):
                best = name
        return None if best is None else self.prices[best]

    def cost(self, model: str | None, prompt_tokens: int, completion_tokens: int
             ) -> tuple[float, bool]:
        """(cost in USD, whether the model had a price)."""
        p = self.price(model)
        if p is None:
            return 0.0, False
        usd = (prompt_tokens * p.input + completion_tokens * p.output) / 1_000_000
        return round(usd, 12), True


def parse_prices(text: str, source: str = "<text>") -> PriceTable:
    """A PriceTable from TOML text ``[models."NAME"] input = X, output = Y``; BadInput if not."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"price table {source} is not valid TOML: {exc}") from None
    models = doc.get("models")
    if not isinstance(models, dict):
        raise BadInput(f"price table {source} has no [models.\"NAME\"] tables")
    out: dict[str, Price] = {}
    for name, entry in models.items():
        if not isinstance(entry, dict):
            raise BadInput(f"price table {source}: models.{name} is not a table")
        vals = []
        for field in ("input", "output"):
            v = entry.get(field)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise BadInput(
                    f"price table {source}: models.{name}.{field} must be a number >= 0 "
                    "(USD per 1M tokens)"
                )
            vals.append(float(v))
        out[name] = Price(*vals)
    return PriceTable(out, source)


def load_prices(path: str | Path | None = None) -> PriceTable:
    """The table at ``path``, or the default one shipped with ksfs (ksfs/gateway/prices.toml)."""
    if path is None:
        text = resources.files("ksfs.gateway").joinpath("prices.toml").read_text("utf-8")
        return parse_prices(text, "ksfs/gateway/prices.toml")
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read price table {path}: {exc.strerror or exc}") from None
    return parse_prices(text, str(path))
