"""One line on a terminal's standard error saying where a long verb is: its step, how far
(percent and bytes, when the step moves bytes) and the time so far. Redrawn in place at most
ten times a second and erased when the verb ends, so the verb's own report stands alone. Nothing
at all when standard error is not a terminal (scripts, pipes, CI logs)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

from ksfs.progress import Throttle

REDRAW_EVERY = 0.1


def fit(head: str, tail: str, width: int) -> str:
    """``head + tail`` in ``width - 1`` columns, the middle of ``head`` cut when it must be: a
    line that wraps is not erased by the next redraw's carriage return, so each would stack
    under the last."""
    room = max(width - 1 - len(tail), 12)
    if len(head) > room:
        keep = room - 3  # "..." rather than an ellipsis: the terminal may not speak UTF-8
        head = head[: keep - keep // 3] + "..." + head[len(head) - keep // 3:]
    return head + tail


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f}" if n >= 10 << 20 else f"{n / (1 << 20):.1f}"


def drawing_terminal() -> bool:
    """Whether stderr is a terminal that redraws a line: not piped, closed or replaced, and not
    TERM=dumb (QA, thirty-fourth session: an Emacs shell got the bar's cursor escapes)."""
    try:
        return bool(sys.stderr.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


class StepLine:
    def __init__(self, label: str, out: TextIO | None = None) -> None:
        self.label = label
        self.out = out or sys.stderr
        self.t0 = time.monotonic()
        self.throttle = Throttle(REDRAW_EVERY)
        self.shown = False
        self.lock = threading.Lock()  # a local verb reports from several threads

    @classmethod
    def for_terminal(cls, label: str) -> StepLine | None:
        return cls(label) if drawing_terminal() else None

    def __call__(self, step: str, done: int | None = None, total: int | None = None) -> None:
        if not self.throttle.due(step):
            return
        with self.lock:
            tail = ""
            if total:
                done = min(done or 0, total)  # a live memory copy sends dirty pages again
                tail = f" {100 * done // total}% ({_mib(done)} of {_mib(total)} MiB)"
            tail += f"  {time.monotonic() - self.t0:.1f}s"
            self._write("\r\x1b[K" + fit(f"{self.label}: {step}", tail, self.width()))
            self.shown = True

    def width(self) -> int:
        try:
            columns = os.get_terminal_size(self.out.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
        return columns or 80  # a pseudo-terminal nobody sized says 0

    def close(self) -> None:
        with self.lock:
            if self.shown:
                self._write("\r\x1b[K")
                self.shown = False

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):  # the terminal went away: the verb goes on
            pass
