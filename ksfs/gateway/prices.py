"""The gateway's price table: USD per million input and output tokens, per model, from TOML,
and optionally per million prompt tokens read from or written to the provider's prompt cache
(Anthropic's one-hour cache apart from its five-minute one).

It turns a response's token counts into a cost. It must never guess a price: a model with no
entry costs 0 and is reported as unpriced, so a missing price shows up in the usage instead of
hiding in a wrong total. No I/O beyond reading the table file.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ksfs.errors import BadInput


@dataclass(frozen=True)
class Price:
    """USD per 1,000,000 tokens. ``cache_read``/``cache_write``: prompt tokens read from or
    written to the provider's prompt cache; None when the table gives none, and then such tokens
    cost ``input`` (a discount is never guessed). ``cache_write_1h``: a write to Anthropic's
    one-hour cache (2x input where the five-minute one is 1.25x); None: such a write costs
    ``cache_write`` (as it did before the two were told apart), or ``input`` without that."""

    input: float
    output: float
    cache_read: float | None = None
    cache_write: float | None = None
    cache_write_1h: float | None = None

    @property
    def write_price(self) -> float:
        return self.input if self.cache_write is None else self.cache_write

    @property
    def write_1h_price(self) -> float:
        return self.write_price if self.cache_write_1h is None else self.cache_write_1h

    @property
    def prompt_ceiling(self) -> float:
        """The most one prompt token may cost: ``input``, or a cache price when that is higher
        (a cache write's: Anthropic's is about 1.25x input; a cache read above input is a
        table's mistake, but a reservation must not be below the cost all the same)."""
        return max([self.input, *(c for c in (self.cache_write, self.cache_write_1h,
                                              self.cache_read) if c is not None)])


# What may follow a priced name for the same model: a dated snapshot (gpt-4o-2024-08-06,
# gpt-3.5-turbo-0125) or the moving alias "latest". Anything else (gpt-4o-audio-preview,
# gpt-4o-realtime-...) is another model with its own prices, which must not be guessed.
SNAPSHOT = re.compile(r"(\d{4}-\d{2}-\d{2}|\d{4}|latest)")


class PriceTable:
    """Model name -> Price. Lookup is exact, else the entry the name extends with a snapshot
    suffix ("-2024-08-06", "-0125", "-latest")."""

    def __init__(self, prices: dict[str, Price], source: str = "") -> None:
        self.prices = dict(prices)
        self.source = source

    def price(self, model: str | None) -> Price | None:
        if not model:
            return None
        if model in self.prices:
            return self.prices[model]
        base, sep, suffix = model.rpartition("-")
        while sep:
            if base in self.prices and SNAPSHOT.fullmatch(suffix):
                return self.prices[base]
            # "gpt-4o-2024-08-06": the date itself holds dashes; try the longer suffix.
            base, sep, head = base.rpartition("-")
            suffix = head + "-" + suffix
        return None

    def cost(self, model: str | None, prompt_tokens: int, completion_tokens: int,
             other_tokens: int = 0, cache_read_tokens: int = 0,
             cache_write_tokens: int = 0, cache_write_1h_tokens: int = 0
             ) -> tuple[float, bool]:
        """(cost in USD, whether the model had a price). ``other_tokens``: tokens a usage
        counts in its total but as neither prompt nor completion (a usage of ``total_tokens``
        alone), priced at the higher of the two prices, since which they were is not said
        (QA F8: they cost 0). ``cache_read_tokens``/``cache_write_tokens`` are parts of
        ``prompt_tokens`` (never more than it), priced at the model's cache prices, or at its
        input price when the table gives none; ``cache_write_1h_tokens`` the part of the
        writes that went to the one-hour cache, priced at ``Price.write_1h_price``."""
        p = self.price(model)
        if p is None:
            return 0.0, False
        write = min(max(0, cache_write_tokens), prompt_tokens)
        write_1h = min(max(0, cache_write_1h_tokens), write)
        read = min(max(0, cache_read_tokens), prompt_tokens - write)
        usd = ((prompt_tokens - read - write) * p.input
               + read * (p.input if p.cache_read is None else p.cache_read)
               + (write - write_1h) * p.write_price + write_1h * p.write_1h_price
               + completion_tokens * p.output
               + other_tokens * max(p.input, p.output)) / 1_000_000
        return round(usd, 12), True

    def reservation(self, model: str | None, prompt_tokens: int,
                    completion_tokens: int) -> tuple[float, bool]:
        """(USD, priced) a purchase is reserved at before it is made: its prompt at the most a
        prompt token may cost (``Price.prompt_ceiling``: a cache write may cost more than
        input, and which tokens the provider caches is not known before), its completion at
        the output price. Never below what ``cost`` gives for the same tokens."""
        p = self.price(model)
        if p is None:
            return 0.0, False
        usd = (prompt_tokens * p.prompt_ceiling + completion_tokens * p.output) / 1_000_000
        return round(usd, 12), True


PRICE_FIELDS = ("input", "output", "cache_read", "cache_write", "cache_write_1h")
OPTIONAL_FIELDS = frozenset({"cache_read", "cache_write", "cache_write_1h"})


def parse_prices(text: str, source: str = "<text>") -> PriceTable:
    """A PriceTable from TOML text ``[models."NAME"] input = X, output = Y`` and, optionally,
    ``cache_read = R, cache_write = W, cache_write_1h = H``; BadInput if not."""
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
        unknown = sorted(set(entry) - set(PRICE_FIELDS))
        if unknown:  # a mistyped cache_read would price cached tokens at input, unseen
            raise BadInput(
                f"price table {source}: models.{name} has no field {unknown[0]!r} (its fields: "
                f"{', '.join(PRICE_FIELDS)})")
        vals: dict[str, float | None] = {}
        for field in PRICE_FIELDS:
            v = entry.get(field)
            if v is None and field in OPTIONAL_FIELDS:
                vals[field] = None  # cache tokens then cost the input price
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise BadInput(
                    f"price table {source}: models.{name}.{field} must be a number >= 0 "
                    "(USD per 1M tokens)"
                )
            vals[field] = float(v)
        out[name] = Price(**vals)
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
