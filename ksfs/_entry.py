"""The ``ksfs`` command's entry point (pyproject's [project.scripts]).

Kept apart from ``ksfs.cli`` so that a Ctrl-C while the command line's modules load (click and
the rest: tens of milliseconds) ends as a Ctrl-C does later, with one line and status 130, not
a traceback (QA, eighteenth session).
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from ksfs.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("ksfs: error: aborted\n")
        raise SystemExit(130) from None
    cli_main()
