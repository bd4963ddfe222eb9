"""Dropping names from the kernel's cache, and waiting until that is done.

The mount tells the kernel to forget a session's or checkpoint's name when the daemon publishes
or deletes one (``mount.forget_entry``). The verb that did it often runs inside a FUSE request
on the same directory (``mkdir``, ``rmdir``), and the kernel's notify waits for every pending
request on that directory (``pyfuse3.invalidate_entry``), so the verb cannot make it itself:
this thread does. pyfuse3's own ``invalidate_entry_async`` does the same but gives no way to
wait for it, so a verb asked for through the control socket (``ksfs rm``) could answer before
the kernel had dropped the name, and an ``ls`` right after still showed it for up to a second.
The control socket answers once ``settle`` returns: after the verb, outside every lock it took.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading

import pyfuse3

log = logging.getLogger(__name__)

SETTLE_WAIT_S = 2.0  # a notify stuck behind a request the kernel never ends must not hang a verb


class NameForgetter:
    """One thread making the kernel's notifies in the order asked; ``settle`` waits for those
    asked before it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._asked = 0
        self._made = 0
        self._thread = threading.Thread(target=self._run, name="ksfs-forget", daemon=True)
        self._thread.start()

    def forget(self, parent: int, name: bytes) -> None:
        """Have the kernel forget ``name`` in directory ``parent``; returns at once."""
        with self._done:
            self._asked += 1
        self._queue.put((parent, name))

    def settle(self, timeout: float = SETTLE_WAIT_S) -> bool:
        """Wait until the names asked so far are forgotten; False if that took over timeout."""
        with self._done:
            target = self._asked
            return self._done.wait_for(lambda: self._made >= target, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Stop once what was asked is done, before the FUSE session is destroyed; waited for
        only so long, as the kernel may hold a notify until the mount is gone."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            parent, name = item
            try:
                pyfuse3.invalidate_entry(parent, name)
            except OSError as exc:  # not cached (ENOENT), or the mount is going: nothing held
                if exc.errno not in (errno.ENOENT, errno.ENOTCONN, errno.EBADF):
                    log.warning("the kernel did not forget %r: %s", name, exc)
            except Exception:  # a bug must not stop every later notify
                log.exception("forgetting %r failed", name)
            finally:
                with self._done:
                    self._made += 1
                    self._done.notify_all()
