"""Reading a session's gateway usage straight from the store, without a running gateway.

The keeper's ``sessions/S/usage`` view and ``ksfs usage`` use this when no gateway is attached.
Read-only in effect (opening the gateway's dbs may create them empty); never talks HTTP.
"""

from __future__ import annotations

from typing import Any

from ksfs.gateway.store import GatewayStore


def read_usage(store: Any, ledger: Any, session: str) -> dict[str, Any]:
    """The same dict as ``Gateway.usage(session)``."""
    return GatewayStore(store, ledger).usage(session)
