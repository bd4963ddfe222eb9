"""What each session's long verb is doing now: the ``doing`` of its status.

A save, restore, fork or new session started by ``mkdir`` or a write to ``resume`` has no
terminal to draw progress on: the process that made the request is blocked in the system call.
So the keeper keeps, per session, the step its verb is at (with bytes done of total, as the
command line's bar shows them), and the mount's ``status`` file shows it to whoever looks from
another shell. The progress still goes to the verb's own caller too (the control socket's
command line).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ksfs import progress


class Activity:
    def __init__(self) -> None:
        self._now: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def doing(self, session: str, verb: str, **about: Any) -> Iterator[None]:
        """While the block runs (under the session's lock: one verb at a time), ``session`` is
        doing ``verb``; its progress reports update the entry and go on to the caller's sink."""
        entry: dict[str, Any] = {"verb": verb, **about, "step": None, "done": None,
                                 "total": None, "since": time.time()}
        outer = progress.current()

        def sink(step: str, done: int | None, total: int | None) -> None:
            with self._lock:
                entry.update(step=step, done=done, total=total)
            if outer is not None:
                outer(step, done, total)

        with self._lock:
            self._now[session] = entry
        try:
            with progress.reporting(sink):
                yield
        finally:
            with self._lock:
                if self._now.get(session) is entry:
                    del self._now[session]

    def of(self, session: str) -> dict[str, Any] | None:
        """A copy of what ``session`` is doing, None when no verb of it runs in this process."""
        with self._lock:
            entry = self._now.get(session)
            return dict(entry) if entry is not None else None
