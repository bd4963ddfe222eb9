"""Files made afresh on every look: a rewritten file (usage, status) reads as one consistent copy
per open, while the append-only events log may be followed past its end."""

from __future__ import annotations

from ksfs.fuse.nodes import DynamicFile
from ksfs.fuse.tree import DynamicHandle


def reader_of(node: DynamicFile) -> bytes:
    h = DynamicHandle(node)
    out, off = b"", 0
    while True:
        part = h.read(off, 7)
        if not part:
            return out
        out += part
        off += len(part)


def test_rewritten_file_reads_as_one_copy_even_when_it_grows_meanwhile() -> None:
    versions = iter([b'{"paid": 1}\n', b'{"paid": 1, "replays": 1}\n'] + [b"x" * 100] * 10)
    node = DynamicFile(None, ("usage", "l"), "s", "usage", lambda: next(versions))
    assert reader_of(node) == b'{"paid": 1}\n'


def test_append_only_log_is_followed_past_its_end() -> None:
    versions = iter([b"a\n", b"a\nb\n", b"a\nb\n"])
    node = DynamicFile(None, ("events", "l"), "s", "events", lambda: next(versions),
                       append_only=True)
    assert reader_of(node) == b"a\nb\n"
