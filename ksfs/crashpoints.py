"""Crash points for fault tests: kill this process at a named durability boundary.

When the environment variable ``KSFS_CRASH_AT`` names a point (``pack.fsync``, ``index.commit``,
...), ``crash_point(name)`` sends SIGKILL to the process the first time (or the Nth time, with
``KSFS_CRASH_AT=name:N``) execution reaches it. Nothing else happens in normal runs: the check is
one dict lookup. Points in use are listed in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal

_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    target = os.environ.get("KSFS_CRASH_AT")
    if not target:
        return
    point, _, nth = target.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
