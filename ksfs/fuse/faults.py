"""Failing readers beside the real one, for fault injection in tests (as borg keeps its failing
backends). Nothing here runs unless ``KSFS_FUSE_FAULT`` is set in the mount process's environment.

``KSFS_FUSE_FAULT=read:NAME`` makes every read of a checkpoint file called NAME raise a plain
``RuntimeError`` (a bug, not a ksfs error), to prove the mount answers EIO and stays up.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENV = "KSFS_FUSE_FAULT"


class CrashingReader:
    """A reader whose reads fail the way a bug would."""

    def __init__(self, real: Any) -> None:
        self.size = real.size

    def read(self, offset: int, n: int) -> bytes:
        raise RuntimeError(f"injected crash reading {n} bytes at {offset} ({ENV})")


def reader_from_env() -> Callable[[Any], Any] | None:
    """The ``open_reader`` for CheckpointTree that the environment asks for, or None."""
    spec = os.environ.get(ENV, "")
    kind, _, name = spec.partition(":")
    if kind != "read" or not name:
        return None

    def open_reader(node: Any) -> Any:
        real = node.open_reader()
        return CrashingReader(real) if node.name == name else real

    return open_reader
