"""diff_trees walks trees of any depth and survives a damaged one: a valid tree a thousand
directories deep (past Python's recursion limit) is compared like any other, and a directory
linked into itself (a loop only damage makes) is one change while the rest is still compared."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ksfs.guestfs import Change, FileImageReader, GuestFS, diff_trees
from ksfs.guestfs.mkimage import build_ext4, have_tools

pytestmark = pytest.mark.skipif(not have_tools("mkfs.ext4", "debugfs"),
                                reason="needs e2fsprogs")

DEPTH = 1000


def diff_images(a_img: Path, b_img: Path) -> list[Change]:
    with FileImageReader(a_img) as ra, FileImageReader(b_img) as rb:
        return diff_trees(GuestFS.open(ra), GuestFS.open(rb), attrs=True)


def deep_tree(root: Path, bottom: bytes) -> str:
    """``a/a/.../a/bottom`` DEPTH directories deep; returns the bottom file's path."""
    rel = "/".join(["a"] * DEPTH)
    root.mkdir()
    for depth in range(1, DEPTH + 1):  # one by one: makedirs recurses once per level too
        (root / "/".join(["a"] * depth)).mkdir()
    (root / rel / "bottom").write_bytes(bottom)
    (root / "beside.txt").write_text("next to the deep tree\n")
    return f"{rel}/bottom"


def remove_deep_tree(root: Path) -> None:
    """Deepest first, one by one: shutil.rmtree (and pytest's clean-up with it) recurses."""
    for depth in range(DEPTH, 0, -1):
        level = root / "/".join(["a"] * depth)
        for entry in level.iterdir():
            if not entry.is_dir():
                entry.unlink()
        level.rmdir()


def test_a_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    assert DEPTH >= sys.getrecursionlimit()  # what made the recursive walk fail
    for side, bottom in (("A", b"old bottom\n"), ("B", b"new bottom, longer\n")):
        try:
            bottom_path = deep_tree(tmp_path / side, bottom)
            build_ext4(tmp_path / side, tmp_path / f"{side}.img", 16, ["-b", "1024"],
                       index_dirs=False)
        finally:
            remove_deep_tree(tmp_path / side)
    changes = diff_images(tmp_path / "A.img", tmp_path / "B.img")
    assert changes == [Change("changed", bottom_path, "file", "file", 11, 19)]


@pytest.fixture(scope="module")
def looped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A (clean) and B, the same tree with ``deep/d00/loop`` linked to ``deep`` itself and a
    file changed after it in diff's order."""
    base = tmp_path_factory.mktemp("guestfs-loop")
    src = base / "src"
    for i in range(3):
        (src / "deep" / f"d{i:02d}").mkdir(parents=True)
        (src / "deep" / f"d{i:02d}" / "f").write_text(f"file {i}\n")
    (src / "zz-after.txt").write_text("compared after the loop\n")
    a_img, b_img = base / "A.img", base / "B.img"
    build_ext4(src, a_img, 8, index_dirs=False)
    (src / "zz-after.txt").write_text("changed, after the loop\n")
    build_ext4(src, b_img, 8, index_dirs=False)
    subprocess.run(["debugfs", "-w", "-R", "link deep deep/d00/loop", str(b_img)],
                   check=True, capture_output=True)
    return a_img, b_img


def test_a_directory_loop_is_one_change(looped: tuple[Path, Path],
                                        caplog: pytest.LogCaptureFixture) -> None:
    a_img, b_img = looped
    # In B only: a new name there, and nothing to descend into on one side.
    assert [(c.kind, c.path) for c in diff_images(a_img, b_img)] == [
        ("added", "deep/d00/loop"), ("changed", "zz-after.txt")]
    # On both sides alike: the loop is damage, one change with its warning, and the rest of
    # the tree is still compared.
    with caplog.at_level("WARNING"):
        changes = diff_images(b_img, b_img)
    assert changes == [Change("changed", "deep/d00/loop", "dir", "dir", None, None)]
    assert "directory loop" in caplog.text
    only_b = shutil.copyfile(b_img, b_img.with_name("B2.img"))
    subprocess.run(["debugfs", "-w", "-R", "link deep deep/d02/loop2", str(only_b)],
                   check=True, capture_output=True)
    assert [(c.kind, c.path) for c in diff_images(b_img, only_b)] == [
        ("changed", "deep/d00/loop"), ("added", "deep/d02/loop2")]
