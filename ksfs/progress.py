"""Progress of the long verbs (save, restore, fork, session new): a step's name and, when it
moves bytes, how many of how many.

Whoever wants them installs a sink with ``reporting`` (the command line draws them on a
terminal; the daemon sends them down the control socket to that command line); ``report`` is a
no-op without one. The sink lives in a context variable, so concurrent verbs in the daemon's
worker threads each report to their own caller; threads a verb starts itself take the sink with
``current()`` and report through ``Steps``. Progress never breaks a verb: a failing sink is
logged and dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

Sink = Callable[[str, "int | None", "int | None"], None]

_sink: contextvars.ContextVar[Sink | None] = contextvars.ContextVar("ksfs_progress", default=None)


def current() -> Sink | None:
    """The sink of the verb running in this thread (to hand to threads it starts)."""
    return _sink.get()


@contextlib.contextmanager
def reporting(sink: Sink | None) -> Iterator[None]:
    """Send the progress of what runs in the block (in this thread) to ``sink``."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


def report(step: str, done: int | None = None, total: int | None = None,
           sink: Sink | None = None) -> None:
    """Tell this thread's caller (or ``sink``) that the verb is at ``step``."""
    sink = sink or _sink.get()
    if sink is None:
        return
    try:
        sink(step, done, total)
    except Exception:  # noqa: BLE001 - a caller gone away must not fail the save it asked for
        log.debug("progress sink failed", exc_info=True)


class Steps:
    """Bytes of one step done by several threads at once (files written in parallel)."""

    def __init__(self, step: str, total: int | None, sink: Sink | None = None) -> None:
        self.step = step
        self.total = total
        self.sink = sink or _sink.get()
        self.done = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.sink is None:
            return
        with self._lock:
            self.done += n
            done = self.done
        report(self.step, done, self.total, sink=self.sink)


class Throttle:
    """Which reports to pass on: every change of step, and the same step at most once every
    ``every`` seconds (a terminal redraw, a control-socket line). Thread-safe."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last = ("", 0.0)
        self._lock = threading.Lock()

    def due(self, step: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if step == self._last[0] and now - self._last[1] < self.every:
                return False
            self._last = (step, now)
            return True


class Beside:
    """Two parts of one verb that run at once (a restore's save-first and the writing of its
    target), reported as one line: ``first's step; second's step`` with the second's bytes.
    Each part reporting on its own would make the caller's line flip between the two at every
    report (QA, fourteenth session). Once the second part is ``done``, the first reports alone
    again, bytes and all."""

    def __init__(self, sink: Sink | None = None) -> None:
        self.sink = sink or _sink.get()
        self._lock = threading.Lock()
        self._first: tuple[str, int | None, int | None] | None = None
        self._second: tuple[str, int | None, int | None] | None = None
        self._second_done = False

    def first(self, step: str, done: int | None = None, total: int | None = None) -> None:
        with self._lock:
            self._first = (step, done, total)
        self._show()

    def second(self, step: str, done: int | None = None, total: int | None = None) -> None:
        with self._lock:
            if not self._second_done:
                self._second = (step, done, total)
        self._show()

    def done(self) -> None:
        """The second part ended."""
        with self._lock:
            self._second_done, self._second = True, None
        self._show()

    def _show(self) -> None:
        if self.sink is None:
            # Nobody listens. (Not report()'s fall back to this thread's sink: the parts run
            # with this object as theirs, and it would report to itself without end.)
            return
        with self._lock:
            first, second = self._first, self._second
        if second is None:
            if first is not None:
                report(*first, sink=self.sink)
        elif first is None:
            report(*second, sink=self.sink)
        else:
            report(f"{first[0]}; {second[0]}", second[1], second[2], sink=self.sink)
