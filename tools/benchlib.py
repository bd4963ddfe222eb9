"""Shared by tools/bench-vm and tools/bench-verbs: percentiles and the guest's real pauses.

A pause is measured from libvirt's lifecycle events (SUSPENDED -> RESUMED), delivered on a thread
running libvirt's default event loop; it must be registered before the connection is opened.
"""

from __future__ import annotations

import threading
import time

import libvirt


def pct(values: list[float], q: float) -> float:
    vs = sorted(values)
    if not vs:
        return float("nan")
    k = (len(vs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(vs) - 1)
    return vs[lo] + (vs[hi] - vs[lo]) * (k - lo)


class Lifecycle:
    """Records (time, domain, event) of every lifecycle event on the connections it watches."""

    def __init__(self) -> None:
        libvirt.virEventRegisterDefaultImpl()
        threading.Thread(target=self._loop, daemon=True).start()
        self.events: list[tuple[float, str, int]] = []

    @staticmethod
    def _loop() -> None:
        while True:
            libvirt.virEventRunDefaultImpl()

    def _seen(self, _conn, dom, event, _detail, _opaque) -> None:  # noqa: ANN001
        self.events.append((time.monotonic(), dom.name(), event))

    def watch(self, conn: libvirt.virConnect) -> None:
        conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._seen, None)

    def pause_of(self, domain: str, t0: float, t1: float) -> float | None:
        """Seconds between the SUSPENDED and the RESUMED event of ``domain`` in [t0, t1 + 1]."""
        time.sleep(0.05)  # let the event thread deliver the RESUMED event
        sus = [t for t, d, e in self.events
               if d == domain and e == libvirt.VIR_DOMAIN_EVENT_SUSPENDED and t0 <= t <= t1 + 1]
        res = [t for t, d, e in self.events
               if d == domain and e == libvirt.VIR_DOMAIN_EVENT_RESUMED
               and sus and sus[0] <= t <= t1 + 1]
        return res[-1] - sus[0] if sus and res else None
