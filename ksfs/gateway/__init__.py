"""The model-call gateway: OpenAI-style chat completions (and every other call that can cost
money) on loopback, bought once, replayed after a save, counted per session and held to a budget.

Layer 5: imports ksfs.errors, ksfs.model, ksfs.ledger, lmdb, blake3, trio and its HTTP stack
(hypercorn, httpx); never ksfs.cas (it takes the store by shape: ``.env`` and ``.path``),
pyfuse3, libvirt or click. See docs/gateway.md.

    gw = Gateway(store, ledger, "http://127.0.0.1:8000", prices=None, api_key=None)
    port = await nursery.start(gw.serve_session, "s1")     # one port per session
    gw.usage("s1"); gw.set_budget("s1", tokens=10_000, usd=1.5)
"""

from ksfs.gateway.calls import Usage, canonical_body, derived_key, header_key
from ksfs.gateway.prices import Price, PriceTable, load_prices, parse_prices
from ksfs.gateway.store import GatewayStore, StoredResponse
from ksfs.gateway.usage import read_usage


def __getattr__(name: str):
    # The service pulls in hypercorn, httpx and trio (most of a second to import); the CLI's
    # usage and budget verbs and the keeper's usage view need only the store side.
    if name in ("API_KEY_ENV", "Gateway", "api_key_from_env"):
        from ksfs.gateway import service

        return getattr(service, name)
    raise AttributeError(f"module 'ksfs.gateway' has no attribute {name!r}")


__all__ = [
    "API_KEY_ENV",
    "Gateway",
    "GatewayStore",
    "Price",
    "PriceTable",
    "StoredResponse",
    "Usage",
    "api_key_from_env",
    "canonical_body",
    "derived_key",
    "header_key",
    "load_prices",
    "parse_prices",
    "read_usage",
]
