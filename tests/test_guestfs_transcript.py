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
