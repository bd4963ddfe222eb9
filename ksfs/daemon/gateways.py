"""Run the model-call gateway inside the daemon: one server per live machine session.

Each session's port is fixed at its creation (``gateway_port`` in its config) because its guest
learns it once; the token is derived from the store's secret and the session's lineage, so no
file of its own holds it (it reaches the guest in the domain XML, which each checkpoint keeps).
A supervisor task starts a server for every live machine session and
stops the servers of removed ones, so sessions made while mounted are served at once.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ksfs.errors import KsfsError

log = logging.getLogger("ksfs.daemon.gateways")
POLL_S = 0.5


async def serve_gateways(keeper: Any, gateway: Any) -> None:
    """Keep one gateway server per live machine session until cancelled."""
    running: dict[str, trio.CancelScope] = {}
    async with trio.open_nursery() as nursery:
        while True:
            wanted = await trio.to_thread.run_sync(keeper.gateway_targets)
            for session, scope in list(running.items()):
                if session not in wanted:
                    scope.cancel()
                    del running[session]
            for session, (port, token) in wanted.items():
                if session not in running:
                    running[session] = await nursery.start(_serve_one, gateway, session, port,
                                                           token)
            await trio.sleep(POLL_S)


async def _serve_one(gateway: Any, session: str, port: int, token: str,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            await gateway.serve_session(session, port=port, token=token)
        except* (KsfsError, OSError) as group:
            # A port taken by something else (or a server that failed while running, e.g. its
            # session removed under it): say so once; the session's guest gets no gateway,
            # and the daemon, with every other session's gateway, runs on.
            log.error("gateway for session %s on port %s stopped: %s", session, port,
                      group.exceptions[0])
            await trio.sleep_forever()
