"""Lookups in indexed (htree) directories follow the index, as the kernel does, and find
exactly what a scan of the directory finds: for every hash (legacy, half-MD4, TEA), signed and
unsigned, one- and two-level trees, names past one hash round, bytes over 0x7f; a missing name
is absent. Images are built with mkfs.ext4 -d, indexed by e2fsck -D as the kernel would have
(and with the hash the superblock names), and checked against the kernel's own lookups."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from ksfs.errors import NoSuchFile
from ksfs.guestfs import FileImageReader, GuestFS, htree
from ksfs.guestfs.fs import SCAN
from ksfs.guestfs.mkimage import build_ext4, have_tools

pytestmark = pytest.mark.skipif(not have_tools("mkfs.ext4", "e2fsck", "tune2fs", "debugfs"),
                                reason="e2fsprogs is not installed")


def _names(n: int, rnd: random.Random) -> list[bytes]:
    out = set()
    while len(out) < n:
        length = rnd.choice((1, 3, 15, 16, 17, 31, 32, 33, 64, 200, 255))
        # bytes over 0x7f make signed and unsigned hashes differ; '/' and NUL cannot be names
        alphabet = b"abcXYZ019_.-" + bytes(range(0x80, 0x100))
        name = bytes(rnd.choice(alphabet) for _ in range(length))
        if name not in (b".", b".."):
            out.add(name)
    return sorted(out)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, int], Path]:
    base = tmp_path_factory.mktemp("htree")
    rnd = random.Random(19)
    small, big = _names(300, rnd), _names(4000, rnd)
    src = base / "src"
    for d, names in (("small", small), ("big", big)):
        (src / d).mkdir(parents=True)
        for name in names:
            (src / d / os.fsdecode(name)).write_bytes(name[:7])
    out = {}
    for alg in ("legacy", "half_md4", "tea"):
        for unsigned in (False, True):
            img = base / f"{alg}-{unsigned}.img"
            build_ext4(src, img, 64, ["-b", "1024"], index_dirs=False)
            subprocess.run(["tune2fs", "-E", f"hash_alg={alg}", str(img)], check=True,
                           capture_output=True)
            if unsigned:  # (x86 mkfs writes the signed flag: 0x1 -> 0x2)
                subprocess.run(["debugfs", "-w", "-R", "ssv flags 2", str(img)], check=True,
                               capture_output=True)
            res = subprocess.run(["e2fsck", "-fyD", str(img)], capture_output=True, text=True)
            assert res.returncode in (0, 1), res.stdout
            out[(alg, unsigned, 0)] = img
    return out


@pytest.mark.parametrize("alg", ["legacy", "half_md4", "tea"])
@pytest.mark.parametrize("unsigned", [False, True])
def test_lookups_follow_the_index_and_agree_with_a_scan(images, alg: str,
                                                        unsigned: bool) -> None:
    img = images[(alg, unsigned, 0)]
    with FileImageReader(img) as reader:
        fs = GuestFS.open(reader)
        assert fs.volume.sb.hash_unsigned is unsigned
        for d in ("small", "big"):
            dir_ino = fs.resolve(d)
            scanned = {n: ino for n, ino, _, _ in fs._iter_entries(dir_ino)}
            levels = fs.volume.read_blocks(fs.volume.runs(fs._inode(dir_ino), 0, 1)[0][2], 1,
                                           "root")[30]
            if d == "big":
                assert levels == 1, "the big directory must have a two-level index"
            for name, ino in scanned.items():
                if name in (b".", b".."):
                    continue
                assert fs._dx_lookup(dir_ino, name) == ino, (d, name)
                assert fs.lookup(dir_ino, name) == ino
            for missing in (b"nope", b"\xff" * 40, b"a" * 255):
                assert fs._dx_lookup(dir_ino, missing) is None
                with pytest.raises(NoSuchFile):
                    fs.lookup(dir_ino, missing)
            assert fs.lookup(dir_ino, b"..") == 2


def test_the_kernel_finds_the_same_names(images, tmp_path: Path) -> None:
    """Against a loop mount: each name's inode number, by lookup (os.stat), not by listing."""
    if os.geteuid() != 0:
        pytest.skip("a loop mount needs root")
    img = images[("half_md4", True, 0)]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop,ro", str(img), str(mnt)], check=True)
    try:
        with FileImageReader(img) as reader:
            fs = GuestFS.open(reader)
            for d in ("small", "big"):
                dir_ino = fs.resolve(d)
                for name in os.listdir(os.fsencode(mnt / d)):
                    assert fs.lookup(dir_ino, name) == os.stat(
                        os.fsencode(mnt / d) + b"/" + name).st_ino
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_directory_without_an_index_is_scanned(images) -> None:
    with FileImageReader(images[("tea", False, 0)]) as reader:
        fs = GuestFS.open(reader)
        assert fs._dx_lookup(2, b"small") is SCAN  # the root: two entries, no index
        assert fs.lookup(2, b"small") == fs.resolve("small")


def test_hashes_match_known_values() -> None:
    """Values e2fsprogs' `debugfs -R "dx_hash -h VERSION NAME"` prints with the default seed
    (0-2: legacy, half-MD4, TEA with signed chars; 3-5: the same, unsigned)."""
    for alg, version in (("legacy", htree.LEGACY), ("half_md4", htree.HALF_MD4),
                         ("tea", htree.TEA)):
        for name in (b"a", b"hello-world", b"x" * 40, "é".encode() * 20):
            for unsigned in (False, True):
                # (by number: debugfs 1.47 knows no "_unsigned" names and falls back to legacy)
                how = version + (htree.UNSIGNED if unsigned else 0)
                res = subprocess.run(
                    ["debugfs", "-R", f"dx_hash -h {how} -s 00000000-0000-0000-0000-000000000000"
                                      f" {os.fsdecode(name)}"], capture_output=True, text=True)
                want = _debugfs_hash(res.stdout + res.stderr)
                if want is None:
                    pytest.skip(f"debugfs dx_hash gave no hash: {res.stdout}{res.stderr}")
                got = htree.dirhash(name, version + (htree.UNSIGNED if unsigned else 0), None)
                assert got == want, (alg, name, unsigned, res.stdout)


def _debugfs_hash(text: str) -> int | None:
    import re

    m = re.search(r"[Hh]ash of .* is (0x[0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None
