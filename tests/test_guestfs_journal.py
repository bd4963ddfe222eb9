"""A disk copied while the guest has it mounted: what the guest made durable may live only in the
jbd2 journal. GuestFS replays the journal in memory and sees exactly what the kernel sees after
its own recovery (a mount of another copy), while reading around the journal would not."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_guestfs_helpers import compare_with_dir, loop_mount

from ksfs.errors import GuestFSUnreadable, NoSuchFile
from ksfs.guestfs import FileImageReader, GuestFS, read_transcript
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
        if variant == "4k":  # a damaged journal copy is refused, never replayed as metadata
            target, copy = next(iter(sorted(vol.overlay.items())))
            bad = tmp_path / "bad-journal.img"
            shutil.copyfile(live, bad)
            with open(bad, "r+b") as f:
                f.seek(copy.block * vol.bs + 100)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 1]))
            with FileImageReader(bad) as bad_reader, pytest.raises(GuestFSUnreadable,
                                                                  match="checksum"):
                GuestFS.open(bad_reader).volume.read_blocks(target, 1, "replayed")
