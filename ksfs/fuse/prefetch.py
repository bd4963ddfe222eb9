"""Sequential read-ahead of checkpoint files: decode the next blocks on worker threads before the
kernel asks for them, so a READ of a sequential reader is answered from bytes already decoded.

Why: a first read through FUSE pays, for each 1 MiB request, pyfuse3's dispatch on the trio loop
and the store's decompression and hashing, in series. Decoding ahead on ``THREADS`` threads takes
the second off the request path and overlaps it with the first.

Not done: pushing the decoded bytes into the page cache (``pyfuse3.notify_store``). Measured no
faster here, and a push waits on the page locks of READs in flight: a reader was left stuck in
the kernel for good when pushes and readahead met (see docs/mount.md, "Performance").

What keeps it correct and bounded:
- Only verified bytes: blocks come from the store's reader (every chunk checked against its id).
  A block that fails is dropped; the READ that needs it decodes it again on the ordinary path and
  gets the error (EIO) there.
- Bounded: each file holds at most ``inflight`` blocks, decoded or being decoded, none further
  than ``window`` past the furthest READ; a block leaves when a READ takes it. One pool of
  ``THREADS`` daemon threads for the mount. Workers never wait on the kernel, only compute.
- Stops with its reader: ``close`` at release drops the blocks; a far jump ends the stream.
This module imports neither trio nor pyfuse3.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

BLOCK = 1024 * 1024  # the kernel's largest READ (max_pages 256): blocks line up with requests
WINDOW = 8 * BLOCK
INFLIGHT = 4
THREADS = 2  # this machine has 2 cores; more threads only contend for the GIL


class Pool:
    """A few daemon threads shared by every prefetcher of a mount; ``close`` joins them."""

    def __init__(self, threads: int = THREADS) -> None:
        self.closed = False
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"ksfs-prefetch-{i}",
                                          daemon=True) for i in range(threads)]
        self._started = False  # started at the first job: a mount nobody reads starts none

    def submit(self, job: Callable[[], None]) -> None:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a job handles its own errors; this is a bug, keep the thread
                log.exception("prefetch job failed")

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the threads after the job each is on; False if one did not stop in time."""
        self.closed = True
        if not self._started:
            return True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)
        return not self.alive()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)


class Ahead:
    """A block that holds a whole READ: wait for ``future``, then ``slice`` its result. A result
    of None means the block is not available: read it the ordinary way."""

    def __init__(self, future: Future, block: int, off: int, end: int) -> None:
        self.future = future
        self._lo = off - block
        self._hi = end - block

    def slice(self, data: bytes) -> bytes:
        return data if (self._lo, self._hi) == (0, len(data)) else data[self._lo : self._hi]


class Prefetcher:
    """The read-ahead stream of one open file; see the module docstring."""

    def __init__(self, reader: Any, pool: Pool, block: int = BLOCK, window: int = WINDOW,
                 inflight: int = INFLIGHT) -> None:
        self.reader = reader
        self.size = reader.size
        self.pool = pool
        self.block = block
        self.window = window
        self.inflight = inflight
        self.decoded = 0  # blocks decoded ahead (tests)
        self._lock = threading.Lock()
        self._seen = 0  # end of the furthest READ
        self._runs = 0  # consecutive sequential READs
        self._next: int | None = None  # the next block to queue; None: not streaming
        self._blocks: dict[int, Future] = {}
        self._claimed: set[Future] = set()  # blocks a READ waits on, in _blocks or not
        self._closed = False

    def on_read(self, off: int, size: int) -> Ahead | None:
        """Note a READ: start, move or end the stream; return the block holding it, if queued."""
        end = min(off + size, self.size)
        with self._lock:
            if self._closed or off >= end:
                return None
            # Readahead sends requests a few at a time, not always in order: "sequential" is
            # near the furthest READ so far, not exactly after the last one.
            if self._seen - self.window <= off <= self._seen + self.block:
                self._runs += 1
                self._seen = max(self._seen, end)
            else:
                self._runs = 0
                self._next = None
                self._blocks.clear()  # their jobs still run; their bytes are dropped
                self._seen = end  # a new stream may start here, behind the old one too
            block = off - off % self.block
            ahead = None
            fut = self._blocks.get(block)
            if fut is not None and end <= block + self.block:
                ahead = Ahead(fut, block, off, end)
                if not fut.done():
                    self._claimed.add(fut)
                if end == min(block + self.block, self.size):
                    del self._blocks[block]  # its last READ: the slot frees up
            elif fut is not None:
                # A READ running past this block's end: its tail was the block's last use.
                del self._blocks[block]
            # Blocks behind the reader will not be asked for again: free their slots.
            for b in [b for b in self._blocks if b + self.block <= off - self.window]:
                del self._blocks[b]
            if self._runs >= 2:
                after = -(-end // self.block) * self.block  # never a block the kernel asked for
                self._next = after if self._next is None else max(self._next, after)
                self._fill()
            return ahead

    def _fill(self) -> None:
        """Queue blocks up to the window and the slot count (lock held)."""
        limit = min(self.size, self._seen + self.window)
        while self._next is not None and self._next < limit and len(self._blocks) < self.inflight:
            off = self._next
            fut: Future = Future()
            self._blocks[off] = fut
            self._next += self.block
            self.pool.submit(lambda off=off, fut=fut: self._job(off, fut))

    def _job(self, off: int, fut: Future) -> None:
        data = None
        with self._lock:
            wanted = not self._closed and (self._blocks.get(off) is fut or fut in self._claimed)
        if wanted and not self.pool.closed:
            try:
                data = self.reader.read(off, self.block)
                self.decoded += 1
            except Exception as exc:  # the READ of this block meets it again and answers EIO
                log.debug("read-ahead at %d stopped: %s", off, exc)
        with self._lock:
            self._claimed.discard(fut)
        fut.set_result(data)  # always resolved: a READ may be waiting on it
        if data is None:
            with self._lock:
                if self._blocks.get(off) is fut:
                    del self._blocks[off]
                    self._next = None
                    self._runs = 0

    def close(self) -> None:
        """The file was released: queue nothing more and drop what was decoded."""
        with self._lock:
            self._closed = True
            self._next = None
            self._blocks.clear()
            self._claimed.clear()
