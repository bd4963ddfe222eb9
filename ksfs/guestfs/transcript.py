"""The guest's transcript read out of its filesystem: JSON lines with a "seq" (and an optional
"lineage"), appended by the agent inside the machine.

Only whole lines count: a last line the guest was still writing (no newline, and not a complete
JSON object) is ignored, as are NUL bytes a crash can leave at the end
(or before a line the agent appended after it). A damaged line anywhere
before the last is an error, never skipped. The file is streamed in pieces, never read whole.
"""

from __future__ import annotations

import json

from ksfs.errors import GuestFSUnreadable, NoSuchFile
from ksfs.guestfs.fs import GuestFS
from ksfs.guestfs.image import Reader
from ksfs.model import DEFAULT_TRANSCRIPT, TranscriptInfo

PIECE = 1 << 20


def read_transcript(fs: GuestFS | Reader, path: str = DEFAULT_TRANSCRIPT) -> TranscriptInfo:
    """The last seq, its lineage and the number of whole lines of the transcript at ``path``.

    ``fs`` is an open GuestFS or a disk reader (opened here; of several ext partitions, the
    one that holds ``path``). NoSuchFile when the file is not
    there; GuestFSUnreadable when the filesystem or a line of the file cannot be read.
    """
    if not isinstance(fs, GuestFS):
        fs = GuestFS.open(fs, holding=path)
    ino = fs.resolve(path)
    info = fs.stat_ino(ino)
    if not info.is_file:
        raise NoSuchFile(what="guest transcript (not a regular file)", name=path)
    last: dict | None = None
    count = 0
    lineno = 0
    rest = b""
    offset = 0
    while offset < info.size:
        piece = fs.read_ino(ino, offset, PIECE)
        if not piece:
            break
        offset += len(piece)
        lines = (rest + piece).split(b"\n")
        rest = lines.pop()
        for line in lines:
            lineno += 1
            entry = _parse(line, lineno, path)
            if entry is not None:
                last, count = entry, count + 1
    tail = rest.rstrip(b"\0")
    if tail.strip():
        # Unterminated: a whole JSON object counts (only its newline is missing); else torn.
        try:
            entry = _parse(tail, lineno + 1, path)
        except GuestFSUnreadable:
            entry = None
        if entry is not None:
            last, count = entry, count + 1
    if last is None:
        return TranscriptInfo(last_seq=None, lineage=None, count=0)
    lineage = last.get("lineage")
    return TranscriptInfo(
        last_seq=last["seq"], lineage=lineage if isinstance(lineage, str) else None, count=count
    )


def _parse(line: bytes, lineno: int, path: str) -> dict | None:
    # NUL runs are what a crash leaves where the guest's filesystem had allocated blocks whose
    # data never reached the disk; the agent goes on appending after them on the next boot.
    line = line.strip(b"\0")
    if b"\0" in line:  # a line torn by the crash, its rest zeros, then the next boot's line
        line = line.rsplit(b"\0", 1)[1]
    if not line.strip():
        return None
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):  # a line nested deeper than json can read is damaged
        raise GuestFSUnreadable(why=f"transcript {path} line {lineno} is not JSON") from None
    if not isinstance(entry, dict) or type(entry.get("seq")) is not int:
        raise GuestFSUnreadable(why=f"transcript {path} line {lineno} has no integer seq")
    return entry
