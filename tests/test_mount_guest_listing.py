"""A big guest directory under `fs/`, listed through the mount (QA, twentieth session): a profile
of `ls -f` of 150,000 entries spent a third of the mount's own time on each entry's bookkeeping
(its path from the root, a lock per entry, a frozen dataclass per attribute set). A guest file
now keeps its parent's inode and its name, not a path; its path is made when something asks
(an event, a log line), and comes out as before."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from ksfs.guestfs.mkimage import build_ext4, have_tools
from ksfs.keeper import Keeper
from tests.mount_helpers import mounted

pytestmark = pytest.mark.skipif(not have_tools("mkfs.ext4", "e2fsck"),
                                reason="needs mkfs.ext4 and e2fsck")

N = 600


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("guestlisting")
    tree = base / "tree"
    (tree / "big" / "sub").mkdir(parents=True)
    for i in range(N):
        (tree / "big" / f"file-{i:04d}.txt").write_text(f"{i}\n")
    (tree / "big" / "sub" / "deep.txt").write_text("deep\n")
    (base / "c1").mkdir()
    build_ext4(tree, base / "c1" / "disk.raw", 16)
    with Keeper(base / "store", create=True) as k:
        k.import_files("s", "c1", [base / "c1" / "disk.raw"])
    return base / "store"


def test_a_guest_listing_keeps_no_path_per_entry_and_paths_come_out_right(store: Path) -> None:
    from ksfs.fuse.tree import CheckpointTree

    with Keeper(store) as k:
        tree = CheckpointTree(k)
        ino = 1
        for part in ("sessions", "s", "checkpoints", "c1", "fs", "big"):
            ino = tree.lookup(ino, part, counted=True).ino
        got = tree.entries_from(ino, 0, 10_000)
        names = sorted(e.name for e, _ in got)
        assert names == sorted([f"file-{i:04d}.txt" for i in range(N)] + ["sub"])
        guest = {e.ino for e, _ in got}
        assert not guest & set(tree._paths), "a path kept for each guest entry"
        sub = next(e.ino for e, _ in got if e.name == "sub")
        deep = tree.lookup(sub, "deep.txt").ino
        assert tree.path(deep) == "sessions/s/checkpoints/c1/fs/big/sub/deep.txt"
        assert tree.lookup(sub, "..").ino == ino
        for e, _ in got:  # the kernel forgets them all: nothing of them is left
            tree.forget(e.ino, 1)
        assert not guest & (set(tree._nodes) | set(tree._parent_of))


def test_a_big_guest_directory_through_the_mount(store: Path) -> None:
    with mounted(store) as mnt:
        big = mnt / "sessions" / "s" / "checkpoints" / "c1" / "fs" / "big"
        assert len(os.listdir(big)) == N + 1
        assert (big / "sub" / "deep.txt").read_text() == "deep\n"
        assert (big / "file-0599.txt").stat().st_size == 4
        with pytest.raises(OSError) as err:
            os.unlink(big / "sub" / "deep.txt")
        assert err.value.errno == errno.EPERM
        events = [json.loads(line) for line in
                  (mnt / "sessions" / "s" / "events").read_text().splitlines()]
        refused = [e["body"] for e in events if e["type"] == "input.rejected"]
        assert refused[-1]["file"] == "checkpoints/c1/fs/big/sub/deep.txt", refused


def test_a_deleted_checkpoints_guest_files_are_gone_for_a_shell_sitting_in_them(
        store: Path) -> None:
    """QA: after a checkpoint was deleted, a shell sitting in a directory under its fs/ still
    looked up (and read) its files, and listed it as empty, where the checkpoint directory
    itself answers ENOENT. Deleted here by another process that tells no one (as a script
    with its own Keeper would), so the kernel drops nothing by itself."""
    with Keeper(store) as k:
        k.import_files("s", "c2", [store.parent / "c1" / "disk.raw"])
    with mounted(store) as mnt:
        big = mnt / "sessions" / "s" / "checkpoints" / "c2" / "fs" / "big"
        fd = os.open(big, os.O_RDONLY | os.O_DIRECTORY)
        try:
            here = f"/proc/self/fd/{fd}"
            assert len(os.listdir(here)) == N + 1
            with Keeper(store) as k:
                k.delete_checkpoint("s", "c2")
            with pytest.raises(FileNotFoundError):
                os.listdir(here)
            with pytest.raises(FileNotFoundError):
                os.stat(f"{here}/sub/deep.txt")  # (sub: listed, not looked up yet)
        finally:
            os.close(fd)
        assert (mnt / "sessions" / "s" / "checkpoints" / "c1" / "fs" / "big" / "sub"
                / "deep.txt").read_text() == "deep\n"  # the other checkpoint's are there
