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
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the adaptive threshold; above a batch (8 MiB)
TRIM_THRESHOLD = 64 << 20
# A long-running process (the mount daemon) runs verbs, READs and the store's workers on a
# dozen threads; glibc gives each its own arena (up to 8 per core), and the trim threshold holds
# per arena, so freed heap kept several times 64 MiB (QA, tenth session: 400-600 MB RSS for one
# small guest, 70 MB of it Python's). Two arenas, and a trim of every arena when idle.
LONG_RUNNING_ARENAS = 2
TRIM_EVERY = 30.0  # seconds between trims in a long-running process

_done = False


def _libc():
    # the interpreter's own symbols: libc is already loaded (ctypes.util would cost ~15 ms)
    return ctypes.CDLL(None)


def tune_for_bulk_reads(long_running: bool = False) -> bool:
    """Apply the thresholds once per process (and, for a daemon, the arena cap); True when
    glibc took them."""
    global _done
    if _done:
        return True
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if long_running:
        _done = bool(mallopt(M_ARENA_MAX, LONG_RUNNING_ARENAS)) and _done
    return _done


def trim() -> bool:
    """Give every arena's free pages back to the kernel (glibc's malloc_trim(0)); True when
    some were."""
    try:
        malloc_trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))
