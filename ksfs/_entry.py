"""The ``ksfs`` command's entry point (pyproject's [project.scripts]).

Kept apart from ``ksfs.cli`` so that a Ctrl-C while the command line's modules load (click and
the rest: tens of milliseconds) ends as a Ctrl-C does later, with one line and status 130, not
a traceback (QA, eighteenth session).

A finished command leaves through ``_leave``, without the interpreter's teardown: freeing every
object and module one by one took 15-30 ms after an import had closed its store (the heap of
chunk lists, bases and page keys), about a twelfth of a later checkpoint's whole import
(docs/performance.md, thirtieth session). Nothing is lost by it: the verb has closed what it
opened, the exit handlers still run, and the output is flushed first.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from ksfs.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("ksfs: error: aborted\n")
        raise SystemExit(130) from None
    try:
        cli_main()
    except SystemExit as exc:
        _leave(exc.code)
    _leave(0)


def _leave(code: object) -> None:
    """Exit with ``code`` at once, or as Python would where that could lose something: another
    thread still running (its work would be cut off), a status that is no number (Python prints
    it), or output that cannot be flushed (Python reports that its own way)."""
    import atexit
    import os
    import threading

    if code is None:
        code = 0
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255 \
            or threading.active_count() > 1:
        raise SystemExit(code)
    atexit._run_exitfuncs()  # logging's flush, a test's coverage hook: what Python would run
    try:  # after them: what they print is output too
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        raise SystemExit(code) from None
    os._exit(code)
