"""Through a real mount: a checkpoint whose guest disk holds an fscrypt-encrypted directory
(made by the host kernel, tests/test_guestfs_helpers.encrypted_image) shows it in ``fs/`` as
the kernel shows it without the key: the same no-key names, attributes and symlink targets,
``ls -l`` works, and opening a file fails with ENOKEY (126), not EIO."""

from __future__ import annotations

import errno
import stat
import subprocess
from pathlib import Path

import pytest
from test_guestfs_helpers import encrypted_image, kernel_view, loop_mount

from ksfs.keeper import Keeper
from tests.mount_helpers import mounted


@pytest.fixture(scope="module")
def crypt_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("fs-crypt")
    staged = root / "c"
    staged.mkdir()
    disk = staged / "disk.raw"
    why = encrypted_image(disk, ["-b", "4096"])
    if why:
        pytest.skip(why)
    with loop_mount(disk) as mnt:
        assert mnt is not None
        want = kernel_view(mnt, "secret")
    store = root / "store"
    with Keeper(store, create=True) as k:
        k.import_files("s", "c", [disk])
    return store, want


def test_an_encrypted_directory_through_the_mount(crypt_store: tuple[Path, dict]) -> None:
    store, want = crypt_store
    with mounted(store) as mnt:
        fs = mnt / "sessions" / "s" / "checkpoints" / "c" / "fs"
        got = kernel_view(fs, "secret")
        # inode numbers under fs/ are the mount's own (drawn from the guest's): all else is
        # the kernel's, errnos of reading included
        assert {p: v[:1] + v[2:] for p, v in got.items()} == \
            {p: v[:1] + v[2:] for p, v in want.items()}
        errs = {v[8] for v in got.values() if v[8] is not None}
        assert errs == {errno.ENOKEY}
        name = next(p for p, v in got.items() if stat.S_ISREG(v[0]))
        with pytest.raises(OSError) as caught:
            open(fs / name, "rb")
        assert caught.value.errno == errno.ENOKEY
        ls = subprocess.run(["ls", "-lR", str(fs / "secret")], capture_output=True, text=True)
        assert ls.returncode == 0, ls.stderr
        assert (fs / "plain" / "open.txt").read_text() == "not encrypted\n"
    assert "Traceback" not in mounted.last_log
    # the refusal says why, once per open, at INFO
    assert "is encrypted (fscrypt) and ksfs has no key" in mounted.last_log
