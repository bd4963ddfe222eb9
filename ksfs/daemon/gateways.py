"""Run the model-call gateway inside the daemon: one server per live machine session.

Each session's port is fixed at its creation (``gateway_port`` in its config) because its guest
learns it once; the token is derived from the store's secret and the session's lineage, so no
file of its own holds it (it reaches the guest in the domain XML, which each checkpoint keeps).
A supervisor task starts a server for every live machine session and
stops the servers of removed ones, so sessions made while mounted are served at once.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import trio

from ksfs.errors import KsfsError

log = logging.getLogger("ksfs.daemon.gateways")
POLL_S = 0.5
RETRY_FIRST_S = 0.5  # a port that could not be bound is tried again after this, then
RETRY_MAX_S = 30.0  # twice as long each time, up to this


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
    """Serve one session's gateway until cancelled. A port that cannot be bound (in use by
    something else, for now) is tried again, after RETRY_FIRST_S and then twice as long each
    time up to RETRY_MAX_S, and said in the log and in the session's usage (``server``,
    ``Gateway.usage``) until it binds (QA F6: a port busy when the daemon started was never
    tried again, and the session's guest had no gateway for as long as the daemon ran). A
    failure that trying again cannot mend (the session removed under its server, a port the
    session's config holds that is no TCP port) is said once and left."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            await _serve_until_mended(gateway, session, port, token)
        finally:
            _say(gateway, session, None)  # no longer served: nothing to say of its server


async def _serve_until_mended(gateway: Any, session: str, port: int, token: str) -> None:
    delay, attempt = RETRY_FIRST_S, 0
    while True:
        attempt += 1
        failed: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(functools.partial(gateway.serve_session, session,
                                                      port=port, token=token))
                if attempt > 1:
                    log.info("gateway for session %s listening on port %s after %d attempts",
                             session, port, attempt)
                _say(gateway, session, None)
                delay, attempt = RETRY_FIRST_S, 0
        except* OSError as group:
            failed = _first(group)
        except* KsfsError as group:
            # Said once: the session's guest gets no gateway, and the daemon, with every
            # other session's gateway, runs on.
            why = _first(group)
            _say(gateway, session, f"stopped: {why}")
            log.error("gateway for session %s on port %s stopped: %s", session, port, why)
            await trio.sleep_forever()
        if failed is not None:
            _say(gateway, session, f"port {port} could not be bound ({failed}); trying again "
                                   f"in {delay:g} s (attempt {attempt})")
            log.error("gateway for session %s: port %s could not be bound: %s; trying again "
                      "in %g s", session, port, failed, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
        else:
            await trio.sleep(RETRY_FIRST_S)  # (a server that ended without an error)


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _say(gateway: Any, session: str, problem: str | None) -> None:
    """What is wrong with the session's server, for its usage to show (None: nothing)."""
    problems = getattr(gateway, "problems", None)
    if problems is None:
        return
    if problem is None:
        problems.pop(session, None)
    else:
        problems[session] = problem
