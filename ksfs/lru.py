"""A small thread-safe least-recently-used cache, bounded by a count or by a weight (bytes).

Used where a long-running process keeps what it read (a reader's chunks, a guest
filesystem's inodes, the mount's record files) so that it keeps a bounded amount of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class LRU:
    """``capacity`` entries, or with ``weight`` (e.g. ``len``) that much weight in all; the
    least recently used go first, though the newest entry is always kept."""

    def __init__(self, capacity: int, weight: Callable[[Any], int] | None = None) -> None:
        self.capacity = capacity
        self._weight = weight or (lambda _value: 1)
        self.held = 0
        self._d: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self._lock:
            value = self._d.get(key)
            if value is not None:
                self._d.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.held -= self._weight(old)
            self._d[key] = value
            self.held += self._weight(value)
            while self.held > self.capacity and len(self._d) > 1:
                _, dropped = self._d.popitem(last=False)
                self.held -= self._weight(dropped)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.held = 0
