"""fscrypt: an encrypted guest directory lists as the kernel lists it without the key, under
its no-key names, and its files' contents are refused with ENOKEY, as the kernel's open refuses
them. The encrypted directories are real: the host kernel makes them (a v2 policy on a loop
mount of an image built by our mkimage), and after an unmount, which takes the key with it,
its own listing of the same image is the reference: every name, every stat field, every
symlink target and the errno of reading each file."""

from __future__ import annotations

import base64
import errno
import hashlib
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from test_guestfs_helpers import (
    LONG_NAME,
    encrypted_image,
    kernel_view,
    loop_mount,
    rewrite_encrypted,
)

from ksfs.errors import GuestFSUnreadable, NoSuchFile
from ksfs.guestfs import FileImageReader, GuestFileEncrypted, GuestFS, diff_trees, fscrypt
from ksfs.guestfs.layout import crc32c

VARIANTS = {
    # name: (mkfs options, default directory hash, unsigned hashes)
    "4k-half_md4": (["-b", "4096"], None, False),
    "1k-tea": (["-b", "1024"], "tea", False),
    "4k-legacy-unsigned": (["-b", "4096"], "legacy", True),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    options, hash_alg, unsigned = VARIANTS[request.param]
    out = tmp_path_factory.mktemp("guestfs-crypt") / f"{request.param}.img"
    why = encrypted_image(out, options, hash_alg, unsigned)
    if why:
        pytest.skip(why)
    return out


def our_view(fs: GuestFS, rel: str) -> dict[str, tuple]:
    out = {}
    for name, st in fs.listdir_stats(fs.resolve(rel)):
        path = f"{rel}/{name}"
        looked_up = fs.stat(path)  # found again by the name it was listed under
        assert looked_up == st, path
        target = fs.readlink(path) if st.is_symlink else None
        err = None
        if st.is_file:
            try:
                fs.read(path, 0, 1 << 20)
            except GuestFileEncrypted as exc:
                err = exc.errno
        out[path] = (st.mode, st.ino, st.size, st.nlink, st.uid, st.gid, st.mtime_ns, target,
                     err)
        if st.is_dir:
            out.update(our_view(fs, path))
    return out


def test_encrypted_directories_list_as_the_kernel_lists_them_without_the_key(
        image: Path) -> None:
    with loop_mount(image) as mnt:
        assert mnt is not None
        want = kernel_view(mnt, "secret")
        plain = kernel_view(mnt, "plain")
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        got = our_view(fs, "secret")
        assert our_view(fs, "plain") == plain
    assert got == want
    assert len(want) == 9 + 301 + 1 + 3
    names = [p.rsplit("/", 1)[1] for p in want]
    assert "short.txt" not in names and LONG_NAME not in names
    # the long name's no-key form is the 252-character digest form
    assert max(len(n) for n in names) == fscrypt.LONG_ENCODED
    # files are refused as the kernel refuses them, empty ones too; plain/ reads
    assert {v[8] for v in want.values() if v[8] is not None} == {errno.ENOKEY}
    assert plain["plain/open.txt"][8] is None


def test_lookups_of_names_that_are_not_no_key_names(image: Path) -> None:
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        secret = fs.resolve("secret")
        for bad in ("short.txt", "AAAA", "not base64!", "A" * 300, "_" * 30):
            with pytest.raises(NoSuchFile):
                fs.lookup(secret, bad)
        assert fs.lookup(secret, "..") == fs.resolve(".")
        # a short form names its ciphertext whatever hashes it carries, as for the kernel
        name = next(n for n, _, _ in fs.listdir(secret) if len(n) < 100)
        decoded = fscrypt.decode_nokey(name.encode())
        assert decoded is not None and decoded.name is not None
        other = fscrypt.nokey_name(decoded.name, 1234, 5678).decode()
        assert other != name and fs.lookup(secret, other) == fs.lookup(secret, name)


def test_diff_compares_encrypted_files_by_their_stored_bytes(image: Path,
                                                             tmp_path: Path) -> None:
    changed = tmp_path / "changed.img"
    shutil.copyfile(image, changed)
    rewrite_encrypted(changed, "secret/short.txt", b"HELLO")  # the same size
    with FileImageReader(image) as ra, FileImageReader(changed) as rb:
        a, b = GuestFS.open(ra), GuestFS.open(rb)
        assert diff_trees(a, a) == []
        changes = diff_trees(a, b)
    assert [(c.kind, c.type_a, c.size_a) for c in changes] == [("changed", "file", 16)]
    assert changes[0].path.startswith("secret/")


def test_a_damaged_encrypted_directory_is_refused_not_listed(image: Path,
                                                             tmp_path: Path) -> None:
    """A stored name shorter than any ciphertext (16 bytes) is damage: the kernel's readdir
    fails (EUCLEAN); here the listing is GuestFSUnreadable."""
    with FileImageReader(image) as reader:
        fs = GuestFS.open(reader)
        small = next(st.ino for _, st in fs.listdir_stats(fs.resolve("secret"))
                     if st.is_dir and len(list(fs.listdir(st.ino))) == 3)
        vol = fs.volume
        inode = vol.inode(small)
        (_, _, phys), = vol.runs(inode, 0, 1)
        raw = vol.read_blocks(phys, 1, "test")
    # shorten the first name after . and .. to 15 bytes (its checksum follows the change)
    bad = tmp_path / "bad.img"
    shutil.copyfile(image, bad)
    off = 0
    for _ in range(2):
        off += struct.unpack_from("<H", raw, off + 4)[0]
    data = bytearray(raw)
    data[off + 6] = 15
    if vol.sb.csum_seed is not None:  # the block's checksum (its dirent tail) made anew
        tail = len(data) - 12
        data[tail + 8 : tail + 12] = struct.pack("<I", crc32c(inode.csum_seed, bytes(data[:tail])))
    with open(bad, "r+b") as f:
        f.seek(vol.offset + phys * vol.bs)
        f.write(data)
    with FileImageReader(bad) as reader:
        fs = GuestFS.open(reader)
        with pytest.raises(GuestFSUnreadable, match="shorter than any encrypted name"):
            list(fs.listdir(small))


@settings(max_examples=200, deadline=None)
@given(stored=hs.binary(min_size=fscrypt.MIN_NAME, max_size=255),
       hashes=hs.tuples(hs.integers(0, 2**32 - 1), hs.integers(0, 2**32 - 1)))
def test_no_key_names_decode_back_to_what_they_name(stored: bytes,
                                                    hashes: tuple[int, int]) -> None:
    name = fscrypt.nokey_name(stored, *hashes)
    assert len(name) <= fscrypt.LONG_ENCODED and b"/" not in name and b"\0" not in name
    decoded = fscrypt.decode_nokey(name)
    assert decoded is not None and decoded.matches(stored)
    assert (decoded.name is None) == (len(stored) > fscrypt.PREFIX)
    if decoded.name is None:  # the digest form: another tail does not match
        assert not decoded.matches(stored[: fscrypt.PREFIX] + hashlib.sha256(stored).digest())
    assert struct.unpack("<II", base64.urlsafe_b64decode(
        name + b"=" * (-len(name) % 4))[:8]) == hashes
