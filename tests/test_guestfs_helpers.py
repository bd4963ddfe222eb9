"""Shared by the guestfs tests (no tests here): a source tree with every kind of file the reader
must handle, loop mounts, and the comparison of a GuestFS against a real directory."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import random
import shutil
import stat
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ksfs.guestfs import GuestFS

MTIME = 1_700_000_000  # mkfs -d keeps whole seconds only, so the tree uses whole seconds
NON_UTF8 = os.fsdecode(b"bad-\xff-name")


def make_tree(root: Path, seed: int = 7) -> None:
    """Write the test tree at ``root`` (which must not exist)."""
    rnd = random.Random(seed)
    root.mkdir()
    (root / "a" / "b" / "c" / "d").mkdir(parents=True)
    (root / "a" / "b" / "c" / "d" / "deep.txt").write_text("deep down\n")
    (root / "a" / "top.txt").write_text("top of a\n" * 10)
    many = root / "many"
    many.mkdir()
    for i in range(3000):  # past one block of entries: an htree directory
        (many / f"entry-{i:05d}-{'x' * (i % 40)}").write_bytes(str(i).encode())
    (root / "empty").write_bytes(b"")
    (root / "small.txt").write_text("hello\n")
    (root / "fifty-nine").write_bytes(b"5" * 59)  # fits i_block of an inline-data inode
    (root / "inline-100").write_bytes(bytes(rnd.randrange(256) for _ in range(100)))
    (root / "random.bin").write_bytes(rnd.randbytes(3 * 1024 * 1024 + 123))
    with open(root / "sparse.bin", "wb") as f:  # holes at the start, middle and end
        f.truncate(40 * 1024 * 1024)
        for off in (0, 1024 * 1024 + 17, 20 * 1024 * 1024 - 3, 40 * 1024 * 1024 - 5):
            f.seek(off)
            f.write(b"DATA!")
    with open(root / "islands.bin", "wb") as f:  # many extents: a deeper extent tree
        for i in range(400):
            f.seek(i * 16384)
            f.write(rnd.randbytes(4096))
    os.symlink("small.txt", root / "link-short")
    os.symlink("a/b/c/" + "long-target-" * 20, root / "link-long")  # past 60 bytes: slow
    os.symlink("x" * 59, root / "link-59")
    os.symlink("/absolute/target", root / "link-abs")
    (root / "héllo wörld.txt").write_text("unicode name\n")
    (root / "日本語").mkdir()
    (root / "日本語" / "ファイル").write_text("kana\n")
    (root / NON_UTF8).write_text("name that is not UTF-8\n")
    (root / "setuid").write_text("#!/bin/sh\n")
    os.chmod(root / "setuid", 0o4755)
    (root / "sticky").mkdir()
    os.chmod(root / "sticky", 0o1777)
    (root / "nomode").write_text("no permissions\n")
    os.chmod(root / "nomode", 0)
    (root / "owned").write_text("someone else's\n")
    os.chown(root / "owned", 1234, 5678)
    (root / "owned-high").write_text("32-bit ids\n")
    os.chown(root / "owned-high", 100000, 200000)
    os.link(root / "small.txt", root / "hardlink")
    stamp_tree(root)


def stamp_tree(root: Path) -> None:
    """Distinct whole-second mtimes, deepest first so directories keep theirs."""
    for i, (dirpath, dirnames, filenames) in enumerate(os.walk(root, topdown=False)):
        for j, name in enumerate(sorted(filenames + dirnames)):
            t = MTIME + i * 1000 + j
            os.utime(os.path.join(dirpath, name), (t, t), follow_symlinks=False)
        os.utime(dirpath, (MTIME + i, MTIME + i))


def walk(fs: GuestFS, path: str = "") -> Iterator[tuple[str, int, bool]]:
    """(relative path, ino, is_dir) of every entry of a GuestFS, depth first."""
    for name, ino, is_dir in fs.listdir(path or "/"):
        rel = f"{path}/{name}" if path else name
        yield rel, ino, is_dir
        if is_dir:
            yield from walk(fs, rel)


def digest(data: bytes) -> str:
    return hashlib.blake2b(data).hexdigest()


def read_all(fs: GuestFS, ino: int, size: int, piece: int = 1 << 20) -> bytes:
    return b"".join(fs.read(ino, off, piece) for off in range(0, size, piece))


def compare_with_dir(fs: GuestFS, top: Path, exact: bool, skip: tuple[str, ...] = ()) -> int:
    """Assert that every entry of ``top`` and of ``fs`` match; return how many were compared.

    ``exact`` (a mount of the same image): every stat field equal, inode numbers included.
    Otherwise (the source tree): type, mode, owner, size, whole-second mtime, bytes, targets.
    """
    ours = {rel: (ino, is_dir) for rel, ino, is_dir in walk(fs) if rel.split("/")[0] not in skip}
    theirs = {}
    for dirpath, dirnames, filenames in os.walk(top):
        rel_dir = os.path.relpath(dirpath, top)
        for name in dirnames + filenames:
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            if rel.split("/")[0] not in skip:
                theirs[rel] = os.path.join(dirpath, name)
    assert sorted(ours) == sorted(theirs)
    for rel, real in theirs.items():
        ino, is_dir = ours[rel]
        s = os.lstat(real)
        g = fs.stat(rel)
        assert g.ino == ino and is_dir == stat.S_ISDIR(s.st_mode), rel
        assert (g.mode, g.uid, g.gid) == (s.st_mode, s.st_uid, s.st_gid), rel
        if not stat.S_ISDIR(s.st_mode):
            assert g.size == s.st_size, rel
        if exact:
            assert g.ino == s.st_ino, rel
            assert (g.size, g.nlink, g.blocks) == (s.st_size, s.st_nlink, s.st_blocks), rel
            assert (g.mtime_ns, g.ctime_ns, g.atime_ns) == (
                s.st_mtime_ns, s.st_ctime_ns, s.st_atime_ns), rel
        else:
            assert g.mtime_ns == s.st_mtime_ns, rel
        if stat.S_ISLNK(s.st_mode):
            assert fs.readlink(rel) == os.readlink(real), rel
        elif stat.S_ISREG(s.st_mode):
            with open(real, "rb") as f:
                assert digest(read_all(fs, ino, g.size)) == digest(f.read()), rel
    return len(theirs)


@contextlib.contextmanager
def loop_mount(image: Path, options: str = "ro") -> Iterator[Path | None]:
    """The image mounted (``mount -o OPTIONS,loop``) for the block, or None when this machine
    cannot set up loop devices at all. Always unmounted, and its loop device freed, after."""
    mnt = Path(tempfile.mkdtemp(prefix="ksfs-guestfs-mnt-"))
    proc = subprocess.run(["mount", "-o", f"{options},loop", str(image), str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        mnt.rmdir()
        if "loop" in proc.stderr and not os.path.exists("/dev/loop-control"):
            yield None
            return
        raise AssertionError(f"mount failed: {proc.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


def same_mtime_write(path: Path, offset: int, data: bytes) -> None:
    s = os.lstat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(len(data))
        assert old != data
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(s.st_atime_ns, s.st_mtime_ns))
    assert os.lstat(path).st_size == s.st_size


def diff_rq(a: Path, b: Path) -> set[tuple[str, str]]:
    """(kind, path) of each line of ``diff -rq --no-dereference a b``."""
    proc = subprocess.run(["diff", "-rq", "--no-dereference", str(a), str(b)],
                          capture_output=True, env={**os.environ, "LC_ALL": "C"})
    assert proc.returncode == 1, proc.stderr
    pa, pb = os.fsencode(a) + b"/", os.fsencode(b) + b"/"
    out = set()
    for line in proc.stdout.splitlines():
        if line.startswith(b"Only in "):
            where, name = line[len(b"Only in "):].split(b": ", 1)
            side, where = ("removed", where + b"/") if where + b"/" == pa or where.startswith(
                pa) else ("added", where + b"/")
            prefix = pa if side == "removed" else pb
            out.add((side, os.fsdecode(where[len(prefix):] + name)))
        else:
            first = line.split(b" ", 2)[2] if line.startswith(b"Symbolic links ") else (
                line.split(b" ", 1)[1])
            assert first.startswith(pa), line
            out.add(("changed", os.fsdecode(first[len(pa):].split(b" ")[0])))
    return out


def kernel_view(mnt: Path, rel: str) -> dict[str, tuple]:
    """Each entry under ``rel`` (recursively) as the kernel shows it: (mode, ino, size, nlink,
    uid, gid, mtime_ns, symlink target or None, errno of reading it or None)."""
    out = {}
    for name in os.listdir(mnt / rel):
        path = mnt / rel / name
        s = os.lstat(path)
        target = os.readlink(path) if path.is_symlink() else None
        err = None
        if path.is_file() and not path.is_symlink():
            try:
                path.read_bytes()
            except OSError as exc:
                err = exc.errno
        out[f"{rel}/{name}"] = (s.st_mode, s.st_ino, s.st_size, s.st_nlink, s.st_uid,
                                s.st_gid, s.st_mtime_ns, target, err)
        if path.is_dir() and not path.is_symlink():
            out.update(kernel_view(mnt, f"{rel}/{name}"))
    return out


# --- fscrypt: a real encrypted directory, made by the host kernel ---------------------------

FS_IOC_ADD_ENCRYPTION_KEY = (3 << 30) | (80 << 16) | (ord("f") << 8) | 23  # _IOWR, 80 bytes
FS_IOC_SET_ENCRYPTION_POLICY = (2 << 30) | (12 << 16) | (ord("f") << 8) | 19  # _IOR, 12 bytes
FSCRYPT_KEY = bytes(range(64))  # the test key: the same identifier every time
LONG_NAME = "L" * 200  # a ciphertext over 149 bytes: the long (digest) no-key form


def _add_key(mnt: Path) -> bytes:
    """Add FSCRYPT_KEY to the mounted filesystem's own keyring (v2 policies need no keyctl);
    its identifier."""
    arg = bytearray(struct.pack("<II32sII32x", 2, 0, b"", len(FSCRYPT_KEY), 0) + FSCRYPT_KEY)
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_ADD_ENCRYPTION_KEY, arg)
    finally:
        os.close(fd)
    return bytes(arg[8:24])


def _encrypt_dir(path: Path, identifier: bytes) -> None:
    # v2 policy: AES-256-XTS contents, AES-256-CTS names, names padded to 16 bytes
    policy = struct.pack("<BBBB4x16s", 2, 1, 4, 2, identifier)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_SET_ENCRYPTION_POLICY, policy)
    finally:
        os.close(fd)


def encrypted_image(out: Path, options: list[str], hash_alg: str | None = None,
                    unsigned: bool = False) -> str | None:
    """Build at ``out`` an ext4 image (``-O encrypt`` plus ``options``) whose ``secret/`` the
    host kernel encrypted (fscrypt, v2 policy): files short and empty, names short and over 149
    bytes of ciphertext, a fast and a slow symlink, a fifo, an indexed subdirectory of 300
    names with one more below it, and a one-block one; ``plain/`` beside it is not encrypted.
    The image is unmounted after, so no key is left. ``hash_alg`` is the default directory
    hash (tune2fs); with ``unsigned`` the superblock says names hash as unsigned chars.
    Returns why it cannot (no loop devices, a kernel without fscrypt), or None."""
    from ksfs.guestfs.mkimage import build_ext4

    src = Path(tempfile.mkdtemp(prefix="ksfs-crypt-src-"))
    try:
        (src / "etc").mkdir()
        (src / "etc" / "hostname").write_text("crypt\n")
        build_ext4(src, out, 64, ["-O", "encrypt", *options])
    finally:
        shutil.rmtree(src)
    if hash_alg:
        subprocess.run(["tune2fs", "-E", f"hash_alg={hash_alg}", str(out)], check=True,
                       capture_output=True)
    if unsigned:
        subprocess.run(["debugfs", "-w", "-R", "ssv flags 2", str(out)], check=True,
                       capture_output=True)
    with loop_mount(out, "rw") as mnt:
        if mnt is None:
            return "this machine cannot set up loop devices"
        try:
            identifier = _add_key(mnt)
        except OSError as exc:
            return f"the kernel cannot add an fscrypt key here: {exc}"
        (mnt / "plain").mkdir()
        (mnt / "plain" / "open.txt").write_text("not encrypted\n")
        secret = mnt / "secret"
        secret.mkdir()
        _encrypt_dir(secret, identifier)
        (secret / "short.txt").write_text("hello encrypted\n")
        (secret / "empty").write_bytes(b"")
        (secret / LONG_NAME).write_text("long name\n")
        (secret / ("m" * 140)).write_text("short form still\n")
        os.symlink("short.txt", secret / "link")
        os.symlink("t" * 300, secret / "longlink")
        os.mkfifo(secret / "fifo")
        (secret / "sub" / "deeper").mkdir(parents=True)
        for i in range(300):
            (secret / "sub" / f"file-{i:04d}-{'x' * (i % 50)}").write_text(str(i))
        (secret / "sub" / "deeper" / "inner.txt").write_text("inner\n")
        (secret / "small").mkdir()
        for name in ("a", "b", "c"):
            (secret / "small" / name).write_text(name)
    return None


def rewrite_encrypted(image: Path, rel: str, data: bytes) -> None:
    """Write ``data`` over the start of the encrypted file ``rel`` of an encrypted_image, with
    the key added again (its identifier is the same) and removed again by the unmount."""
    with loop_mount(image, "rw") as mnt:
        assert mnt is not None
        _add_key(mnt)
        with open(mnt / rel, "r+b") as f:
            f.write(data)
