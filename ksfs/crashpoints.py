"""Crash points for fault tests: kill this process at a named durability boundary.

When the environment variable ``KSFS_CRASH_AT`` names a point (``pack.fsync``, ``index.commit``,
...), ``crash_point(name)`` sends SIGKILL to the process the first time (or the Nth time, with
``KSFS_CRASH_AT=name:N``) execution reaches it. ``KSFS_FAIL_AT`` (same syntax) raises
``InjectedFault`` there instead, to test what a verb does when a step fails and the process
lives on; ``KSFS_INTERRUPT_AT`` sends the process SIGINT there, Ctrl-C at that instant;
``KSFS_STOP_AT`` stops it there (SIGSTOP) until a SIGCONT, so a test can change the world at
that instant. The variables are read when ksfs is imported; in normal runs the check is one
global's test. Points in use are listed in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import threading

from ksfs.errors import KsfsError

_hits: dict[str, int] = {}
_VARIABLES = ("KSFS_CRASH_AT", "KSFS_FAIL_AT", "KSFS_STOP_AT", "KSFS_INTERRUPT_AT")
# Read once: the points sit on the hot paths (every record a pack appends), and a test sets
# the variables in the environment of the process it starts.
_ARMED = any(os.environ.get(v) for v in _VARIABLES)


class InjectedFault(KsfsError):
    """injected fault at {point} (KSFS_FAIL_AT)"""


def crash_point(name: str) -> None:
    if not _ARMED:
        return
    if _reached(name, "KSFS_CRASH_AT"):
        os.kill(os.getpid(), signal.SIGKILL)
    if _reached(name, "KSFS_FAIL_AT"):
        raise InjectedFault(point=name)
    if _reached(name, "KSFS_STOP_AT"):
        os.kill(os.getpid(), signal.SIGSTOP)  # held until a SIGCONT: a test acts meanwhile
    if _reached(name, "KSFS_INTERRUPT_AT"):
        if threading.current_thread() is not threading.main_thread():
            raise KeyboardInterrupt  # (a real one lands in the main thread; the nearest)
        # As at a terminal: a process a shell started in the background (CI's runner) has
        # SIGINT ignored, and Python keeps an ignored SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGINT)


def _reached(name: str, variable: str) -> bool:
    """Whether this is the Nth time ``name`` is reached, N given in ``variable``."""
    target = os.environ.get(variable)
    if not target:
        return False
    point, _, nth = target.partition(":")
    if point != name:
        return False
    key = f"{variable}:{name}"
    _hits[key] = _hits.get(key, 0) + 1
    return _hits[key] == int(nth or 1)
