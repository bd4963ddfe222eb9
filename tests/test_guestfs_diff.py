"""diff_trees between two images agrees exactly with ``diff -rq --no-dereference`` between the
two source trees and between loop mounts of the two images, including a same-size, same-mtime
content change, and reports no change for mode, owner or time alone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_guestfs_helpers import NON_UTF8, diff_rq, loop_mount, make_tree, same_mtime_write

from ksfs.guestfs import Change, FileImageReader, GuestFS, diff_trees
from ksfs.guestfs.mkimage import build_ext4

OPTS = ["-b", "4096", "-T", "default"]


def modify(b: Path) -> None:
    (b / "new.txt").write_text("added\n")
    (b / "newdir" / "x").mkdir(parents=True)
    (b / "newdir" / "x" / "y").write_text("in a new dir\n")
    (b / "a" / "top.txt").unlink()
    subprocess.run(["rm", "-r", str(b / "a" / "b" / "c")], check=True)
    (b / "small.txt").write_text("hello, world\n")  # and its hard link changes with it
    same_mtime_write(b / "random.bin", 1_500_000, b"\x00\x01\x02\x03")
    same_mtime_write(b / "sparse.bin", 30 << 20, b"filled a hole")
    same_mtime_write(b / "islands.bin", 399 * 16384 + 4000, b"zz")
    same_mtime_write(b / "inline-100", 99, b"!")
    same_mtime_write(b / NON_UTF8, 0, b"N")
    os.unlink(b / "link-short")
    os.symlink("a/b", b / "link-short")
    (b / "fifty-nine").unlink()
    (b / "fifty-nine").mkdir()
    os.chmod(b / "nomode", 0o644)  # mode only: no change for diff -r
    os.chown(b / "owned", 1, 1)  # owner only: no change
    os.utime(b / "empty", (1, 1))  # time only: no change
    (b / "many" / "entry-00010-xxxxxxxxxx").unlink()
    (b / "many" / "entry-99999").write_text("one more\n")


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, Path]:
    base = tmp_path_factory.mktemp("guestfs-diff")
    a, b = base / "A", base / "B"
    make_tree(a)
    subprocess.run(["cp", "-a", str(a), str(b)], check=True)
    modify(b)
    for name, variant in (("A", a), ("B", b)):
        build_ext4(variant, base / f"{name}.img", 96, OPTS)
    return a, b, base / "A.img", base / "B.img"


def ours(a_img: Path, b_img: Path) -> list[Change]:
    with FileImageReader(a_img) as ra, FileImageReader(b_img) as rb:
        return diff_trees(GuestFS.open(ra), GuestFS.open(rb))


def test_diff_trees_equals_diff_of_sources(trees: tuple[Path, Path, Path, Path]) -> None:
    a, b, a_img, b_img = trees
    changes = ours(a_img, b_img)
    expected = diff_rq(a, b)
    assert {(c.kind, c.path) for c in changes} == expected
    assert len(changes) == len(expected) == 15
    assert [c.path.encode("utf-8", "surrogateescape") for c in changes] == sorted(
        c.path.encode("utf-8", "surrogateescape") for c in changes)
    by_path = {c.path: c for c in changes}
    assert by_path["random.bin"].size_a == by_path["random.bin"].size_b == 3 * 1024 * 1024 + 123
    assert by_path["small.txt"].size_a == 6 and by_path["small.txt"].size_b == 13
    assert by_path["fifty-nine"].type_a == "file" and by_path["fifty-nine"].type_b == "dir"
    assert by_path["newdir"].kind == "added" and by_path["newdir"].type == "dir"
    assert by_path["a/top.txt"].kind == "removed" and by_path["a/top.txt"].size_a == 90
    assert by_path["link-short"].type == "symlink"
    for c in changes:
        for side, top, size in (("a", a, c.size_a), ("b", b, c.size_b)):
            p = top / c.path
            if os.path.lexists(p) and not p.is_dir() or p.is_symlink():
                assert size == os.lstat(p).st_size, (side, c)


def test_diff_trees_equals_diff_of_loop_mounts(trees: tuple[Path, Path, Path, Path]) -> None:
    a, b, a_img, b_img = trees
    with loop_mount(a_img) as ma, loop_mount(b_img) as mb:
        if ma is None or mb is None:
            pytest.skip("this machine cannot set up loop devices")
        assert {(c.kind, c.path) for c in ours(a_img, b_img)} == diff_rq(ma, mb)


def test_diff_trees_with_attrs_adds_mode_and_owner_changes(
        trees: tuple[Path, Path, Path, Path]) -> None:
    a, b, a_img, b_img = trees
    plain = ours(a_img, b_img)
    with FileImageReader(a_img) as ra, FileImageReader(b_img) as rb:
        full = diff_trees(GuestFS.open(ra), GuestFS.open(rb), attrs=True)
    extra = [c for c in full if c.kind == "attrs"]
    assert [c.path for c in extra] == ["nomode", "owned"]
    assert extra[0].attrs == {"mode": [0, 0o644]} and extra[0].size_a == extra[0].size_b
    assert extra[1].attrs == {"uid": [1234, 1], "gid": [5678, 1]}
    assert [c for c in full if c.kind != "attrs"] == plain  # the rest is diff -rq, unchanged
    assert extra[0].to_dict()["attrs"] == {"mode": [0, 0o644]}
    assert all(c.attrs == {} for c in plain)


def test_no_changes_between_equal_images(trees: tuple[Path, Path, Path, Path]) -> None:
    assert ours(trees[2], trees[2]) == []
    assert diff_rq_equal(trees[0], trees[0])


def diff_rq_equal(a: Path, b: Path) -> bool:
    return subprocess.run(["diff", "-rq", "--no-dereference", str(a), str(b)]).returncode == 0
