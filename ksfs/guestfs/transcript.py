"""The guest's transcript read out of its filesystem: JSON lines with a "seq" (and an optional
"lineage"), appended by the agent inside the machine.

Only whole lines count: a last line the guest was still writing (no newline, and not a complete
JSON object) is ignored, as are NUL bytes a crash can leave at the end
(or before a line the agent appended after it). A damaged line anywhere
before the last is an error, never skipped, and so is a whole line longer than LINE_MAX (16 MiB).
The file is streamed in pieces, never read whole, in one pass: time linear in its size, memory
bounded by LINE_MAX whatever it holds.
"""

from __future__ import annotations

import json

from ksfs.errors import GuestFSUnreadable, NoSuchFile
from ksfs.guestfs.fs import GuestFS
from ksfs.guestfs.image import Reader
from ksfs.model import DEFAULT_TRANSCRIPT, TranscriptInfo

PIECE = 1 << 20
#: The longest transcript line read, in bytes (16 MiB): one step of an agent's record is far
#: shorter. A whole line longer than this is damage (GuestFSUnreadable, as a line that is not
#: JSON); an unterminated last line longer than this is a torn one, ignored. Its bytes are
#: never held: reading stays linear in the file and bounded in memory whatever it holds.
LINE_MAX = 16 << 20


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
    lines = _Lines(path)
    offset = 0
    while offset < info.size:
        piece = fs.read_ino(ino, offset, PIECE)
        if not piece:
            break
        offset += len(piece)
        lines.feed(piece)
    return lines.finish()


_decode = json.JSONDecoder().decode
_OVERLONG = object()  # a run of a line past LINE_MAX: its bytes were dropped


class _Lines:
    """The transcript's lines from its pieces, in one pass: each piece is split at its own
    newlines only, and of a line that spans pieces just what ``_parse`` would keep of it is
    kept (the text after its last NUL run, or before a trailing one), as a list of parts
    joined once at its end. (QA: re-splitting the unfinished line with every piece was
    quadratic: 9.6 s for one 128 MB line, 15.7 s for a 128 MB NUL tail.)"""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lineno = 0
        self.last: dict | None = None
        self.count = 0
        self.parts: list[bytes] = []  # the unfinished line's current NUL-free run
        self.size: int | None = 0  # its length; None: past LINE_MAX (parts dropped)
        self.prev: object = b""  # the line's last non-empty run before a NUL, if any

    def feed(self, piece: bytes) -> None:
        segs = piece.split(b"\n")
        self._add(segs[0])
        if len(segs) == 1:
            return
        self._end_line()
        for line in segs[1:-1]:  # whole lines within the piece, at most PIECE long
            self.lineno += 1
            self._take(_parse(line, self.lineno, self.path))
        self._add(segs[-1])

    def finish(self) -> TranscriptInfo:
        line = self._line()
        if line is not _OVERLONG and line.strip():  # type: ignore[union-attr]
            # Unterminated: a whole JSON object counts (only its newline is missing); else
            # torn, as is one too long to be read.
            try:
                self._take(_parse(line, self.lineno + 1, self.path))  # type: ignore[arg-type]
            except GuestFSUnreadable:
                pass
        if self.last is None:
            return TranscriptInfo(last_seq=None, lineage=None, count=0)
        lineage = self.last.get("lineage")
        return TranscriptInfo(last_seq=self.last["seq"],
                              lineage=lineage if isinstance(lineage, str) else None,
                              count=self.count)

    def _take(self, entry: dict | None) -> None:
        if entry is not None:
            self.last, self.count = entry, self.count + 1

    def _end_line(self) -> None:
        self.lineno += 1
        line = self._line()
        if line is _OVERLONG:
            raise GuestFSUnreadable(why=f"transcript {self.path} line {self.lineno} is longer "
                                        f"than {LINE_MAX >> 20} MiB")
        self._take(_parse(line, self.lineno, self.path))  # type: ignore[arg-type]

    def _line(self) -> object:
        """What counts of the unfinished line (its last non-empty NUL-free run); reset."""
        run = self._run()
        line = run if run is _OVERLONG or run else self.prev
        self.prev = b""
        return line

    def _run(self) -> object:
        """The current NUL-free run, joined (or _OVERLONG); reset."""
        run: object = _OVERLONG if self.size is None else b"".join(self.parts)
        self.parts, self.size = [], 0
        return run

    def _grow(self, part: bytes) -> None:
        if self.size is None or not part:
            return
        self.size += len(part)
        if self.size > LINE_MAX:
            self.parts, self.size = [], None
        else:
            self.parts.append(part)

    def _add(self, seg: bytes) -> None:
        """A part of the unfinished line (no newline in it)."""
        j = seg.rfind(b"\0")
        if j < 0:
            self._grow(seg)
            return
        head = seg[:j].rstrip(b"\0")
        k = head.rfind(b"\0")
        if k < 0:  # the current run goes on into head, and ends at the NULs after it
            self._grow(head)
            run = self._run()
        else:  # it ended inside head; of head's runs its last counts
            self._run()
            run = head[k + 1:]
        if run is _OVERLONG or run:
            self.prev = run
        self._grow(seg[j + 1:])


def _parse(line: bytes, lineno: int, path: str) -> dict | None:
    # NUL runs are what a crash leaves where the guest's filesystem had allocated blocks whose
    # data never reached the disk; the agent goes on appending after them on the next boot.
    line = line.strip(b"\0")
    if b"\0" in line:  # a line torn by the crash, its rest zeros, then the next boot's line
        line = line.rsplit(b"\0", 1)[1]
    if not line.strip():
        return None
    try:
        try:
            # UTF-8 text straight to the decoder: json.loads of bytes first guesses their
            # encoding, half of the time of a transcript of short lines
            entry = _decode(line.decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError):
            entry = json.loads(line)  # what it says (or takes: a BOM) is json.loads's
    except (ValueError, RecursionError):  # a line nested deeper than json can read is damaged
        raise GuestFSUnreadable(why=f"transcript {path} line {lineno} is not JSON") from None
    if not isinstance(entry, dict) or type(entry.get("seq")) is not int:
        raise GuestFSUnreadable(why=f"transcript {path} line {lineno} has no integer seq")
    return entry
