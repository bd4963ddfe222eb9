"""The guest transcript read out of a real image: last seq and lineage of the last whole line,
a torn last line ignored, big transcripts streamed, and missing or damaged files refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ksfs.errors import GuestFSUnreadable, NoSuchFile
from ksfs.guestfs import FileImageReader, GuestFS, TranscriptInfo, read_transcript
from ksfs.guestfs.mkimage import build_ext4


def image_with(tmp_path: Path, content: bytes | None, name: str = "transcript.jsonl",
               options: tuple[str, ...] = ()) -> Path:
    src = tmp_path / "src"
    (src / "agent").mkdir(parents=True)
    if content is not None:
        (src / "agent" / name).write_bytes(content)
    img = tmp_path / "disk.img"
    build_ext4(src, img, 16, options, index_dirs=False)
    return img


def lines(first: int, last: int, lineage: str = "L1") -> bytes:
    return b"".join(
        json.dumps({"seq": s, "lineage": lineage, "op": "step", "pad": "x" * (s % 50)}).encode()
        + b"\n" for s in range(first, last + 1))


def info_of(img: Path, path: str = "agent/transcript.jsonl") -> TranscriptInfo:
    with FileImageReader(img) as reader:
        return read_transcript(GuestFS.open(reader), path)


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    img = image_with(tmp_path, lines(1, 41) + b'{"seq": 42, "lineage": "L1", "op": "st')
    assert info_of(img) == TranscriptInfo(last_seq=41, lineage="L1", count=41)


def test_unterminated_whole_last_line_counts(tmp_path: Path) -> None:
    img = image_with(tmp_path, lines(1, 9) + b'{"seq": 10, "lineage": "L2"}')
    assert info_of(img) == TranscriptInfo(last_seq=10, lineage="L2", count=10)


def test_nul_tail_left_by_a_crash_is_ignored(tmp_path: Path) -> None:
    img = image_with(tmp_path, lines(5, 7) + b"\0" * 3000)
    assert info_of(img) == TranscriptInfo(last_seq=7, lineage="L1", count=3)


def test_big_transcript_across_read_pieces(tmp_path: Path) -> None:
    content = lines(1, 30000)
    assert len(content) > 2 << 20
    img = image_with(tmp_path, content)
    with FileImageReader(img) as reader:  # a reader works as well as an open GuestFS
        assert read_transcript(reader) == TranscriptInfo(30000, "L1", 30000)


def test_inline_transcript_and_no_lineage(tmp_path: Path) -> None:
    img = image_with(tmp_path, b'{"seq": 3}\n', options=("-O", "inline_data"))
    assert info_of(img) == TranscriptInfo(last_seq=3, lineage=None, count=1)


def test_empty_transcript(tmp_path: Path) -> None:
    assert info_of(image_with(tmp_path, b"")) == TranscriptInfo(None, None, 0)


def test_missing_transcript(tmp_path: Path) -> None:
    img = image_with(tmp_path, None)
    with pytest.raises(NoSuchFile):
        info_of(img)
    with pytest.raises(NoSuchFile):
        info_of(img, "agent")  # a directory is not a transcript


def test_damaged_middle_line_is_refused(tmp_path: Path) -> None:
    img = image_with(tmp_path, lines(1, 3) + b"garbage\n" + lines(4, 5))
    with pytest.raises(GuestFSUnreadable, match="line 4 is not JSON"):
        info_of(img)


def test_a_line_nested_too_deep_for_json_is_damaged_not_a_crash(tmp_path: Path) -> None:
    deep = b'{"seq": 4, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    img = image_with(tmp_path, lines(1, 3) + deep + lines(5, 6))
    with pytest.raises(GuestFSUnreadable, match="line 4 is not JSON"):
        info_of(img)


def test_lines_appended_after_a_crash_s_nul_run_count(tmp_path: Path) -> None:
    """After a crash the file can hold zeros where its last blocks were allocated; the agent
    appends its next lines after them on the next boot."""
    img = image_with(tmp_path, lines(1, 3) + b"\0" * 5000 + lines(4, 6))
    assert info_of(img) == TranscriptInfo(last_seq=6, lineage="L1", count=6)


def test_a_line_torn_by_a_crash_then_appended_to_counts_the_new_line(tmp_path: Path) -> None:
    """Review: the torn line's rest is zeros and the next boot appends after them on the same
    line; the whole transcript was refused as damaged."""
    torn = b'{"seq": 4, "lineage": "L1", "op": "st' + b"\0" * 4000
    img = image_with(tmp_path, lines(1, 3) + torn + lines(5, 6))
    assert info_of(img) == TranscriptInfo(last_seq=6, lineage="L1", count=5)


def _reference(data: bytes, path: str = "t") -> TranscriptInfo | str:
    """What the transcript reader made of ``data`` before it was made linear (the whole file
    split at once): the answer, or the error's message."""
    from ksfs.guestfs.transcript import _parse

    try:
        *whole, rest = data.split(b"\n")
        last, count = None, 0
        for n, line in enumerate(whole, 1):
            entry = _parse(line, n, path)
            if entry is not None:
                last, count = entry, count + 1
        tail = rest.rstrip(b"\0")
        if tail.strip():
            try:
                entry = _parse(tail, len(whole) + 1, path)
            except GuestFSUnreadable:
                entry = None
            if entry is not None:
                last, count = entry, count + 1
    except GuestFSUnreadable as exc:
        return str(exc)
    if last is None:
        return TranscriptInfo(None, None, 0)
    lineage = last.get("lineage")
    return TranscriptInfo(last["seq"], lineage if isinstance(lineage, str) else None, count)


def _linear(data: bytes, cuts: list[int], path: str = "t") -> TranscriptInfo | str:
    from ksfs.guestfs.transcript import _Lines

    lines = _Lines(path)
    try:
        at = 0
        for cut in [*sorted(cuts), len(data)]:
            lines.feed(data[at:cut])
            at = cut
        return lines.finish()
    except GuestFSUnreadable as exc:
        return str(exc)


def test_the_linear_reader_reads_as_the_whole_file_split_at_once() -> None:
    """Lines cut across pieces anywhere, NUL runs before, inside and after lines, torn and
    damaged lines, whitespace: the pieces read one by one give what splitting the whole file
    gave (random cases, fixed seed)."""
    import random

    rnd = random.Random(2026)
    atoms = [b'{"seq": 1, "lineage": "A"}', b'{"seq": 22}', b'{"seq": 3, "lineage": 4}',
             b"\0", b"\0\0\0", b"\n", b"\n", b"  ", b'{"seq": ', b"x", b"[1]", b"\r"]
    for _ in range(3000):
        data = b"".join(rnd.choice(atoms) for _ in range(rnd.randint(0, 14)))
        cuts = [rnd.randint(0, len(data)) for _ in range(rnd.randint(0, 6))]
        assert _linear(data, cuts) == _reference(data), (data, cuts)


def test_long_lines_and_long_nul_runs_are_read_in_linear_time(tmp_path: Path) -> None:
    """QA: one 128 MB line took 9.6 s (each 1 MiB piece re-split the whole unfinished line),
    a 128 MB NUL tail 15.7 s. A line past LINE_MAX is damage when whole, torn when last; a
    NUL tail of any length is ignored."""
    import time

    from ksfs.guestfs.transcript import LINE_MAX, PIECE

    good = b'{"seq": 5, "lineage": "L"}\n'
    t = time.perf_counter()
    pieces = [good] + [b"\0" * PIECE] * 48 + [b"x" * PIECE] * 24 + [b"\0" * PIECE] * 4
    assert _linear(b"".join(pieces), list(range(len(good), 77 * PIECE, PIECE))) == \
        TranscriptInfo(5, "L", 1)
    long_last = good + b"y" * (LINE_MAX + 10)
    assert _linear(long_last, list(range(0, len(long_last), PIECE))) == TranscriptInfo(5, "L", 1)
    long_whole = long_last + b"\n" + good
    got = _linear(long_whole, list(range(0, len(long_whole), PIECE)))
    assert got == f"guest filesystem cannot be read: transcript t line 2 is longer than " \
                  f"{LINE_MAX >> 20} MiB", got
    # a long line under the limit still counts, NULs before it dropped
    big = b"\0" * (3 * PIECE) + b'{"seq": 9, "pad": "' + b"z" * (3 * PIECE) + b'"}\n'
    assert _linear(big, list(range(0, len(big), PIECE // 3))) == TranscriptInfo(9, None, 1)
    assert time.perf_counter() - t < 10  # (the old reader: minutes for these)


def test_a_long_unfinished_line_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """QA: a 128 MB line took 9.6 s and 0.42 GB to read (the unfinished line was joined to
    each 1 MiB piece and split again). Now the memory a read takes stays under the line cap
    whatever the line's length: here a 96 MiB torn last line, read from a real image."""
    import subprocess
    import sys

    src = tmp_path / "src" / "agent"
    src.mkdir(parents=True)
    with open(src / "transcript.jsonl", "wb") as f:
        f.write(lines(1, 5))
        for _ in range(96):
            f.write(b"x" * (1 << 20))
    img = tmp_path / "disk.img"
    build_ext4(src.parent, img, 140, (), index_dirs=False)
    (src / "transcript.jsonl").unlink()
    code = (
        "import resource, sys, time\n"
        "from ksfs.guestfs import FileImageReader, GuestFS, read_transcript\n"
        "with FileImageReader(sys.argv[1]) as r:\n"
        "    fs = GuestFS.open(r)\n"
        "    fs.read('agent/transcript.jsonl', 0, 1 << 20)\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "    t = time.perf_counter()\n"
        "    info = read_transcript(fs, 'agent/transcript.jsonl')\n"
        "    took = time.perf_counter() - t\n"
        "    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(info.last_seq, info.count, grew >> 10, round(took, 2))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(img)], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[:2] == ["5", "5"], out
    assert int(out[2]) < 48, f"reading grew the process by {out[2]} MiB (took {out[3]} s)"
