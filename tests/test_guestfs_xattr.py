"""Extended attributes of guest files: GuestFS lists and reads exactly what the kernel's ext4
gives (``os.listxattr``/``os.getxattr`` on a loop mount of the same image), in the inode, in an
external xattr block (shared by several files too), in an ea_inode, and POSIX ACLs in the form
getxattr gives them. A damaged xattr block is refused as the kernel refuses it."""

from __future__ import annotations

import errno
import os
import shutil
import struct
from pathlib import Path

import pytest
from test_guestfs_helpers import loop_mount

from ksfs.errors import GuestFSUnreadable
from ksfs.guestfs import FileImageReader, GuestFS
from ksfs.guestfs.layout import acl_to_xattr, crc32c
from ksfs.guestfs.mkimage import build_ext4

B4K = ["-b", "4096", "-T", "default"]
ACL_V2 = 2


def acl(*entries: tuple[int, int, int]) -> bytes:
    """A POSIX ACL in getxattr's form: (tag, perm, id) entries."""
    return struct.pack("<I", ACL_V2) + b"".join(struct.pack("<HHI", *e) for e in entries)


NOID = 0xFFFFFFFF
ACCESS = acl((0x01, 6, NOID), (0x02, 4, 1234), (0x04, 4, NOID), (0x08, 6, 77),
             (0x10, 6, NOID), (0x20, 0, NOID))
DEFAULT = acl((0x01, 7, NOID), (0x04, 5, NOID), (0x20, 5, NOID))


def decorate(root: Path, ea_inode: bool) -> None:
    """Set attributes of every kind on a mounted filesystem, through the kernel."""
    (root / "plain").write_text("no attributes\n")
    small = root / "small"
    small.write_text("one small attribute: in the inode\n")
    os.setxattr(small, "user.colour", b"blue")
    big = root / "big"
    big.write_text("more than the inode holds: an xattr block\n")
    for i in range(12):
        os.setxattr(big, f"user.attr-{i:02d}", bytes([65 + i]) * (40 + 13 * i))
    os.setxattr(big, "user.empty", b"")
    for name in ("shared-1", "shared-2"):  # the same attributes: one block, two owners
        p = root / name
        p.write_text(name)
        os.setxattr(p, "user.big", b"S" * 1500)
    sec = root / "namespaces"
    sec.write_text("security and trusted\n")
    os.setxattr(sec, "security.label", b"system_u:object_r:etc_t:s0\0")
    os.setxattr(sec, "trusted.overlay.opaque", b"y")
    os.setxattr(sec, "user.binary", bytes(range(256)))
    acl_file = root / "acl"
    acl_file.write_text("with an access ACL\n")
    os.setxattr(acl_file, "system.posix_acl_access", ACCESS)
    d = root / "dir-default-acl"
    d.mkdir()
    os.setxattr(d, "system.posix_acl_default", DEFAULT)
    os.setxattr(d, "user.on-a-dir", b"yes")
    os.symlink("plain", root / "link")
    os.setxattr(root / "link", "trusted.on-a-link", b"L", follow_symlinks=False)
    if ea_inode:
        os.setxattr(root / "plain", "user.huge", os.urandom(9000))  # past a block: own inode


def kernel_xattrs(path: Path) -> list[tuple[bytes, bytes]]:
    return [(os.fsencode(n), os.getxattr(path, n, follow_symlinks=False))
            for n in os.listxattr(path, follow_symlinks=False)]


@pytest.fixture(scope="module", params=["default", "ea_inode", "inline_data", "128-inodes"])
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp(f"guestfs-xattr-{request.param}")
    (base / "src").mkdir()
    options = {"default": B4K, "ea_inode": [*B4K, "-O", "ea_inode"],
               "inline_data": [*B4K, "-O", "inline_data"],
               "128-inodes": [*B4K, "-I", "128"]}[request.param]
    img = base / "fs.img"
    build_ext4(base / "src", img, 16, options, index_dirs=False)
    with loop_mount(img, "rw") as mnt:
        if mnt is None:
            pytest.skip("this machine cannot set up loop devices")
        decorate(mnt, request.param == "ea_inode")
    return img


def test_xattrs_equal_the_kernels(image: Path) -> None:
    with FileImageReader(image) as reader, loop_mount(image) as mnt:
        fs = GuestFS.open(reader)
        seen = 0
        for name in sorted(os.listdir(mnt)):
            theirs = kernel_xattrs(mnt / name)
            assert fs.listxattr(name) == [n for n, _ in theirs], name
            assert [(n, fs.getxattr(name, n)) for n, _ in theirs] == theirs, name
            seen += len(theirs)
            assert fs.getxattr(name, b"user.absent") is None
        assert seen >= 20
        assert fs.getxattr("acl", "system.posix_acl_access") == ACCESS
        assert fs.getxattr("dir-default-acl", "system.posix_acl_default") == DEFAULT
        assert fs.listxattr("plain") in ([], [b"user.huge"])
        if fs.volume.sb.incompat & 0x8000:  # inline data: system.data is not listed
            assert b"system.data" not in fs.listxattr("small")
        # the places this was meant to cover: a shared block, and an ea_inode when asked for
        vol = fs.volume
        shared = {vol.inode(fs.resolve(n)).file_acl for n in ("shared-1", "shared-2")}
        assert len(shared) == 1 and shared != {0}
        if fs.volume.sb.incompat & 0x400:
            assert any(e.value_inum for _, _, _, e in fs._xattr_entries(fs.resolve("plain")))


def test_a_damaged_xattr_block_is_refused(image: Path, tmp_path: Path) -> None:
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        ino = fs.resolve("big")
        block = fs.volume.inode(ino).file_acl
        bs = fs.volume.bs
        csum = fs.volume.sb.csum_seed is not None
    assert block
    bad = shutil.copyfile(image, tmp_path / "bad.img")
    with open(bad, "r+b") as f:
        f.seek(block * bs + bs - 1)  # the last byte of the last value
        last = f.read(1)[0]
        f.seek(block * bs + bs - 1)
        f.write(bytes([last ^ 0x20]))
    with FileImageReader(bad) as reader:
        fs = GuestFS.open(reader)
        if csum:
            with pytest.raises(GuestFSUnreadable, match="fails its checksum"):
                fs.listxattr("big")
        assert fs.read("big", 0, 4) == b"more"
        assert fs.listxattr("small") == [b"user.colour"]
    with loop_mount(bad) as mnt:
        with pytest.raises(OSError) as err:
            os.listxattr(mnt / "big")
        assert err.value.errno == errno.EBADMSG


def test_a_value_outside_its_block_is_refused(image: Path, tmp_path: Path) -> None:
    # no checksum to tell: the entry's own bounds are checked (check_xattrs in the kernel)
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        block = fs.volume.inode(fs.resolve("big")).file_acl
        raw = bytearray(fs.volume.read_blocks(block, 1, "test"))
        seed = fs.volume.sb.csum_seed
    raw[32 + 8 : 32 + 12] = struct.pack("<I", 1 << 20)  # the first entry's e_value_size
    if seed is not None:
        raw[0x10:0x14] = bytes(4)
        raw[0x10:0x14] = struct.pack(
            "<I", crc32c(crc32c(seed, struct.pack("<Q", block)), bytes(raw)))
    bad = shutil.copyfile(image, tmp_path / "bounds.img")
    with open(bad, "r+b") as f:
        f.seek(block * len(raw))
        f.write(raw)
    with FileImageReader(bad) as reader:
        with pytest.raises(GuestFSUnreadable, match="lies outside its area"):
            GuestFS.open(reader).getxattr("big", b"user.attr-00")


def test_acl_form() -> None:
    ext4 = struct.pack("<I", 1) + struct.pack("<HH", 1, 6) + struct.pack("<HHI", 2, 4, 1234) \
        + struct.pack("<HH", 0x20, 0)
    assert acl_to_xattr(ext4, "x") == acl((1, 6, NOID), (2, 4, 1234), (0x20, 0, NOID))
    with pytest.raises(GuestFSUnreadable, match="tag"):
        acl_to_xattr(struct.pack("<I", 1) + struct.pack("<HH", 0x40, 0), "x")
