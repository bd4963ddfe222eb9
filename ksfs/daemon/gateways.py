"""Run the model-call gateway inside the daemon: one server per live machine session.

Each session's port is fixed at its creation (``gateway_port`` in its config) because its guest
learns it once; the token is derived from the store's secret and the session's lineage, so no
file of its own holds it (it reaches the guest in the domain XML, which each checkpoint keeps).
A supervisor task starts a server for every live machine session and
stops the servers of removed ones; a verb that makes a machine session (session new, fork)
waits for it before the guest runs, so a new guest's first call finds its gateway listening.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import trio

from ksfs.errors import KsfsError

log = logging.getLogger("ksfs.daemon.gateways")
POLL_S = 0.5
WATCH_WAIT_S = 5.0  # the longest a verb waits for a pass that serves its new session
RETRY_FIRST_S = 0.5  # a port that could not be bound is tried again after this, then
RETRY_MAX_S = 30.0  # twice as long each time, up to this


class GatewaySupervisor:
    """Keeps one gateway server per live machine session: a pass over the ledger every
    POLL_S, and at once when a verb asks (``listening_now``, the keeper's gateway_watcher)."""

    def __init__(self, keeper: Any, gateway: Any) -> None:
        self.keeper = keeper
        self.gateway = gateway
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake = trio.Event()
        self._begun = 0  # passes begun
        self._done = 0  # passes done
        self._pass_done = trio.Event()

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled. Started (for ``nursery.start``) once the first pass has its
        servers listening or their binds failed: a mount is ready only with them."""
        self._token = trio.lowlevel.current_trio_token()
        running: dict[str, trio.CancelScope] = {}
        async with trio.open_nursery() as nursery:
            while True:
                self._begun += 1
                wanted = await trio.to_thread.run_sync(self.keeper.gateway_targets)
                for session, scope in list(running.items()):
                    if session not in wanted:
                        scope.cancel()
                        del running[session]
                for session, (port, token) in wanted.items():
                    if session not in running:
                        running[session] = await nursery.start(_serve_one, self.gateway,
                                                               session, port, token)
                self._done += 1
                self._pass_done.set()
                self._pass_done = trio.Event()
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                with trio.move_on_after(POLL_S):
                    await self._wake.wait()
                self._wake = trio.Event()

    def listening_now(self) -> None:
        """On a verb's thread: return once a pass begun after this call is done, so that every
        session in the ledger by now has its server (at most WATCH_WAIT_S; on the daemon's own
        thread, or after it stopped, at once)."""
        if self._token is None:
            return
        with contextlib.suppress(RuntimeError):  # (trio's thread, or trio has finished)
            trio.from_thread.run(self._after_a_new_pass, trio_token=self._token)

    async def _after_a_new_pass(self) -> None:
        wanted = self._begun + 1
        self._wake.set()
        with trio.move_on_after(WATCH_WAIT_S):
            while self._done < wanted:
                await self._pass_done.wait()


async def _serve_one(gateway: Any, session: str, port: int, token: str,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve one session's gateway until cancelled; started (with the scope that stops it)
    once its first bind succeeded or failed. A port that cannot be bound (in use by
    something else, for now) is tried again, after RETRY_FIRST_S and then twice as long each
    time up to RETRY_MAX_S, and said in the log and in the session's usage (``server``,
    ``Gateway.usage``) until it binds (QA F6: a port busy when the daemon started was never
    tried again, and the session's guest had no gateway for as long as the daemon ran). A
    failure that trying again cannot mend (the session removed under its server, a port the
    session's config holds that is no TCP port) is said once and left."""
    with trio.CancelScope() as scope:
        try:
            await _serve_until_mended(gateway, session, port, token,
                                      functools.partial(task_status.started, scope))
        finally:
            _say(gateway, session, None)  # no longer served: nothing to say of its server


async def _serve_until_mended(gateway: Any, session: str, port: int, token: str,
                              first_tried: Callable[[], None] | None) -> None:
    delay, attempt = RETRY_FIRST_S, 0
    while True:
        attempt += 1
        failed: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                try:
                    await nursery.start(functools.partial(gateway.serve_session, session,
                                                          port=port, token=token))
                finally:
                    if first_tried is not None:  # once: the attempt count starts again
                        first_tried()  # after a bind, and trio's started() takes one call
                        first_tried = None
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
