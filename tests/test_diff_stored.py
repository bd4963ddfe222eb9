"""``ksfs diff`` of offline imports: the checkpoints' own stored files (added, removed, changed
with what their manifests say, identical), guest files read from a disk image not named
disk.raw (disk*.raw, *.img: the names import chunks as disk images), and disk clusters counted
offset by offset out of those that hold data. No VM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from ksfs.cli import main
from ksfs.guestfs.mkimage import build_ext4
from ksfs.keeper import Keeper
from ksfs.keeper.diffing import CLUSTER, _compare_by_offset

MIB = 16


def _file(tmp: Path, sub: str, name: str, data: bytes) -> Path:
    (tmp / sub).mkdir(exist_ok=True)
    (tmp / sub / name).write_bytes(data)
    return tmp / sub / name


def _disk(tmp: Path, sub: str, name: str, files: dict[str, bytes]) -> Path:
    src = tmp / f"src-{sub}"
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    (tmp / sub).mkdir(exist_ok=True)
    build_ext4(src, tmp / sub / name, MIB, index_dirs=False)
    return tmp / sub / name


def _clusters_differing(a: Path, b: Path) -> int:
    """The ground truth: 64 KiB clusters whose bytes differ, by reading both images."""
    n = 0
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(CLUSTER), fb.read(CLUSTER)
            if not x and not y:
                return n
            n += x != y


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("diff-stored")
    d1 = _disk(tmp, "1", "disk0.raw", {"keep": b"same\n", "grows": b"abc"})
    d2 = _disk(tmp, "2", "disk0.raw", {"keep": b"same\n", "grows": b"abcdefgh",
                                       "new": os.urandom(200_000)})
    o1 = _file(tmp, "1", "other.bin", os.urandom(300_000))
    o2 = _file(tmp, "2", "other.bin", o1.read_bytes()[:150_000] + b"X" +
               o1.read_bytes()[150_000:])
    extra = _file(tmp, "2", "extra.txt", b"only in c2\n")
    two = [_disk(tmp, "3", "a.img", {"f": b"a"}), _disk(tmp, "4", "b.img", {"f": b"b"})]
    store = tmp / "store"
    with Keeper(store, create=True) as k:
        k.import_files("sess", "c1", [d1, o1])
        k.import_files("sess", "c2", [d2, o2, extra])
        k.import_files("sess", "c2dup", [d2])
        k.import_files("sess", "two", two)
        k.import_files("sess", "img", [_disk(tmp, "5", "guest.img", {"grows": b"abcdefgh"})])
        named = _disk(tmp, "6", "cloud.bin", {"grows": b"abcdefgh"})
        k.import_files("sess", "asdisk", [named], disks=[named])  # `import --disk cloud.bin`
        k.import_files("sess", "otherdisk", [o1], disks=[o1])  # c1's other.bin, fixed chunks
        k.import_files("sess", "odd", [_disk(tmp, "7", "disk0.raw", {
            "keep": b"same\n", "grows": b"abc", os.fsdecode(b"bad\xffname"): b"x"})])
    return store, (d1, d2)


def run(store: Path, *args: str) -> str:
    res = CliRunner().invoke(main, ["--store", str(store), "diff", "sess", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return res.output


def as_json(store: Path, *args: str) -> dict:
    return json.loads(run(store, *args, "--json"))


def _stored(d: dict) -> dict[str, dict]:
    return {f["name"]: f for f in d["stored_files"]}


def test_same_disk_other_files_gone(world) -> None:
    """The QA case: c2 holds disk0.raw, other.bin and extra.txt; c2dup only the same disk0.raw.
    The guest files are compared (none changed) and the two files that are gone are said."""
    store, _ = world
    d = as_json(store, "c2", "c2dup")
    assert d["files"] == [] and d["files_error"] is None and d["files_not_compared"] is None
    assert d["guest_disks"] == {"a": "disk0.raw", "b": "disk0.raw"}
    assert d["disk"]["changed_clusters"] == 0 and d["disk"]["changed_bytes"] == 0
    s = _stored(d)
    assert s["disk0.raw"]["kind"] == "identical"
    assert s["other.bin"]["kind"] == "removed" and s["other.bin"]["size_b"] is None
    assert s["extra.txt"] == {"name": "extra.txt", "kind": "removed", "size_a": 11,
                              "size_b": None}
    out = run(store, "c2", "c2dup")
    assert "files: 0 changed" in out and "not compared" not in out
    assert "stored files: 0 added, 2 removed, 0 changed, 1 identical" in out
    assert "  - other.bin  (300001 -> - bytes)" in out
    assert "  = disk0.raw  (" in out
    assert "disk in disk0.raw: 0 of " in out
    # (B, A): the same files, added instead of removed
    back = _stored(as_json(store, "c2dup", "c2"))
    assert back["other.bin"]["kind"] == "added" and back["extra.txt"]["kind"] == "added"


def test_changed_files_say_what_changed(world) -> None:
    store, (d1, d2) = world
    d = as_json(store, "c1", "c2")
    assert {(c["kind"], c["path"]) for c in d["files"]} == {("changed", "grows"),
                                                           ("added", "new")}
    s = _stored(d)
    assert s["extra.txt"]["kind"] == "added"
    other = s["other.bin"]
    assert other["kind"] == "changed" and other["chunking"] == "cdc"
    assert (other["size_a"], other["size_b"]) == (300_000, 300_001)
    # one byte inserted: content-defined chunks around it are new, the rest are found in A
    assert 1 <= other["changed_chunks"] < other["chunks"]
    assert other["changed_bytes"] < 300_001
    disk = s["disk0.raw"]
    assert disk["kind"] == "changed" and disk["chunking"] == "fixed"
    # the manifests' count is exact: the same as comparing the two images' bytes
    truth = _clusters_differing(d1, d2)
    assert disk["changed_chunks"] == d["disk"]["changed_clusters"] == truth > 0
    assert disk["changed_bytes"] == truth * CLUSTER
    # what the cluster count is out of: stored (data) clusters, and the disk's own
    total = MIB * (1 << 20) // CLUSTER
    assert d["disk"]["disk_clusters"] == total
    assert truth <= d["disk"]["stored_clusters"] < total
    for key in ("clusters", "changed_clusters", "cluster_size"):  # what --json always had
        assert key in d["disk"]
    out = run(store, "c1", "c2")
    assert (f"disk in disk0.raw: {truth} of {d['disk']['stored_clusters']} stored 64 KiB "
            f"clusters (of {total}) changed") in out
    assert "stored files: 1 added, 0 removed, 2 changed, 0 identical" in out
    assert (f"  M disk0.raw  ({MIB << 20} -> {MIB << 20} bytes; {truth} of "
            f"{disk['chunks']} stored 64 KiB clusters changed, {truth * CLUSTER} bytes)") in out
    assert f"  M other.bin  (300000 -> 300001 bytes; {other['changed_chunks']} of " in out


def test_img_name_is_a_disk_image(world) -> None:
    store, _ = world
    d = as_json(store, "c1", "img")
    assert d["guest_disks"] == {"a": "disk0.raw", "b": "guest.img"}
    assert [(c["kind"], c["path"]) for c in d["files"]] == [("changed", "grows"),
                                                          ("removed", "keep")]
    assert d["disk"]["file_b"] == "guest.img"
    assert "disk in disk0.raw -> guest.img: " in run(store, "c1", "img")


def test_a_file_imported_with_disk_is_the_disk_image_whatever_its_name(world) -> None:
    """QA: `import --disk cloud.bin` chunked it as a disk, but the checkpoint had no guest
    files (no fs/, diff "has no disk image"): disks were told by name alone."""
    store, _ = world
    d = as_json(store, "c1", "asdisk")
    assert d["guest_disks"] == {"a": "disk0.raw", "b": "cloud.bin"}
    assert [(c["kind"], c["path"]) for c in d["files"]] == [("changed", "grows"),
                                                          ("removed", "keep")]


def test_the_same_bytes_chunked_another_way_are_identical(world) -> None:
    """QA: a file imported once by content and once as a disk (--disk) was "changed", all its
    chunks new, though its bytes are the same."""
    store, _ = world
    other = _stored(as_json(store, "c1", "otherdisk"))["other.bin"]
    assert other["kind"] == "identical", other
    assert "  = other.bin  (" in run(store, "c1", "otherdisk")
    # and bytes that differ still differ (c2's other.bin has one byte more)
    assert _stored(as_json(store, "c2", "otherdisk"))["other.bin"]["kind"] == "changed"


def test_a_name_that_is_not_utf8_goes_in_json_with_its_bytes(world) -> None:
    """QA: --json gave such a name only as a string with a lone surrogate escape, which tools
    other than Python's json (jq) read as U+FFFD: its bytes now go beside it, in hex."""
    store, _ = world
    d = as_json(store, "c1", "odd")
    [added] = d["files"]
    assert added["kind"] == "added" and os.fsencode(added["path"]) == b"bad\xffname"
    assert bytes.fromhex(added["path_hex"]) == b"bad\xffname"
    assert all("path_hex" not in c for c in as_json(store, "c1", "c2")["files"])  # UTF-8 names


def test_several_disk_images_are_not_guessed(world) -> None:
    store, _ = world
    d = as_json(store, "c1", "two")
    assert d["files"] is None and d["disk"] is None and d["files_error"] is None
    assert d["files_not_compared"] == ("sess/two has 2 disk images (a.img, b.img), no disk.raw "
                                       "and none holding the transcript")
    assert d["guest_disks"] == {"a": "disk0.raw", "b": None}
    assert _stored(d)["a.img"]["kind"] == "added"
    out = run(store, "c1", "two")
    assert "files: not compared (sess/two has 2 disk images (a.img, b.img)" in out


def test_compare_by_offset_lines_up_hole_runs() -> None:
    """A run of holes is one entry on one side and three on the other: compared by offset,
    only the cluster that holds new data changed (entry by entry, all after it would)."""
    x, y = b"x" * 32, b"y" * 32
    a = [(x, CLUSTER), (None, 10 * CLUSTER)]
    b = [(x, CLUSTER), (None, 3 * CLUSTER), (y, CLUSTER), (None, 6 * CLUSTER)]
    assert _compare_by_offset(a, b) == {"stored_clusters": 2, "changed_clusters": 1,
                                        "changed_bytes": CLUSTER}
    assert _compare_by_offset(a, a) == {"stored_clusters": 1, "changed_clusters": 0,
                                        "changed_bytes": 0}
    # a longer B (a disk grown): past A's end reads as zeros, so only data there changed
    # (QA: a disk grown online counted all its new empty space; the sizes are said apart)
    longer = a + [(None, 2 * CLUSTER), (y, 100)]
    assert _compare_by_offset(a, longer) == {"stored_clusters": 2, "changed_clusters": 1,
                                             "changed_bytes": 100}
    assert _compare_by_offset(longer, a) == _compare_by_offset(a, longer)
    assert _compare_by_offset([], []) == {"stored_clusters": 0, "changed_clusters": 0,
                                          "changed_bytes": 0}


def test_an_unreadable_side_is_named_and_a_device_says_its_numbers(tmp_path: Path) -> None:
    """QA (nineteenth session): "files: not compared (guest filesystem cannot be read ...)"
    did not say of which side, and a device whose numbers changed printed "char, 0 -> 0"."""
    import stat as st

    trees = []
    for minor in (3, 5):
        src = tmp_path / f"src{minor}"
        src.mkdir()
        os.mknod(src / "dev", st.S_IFCHR | 0o600, os.makedev(1, minor))
        (src / "keep").write_bytes(b"same\n")
        trees.append(tmp_path / f"{minor}")
        trees[-1].mkdir()
        build_ext4(src, trees[-1] / "disk.raw", MIB, index_dirs=False)
    junk = _file(tmp_path, "junk", "disk.raw", os.urandom(1 << 20))
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        k.import_files("sess", "c3", [trees[0] / "disk.raw"])
        k.import_files("sess", "c5", [trees[1] / "disk.raw"])
        k.import_files("sess", "junk", [junk])
    d = as_json(store, "c3", "c5")
    [dev] = d["files"]
    assert dev["path"] == "dev" and dev["attrs"]["rdev"] == ["1:3", "1:5"], dev
    assert "M dev  (char, 0 -> 0; device 1:3 -> 1:5)" in run(store, "c3", "c5")
    for a, b, bad in (("c3", "junk", "sess/junk"), ("junk", "c5", "sess/junk")):
        d = as_json(store, a, b)
        assert d["files"] is None and d["files_error"].startswith(
            f"{bad}: guest filesystem cannot be read"), d["files_error"]
        assert f"files: not compared ({bad}: guest filesystem cannot be read" in run(store, a, b)
