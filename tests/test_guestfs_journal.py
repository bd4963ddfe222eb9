"""A disk copied while the guest has it mounted: what the guest made durable may live only in the
jbd2 journal. GuestFS replays the journal in memory and sees exactly what the kernel sees after
its own recovery (a mount of another copy), while reading around the journal would not."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from test_guestfs_helpers import compare_with_dir, loop_mount

from ksfs.errors import GuestFSUnreadable, NoSuchFile
from ksfs.guestfs import FileImageReader, GuestFS, read_transcript
from ksfs.guestfs.journal import COMMIT, DESCRIPTOR, JBD2_MAGIC, _journal_map
from ksfs.guestfs.mkimage import build_ext4
from ksfs.guestfs.volume import Volume

VARIANTS = {
    "4k": ["-b", "4096", "-T", "default"],
    "4k-32bit": ["-b", "4096", "-T", "default", "-O", "^64bit"],
    "ext3-no-csum": ["-b", "4096", "-T", "default", "-t", "ext3"],
    # 1 KiB blocks and the smallest journal: the log wraps and carries revoke records
    "1k-small-journal": ["-b", "1024", "-J", "size=1"],
}


def guest_work(root: Path, steps: int) -> None:
    """Agent-like work, each step made durable with fsync as the test guest does."""
    t = os.open(root / "transcript.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for i in range(steps):
            d = root / f"d{i % 7}"
            d.mkdir(exist_ok=True)
            (d / f"f{i}").write_bytes(os.urandom(100 + 37 * i))
            if i % 3 == 2:
                (root / f"d{(i - 2) % 7}" / f"f{i - 2}").unlink(missing_ok=True)
            if i % 50 == 49:
                shutil.rmtree(root / f"d{(i // 50) % 7}")
            os.write(t, json.dumps({"seq": i + 1, "lineage": "Lj"}).encode() + b"\n")
            os.fsync(t)
    finally:
        os.close(t)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_live_copy_reads_as_the_kernel_recovers_it(tmp_path: Path, variant: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "before.txt").write_text("made by mkfs\n")
    img = tmp_path / "disk.img"
    build_ext4(src, img, 48, VARIANTS[variant], index_dirs=False)
    steps = 400 if variant.startswith("1k") else 60
    live = tmp_path / "live.img"
    with loop_mount(img, "rw,commit=600") as mnt:
        if mnt is None:
            pytest.skip("this machine cannot set up loop devices")
        guest_work(mnt, steps)  # fsync only, as the guest does: no sync() writing all back
        shutil.copyfile(img, live)  # as a snapshot of a running guest's disk would be
    kernel_copy = tmp_path / "kernel.img"
    shutil.copyfile(live, kernel_copy)
    with FileImageReader(live) as reader:
        fs = GuestFS.open(reader)
        assert fs.volume.overlay, "the copy must need journal recovery for this test to mean much"
        info = read_transcript(fs, "transcript.jsonl")
        assert (info.last_seq, info.lineage, info.count) == (steps, "Lj", steps)
        # the kernel replays into its own copy (a read-only loop device could not be replayed)
        with loop_mount(kernel_copy, "rw,noatime") as recovered:
            assert recovered is not None
            assert compare_with_dir(fs, recovered, exact=True) > 10

        # Without the replay the same image gives other metadata: blocks whose newest copy
        # is in the journal differ from what sits in their place.
        # (With the small journal the kernel had to write most back already.)
        vol = fs.volume
        stale = Volume(reader, 0, reader.size, vol.sb)
        assert variant.startswith("1k") or any(
            stale.read_blocks(b, 1, "in place") != vol.read_blocks(b, 1, "replayed")
            for b in vol.overlay)
        if not variant.startswith("1k"):  # none written back yet: the stale tree is older
            try:
                stale_info = read_transcript(GuestFS(stale, "whole disk"), "transcript.jsonl")
            except (GuestFSUnreadable, NoSuchFile):
                stale_info = None
            assert stale_info != info


# --- journals the kernel refuses to recover, and one it still accepts ------------------------

STEPS = 60


@pytest.fixture(scope="module")
def live_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of a mounted 4 KiB-block ext4 (journal checksums v3) after STEPS fsync'ed steps,
    its journal needing recovery."""
    base = tmp_path_factory.mktemp("guestfs-journal-damage")
    (base / "src").mkdir()
    img, live = base / "disk.img", base / "live.img"
    build_ext4(base / "src", img, 48, VARIANTS["4k"], index_dirs=False)
    with loop_mount(img, "rw,commit=600") as mnt:
        if mnt is None:
            pytest.skip("this machine cannot set up loop devices")
        guest_work(mnt, STEPS)
        shutil.copyfile(img, live)
    return live


def flipped(image: Path, out: Path, offset: int) -> Path:
    """A copy of ``image`` with one bit of the byte at ``offset`` flipped."""
    shutil.copyfile(image, out)
    with open(out, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
    return out


def last_commit_block(image: Path, kind: int = COMMIT) -> tuple[int, int]:
    """(sequence, byte offset) of the newest commit block (or block of ``kind``) in the
    image's journal."""
    with FileImageReader(image) as reader:
        vol = GuestFS.open(reader).volume
        inode = vol.inode(vol.sb.journal_inum)
        found = []
        for phys in _journal_map(vol, inode, inode.size // vol.bs):
            head = reader.read(phys * vol.bs, 12)
            magic, btype, seq = struct.unpack(">III", head)
            if magic == JBD2_MAGIC and btype == kind:
                found.append((seq, phys * vol.bs))
        return max(found)


def kernel_refuses(image: Path, tmp_path: Path) -> bool:
    """Whether the kernel refuses to mount (recover) a copy of ``image``."""
    copy = shutil.copyfile(image, tmp_path / "kernel-try.img")
    try:
        with loop_mount(copy, "rw,noatime") as mnt:
            return mnt is None
    except AssertionError as exc:  # loop_mount's "mount failed: ..."
        assert "mount failed" in str(exc)
        return True


def test_a_replayed_block_that_fails_its_checksum_refuses_the_journal(
        live_copy: Path, tmp_path: Path) -> None:
    # QA: the copy was refused only when read, so the tree lost entries silently (and
    # ksfs diff called them removed). The kernel refuses the whole recovery.
    with FileImageReader(live_copy) as reader:
        vol = GuestFS.open(reader).volume
        target, copy = min(vol.overlay.items())
    bad = flipped(live_copy, tmp_path / "bad-copy.img", copy.block * vol.bs + 100)
    with FileImageReader(bad) as reader:
        fs, why = GuestFS.open_or_reason(reader)
    assert fs is None
    assert "the journal cannot be recovered" in why and f"block {target}" in why
    assert "transaction" in why and "fails its checksum" in why
    assert kernel_refuses(bad, tmp_path)


def test_a_commit_block_that_fails_its_checksum_refuses_the_journal(
        live_copy: Path, tmp_path: Path) -> None:
    # QA: it was taken as the end of the log, silently showing the tree before it; the
    # kernel (6.18) says "journal transaction N is corrupt" and refuses the mount.
    seq, at = last_commit_block(live_copy)
    bad = flipped(live_copy, tmp_path / "bad-commit.img", at + 0x38)  # in its header
    with FileImageReader(bad) as reader:
        fs, why = GuestFS.open_or_reason(reader)
    assert fs is None
    assert f"transaction {seq} is corrupt: its commit block" in why
    assert kernel_refuses(bad, tmp_path)


def test_a_commit_block_damaged_past_its_header_still_commits(
        live_copy: Path, tmp_path: Path) -> None:
    # The kernel checks a commit block's checksum over its header alone too (its padding may
    # not all have been written): it replays this transaction, and so does GuestFS.
    _, at = last_commit_block(live_copy)
    partial = flipped(live_copy, tmp_path / "partial.img", at + 200)
    kernel_copy = shutil.copyfile(partial, tmp_path / "partial-kernel.img")
    with FileImageReader(partial) as reader:
        fs = GuestFS.open(reader)
        assert read_transcript(fs, "transcript.jsonl").count == STEPS
        with loop_mount(kernel_copy, "rw,noatime") as recovered:
            assert compare_with_dir(fs, recovered, exact=True) > 10


def test_a_descriptor_block_that_fails_its_checksum_refuses_the_journal(
        live_copy: Path, tmp_path: Path) -> None:
    # Its tags say where each copy goes: unchecked, a damaged one would write a copy over
    # the wrong block. The kernel refuses the recovery ("Invalid checksum found").
    seq, at = last_commit_block(live_copy, DESCRIPTOR)
    with FileImageReader(live_copy) as reader:
        bs = GuestFS.open(reader).volume.bs
    bad = flipped(live_copy, tmp_path / "bad-descriptor.img", at + bs - 1)  # its checksum
    with FileImageReader(bad) as reader:
        fs, why = GuestFS.open_or_reason(reader)
    assert fs is None
    assert f"transaction {seq} is corrupt: its descriptor block" in why
    assert kernel_refuses(bad, tmp_path)


def test_a_stale_commit_block_of_an_older_log_ends_the_replay(
        live_copy: Path, tmp_path: Path) -> None:
    # A block left from an older use of the log can carry the next expected sequence number;
    # it fails its checksum, and its commit time is older than the previous commit's. The
    # kernel then ends the recovery there ("Invalid checksum ignored ..., likely stale
    # data") and mounts: the transactions before it are replayed, it and what follows not.
    seq, at = last_commit_block(live_copy)
    with FileImageReader(live_copy) as reader:
        vol = GuestFS.open(reader).volume
        inode = vol.inode(vol.sb.journal_inum)
        times = {}
        for phys in _journal_map(vol, inode, inode.size // vol.bs):
            magic, btype, s = struct.unpack(">III", reader.read(phys * vol.bs, 12))
            if magic == JBD2_MAGIC and btype == COMMIT:
                times[s] = struct.unpack(">Q", reader.read(phys * vol.bs + 0x30, 8))[0]
    assert seq - 1 in times and times[seq - 1] > 0
    stale = tmp_path / "stale.img"
    shutil.copyfile(live_copy, stale)
    with open(stale, "r+b") as f:  # h_commit_sec older than the previous commit's
        f.seek(at + 0x30)
        f.write(struct.pack(">Q", times[seq - 1] - 1))
    kernel_copy = shutil.copyfile(stale, tmp_path / "stale-kernel.img")
    with FileImageReader(stale) as reader:
        fs = GuestFS.open(reader)
        count = read_transcript(fs, "transcript.jsonl").count
        assert 0 < count < STEPS  # the last step's transaction is not replayed
        with loop_mount(kernel_copy, "rw,noatime") as recovered:
            assert compare_with_dir(fs, recovered, exact=True) > 10
    # the same block with a commit time not older is this log's, damaged: refused
    newer = shutil.copyfile(live_copy, tmp_path / "newer.img")
    with open(newer, "r+b") as f:
        f.seek(at + 0x30)
        f.write(struct.pack(">Q", times[seq - 1] + 1000))
    with FileImageReader(newer) as reader:
        fs, why = GuestFS.open_or_reason(reader)
    assert fs is None and f"transaction {seq} is corrupt" in why
