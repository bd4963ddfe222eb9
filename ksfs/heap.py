"""Process-wide malloc settings for bulk reads (glibc only; elsewhere a no-op).

An import or save reads its files in 8 MiB batches and hands them to worker threads. With glibc's
defaults a fresh process serves each batch with a new mmap (the threshold only adapts after the
first frees) and gives freed heap back to the kernel, so every batch is faulted in and zeroed
again: half of a short import's system time on this kind of VM. Fixed thresholds above the batch
size let the heap be reused from the first batch on. The cost is that up to TRIM_THRESHOLD of
freed heap stays mapped in a process (a long-running daemon included) instead of going back to
the kernel. Measured in docs/performance.md ("import start-up", fourth session).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the adaptive threshold; above a batch (8 MiB)
TRIM_THRESHOLD = 64 << 20

_done = False


def tune_for_bulk_reads() -> bool:
    """Apply the thresholds once per process; True when glibc took them."""
    global _done
    if _done:
        return True
    try:
        # the interpreter's own symbols: libc is already loaded (ctypes.util would cost ~15 ms)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
