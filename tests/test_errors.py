"""The error family's translations of lower-layer errors: OSError by errno, LMDB's own errors
by kind (damage, full disk, permissions) and undecodable records, each to the ksfs class whose
exit code and errno say what happened; and a store the user may not write, through the real
command line run as an unprivileged user."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from ksfs.errors import (
    IntegrityError,
    NoSpace,
    NoSuchFile,
    NotPermitted,
    ReadOnly,
    from_foreign,
    from_os_error,
)


@pytest.mark.parametrize("code, cls, exit_code", [
    (errno.EACCES, NotPermitted, 12),
    (errno.EPERM, NotPermitted, 12),
    (errno.ENOSPC, NoSpace, 9),
    (errno.ENOENT, NoSuchFile, 3),
    (errno.EROFS, ReadOnly, 12),
])
def test_os_errors_by_errno(code: int, cls: type, exit_code: int) -> None:
    err = from_os_error(OSError(code, os.strerror(code), "/x/y"), "open the thing")
    assert type(err) is cls and err.exit_code == exit_code


def test_lmdb_errors_by_kind() -> None:
    damaged = from_foreign(lmdb.CorruptedError("mdb_get: MDB_CORRUPTED: Located page was wrong"),
                           "/s")
    assert isinstance(damaged, IntegrityError) and damaged.exit_code == 6
    assert "damaged" in str(damaged)
    assert isinstance(from_foreign(lmdb.PageNotFoundError("x"), "/s"), IntegrityError)
    full = from_foreign(lmdb.DiskError("mdb_txn_commit: No space left on device"), "/s")
    assert isinstance(full, NoSpace) and full.exit_code == 9
    denied = from_foreign(lmdb.Error("/s/index: Permission denied"), "/s")
    assert isinstance(denied, NotPermitted) and denied.exit_code == 12


def test_bugs_stay_bugs() -> None:
    """Only errors ksfs knows are translated: the rest keep their traceback."""
    try:
        b"\xff".decode("utf-8")
    except UnicodeDecodeError as exc:
        assert from_foreign(exc, "/s") is None
    assert from_foreign(OSError(errno.EBADF, "Bad file descriptor"), "/s") is None
    assert from_foreign(lmdb.BadTxnError("x"), "/s").exit_code == 1  # not damage
    assert from_foreign(ValueError("a bug"), "/s") is None
    assert from_foreign(KeyError("a bug"), "/s") is None


def _as_nobody() -> list[str]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run a command as another user")
    cmd = [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    if subprocess.run(cmd + [sys.executable, "-c", "import ksfs"], capture_output=True,
                      cwd="/").returncode != 0:
        pytest.skip("this Python cannot be run by an unprivileged user here")
    return cmd


def test_a_store_the_user_may_not_write_is_exit_12(tmp_path: Path) -> None:
    nobody = _as_nobody()
    src = tmp_path / "memory"
    src.write_bytes(b"data" * 100)
    src.chmod(0o644)
    tmp_path.chmod(0o755)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)  # root's, closed to others
    res = subprocess.run(nobody + [sys.executable, "-m", "ksfs.cli", "--store",
                                   str(locked / "store"), "import", "s", "c", str(src)],
                         capture_output=True, text=True, cwd="/")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 12, res.stderr
    assert len(lines) == 1 and "Permission denied" in lines[0], res.stderr
    assert list(locked.iterdir()) == []


def test_the_command_line_answers_a_foreign_error_with_its_class(tmp_path: Path) -> None:
    """An LMDB error that escaped every layer (here raised by a patched stats) still ends the
    command with one line and the exit code of damage, not a traceback; a plain bug does not
    pass for damage."""
    driver = (
        "import sys, lmdb\n"
        "from ksfs.cas.store import ChunkStore\n"
        "MODE = sys.argv[1]\n"
        "def bad(self, *a, **k):\n"
        "    raise (lmdb.CorruptedError('MDB_CORRUPTED: Located page was wrong')\n"
        "           if MODE == 'lmdb' else RuntimeError('a bug'))\n"
        "ChunkStore.stats = bad\n"
        "from ksfs.cli import main\n"
        "sys.argv = ['ksfs', '--store', sys.argv[2], 'stats']\n"
        "main()\n")
    store = tmp_path / "store"
    src = tmp_path / "memory"
    src.write_bytes(b"x" * 1000)
    subprocess.run([sys.executable, "-m", "ksfs.cli", "--store", str(store), "import", "s",
                    "c", str(src)], check=True, capture_output=True)
    res = subprocess.run([sys.executable, "-c", driver, "lmdb", str(store)],
                         capture_output=True, text=True)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 6, res.stderr
    assert len(lines) == 1 and "damaged" in lines[0], res.stderr
    res = subprocess.run([sys.executable, "-c", driver, "bug", str(store)],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" in res.stderr, res.stderr


def test_lmdb_refusals_are_told_apart_by_their_text() -> None:
    """Review (tenth session): py-lmdb raises ReadonlyError for any EACCES, so an index the
    user may not open was reported as a read-only file system."""
    import lmdb

    from ksfs.errors import NotPermitted, ReadOnly, from_foreign

    write = lmdb.ReadonlyError(
        "Cannot start write transaction with read-only environment.: Permission denied")
    assert isinstance(from_foreign(write, "/s"), ReadOnly)
    denied = lmdb.ReadonlyError("/s/index: Permission denied")
    assert isinstance(from_foreign(denied, "/s"), NotPermitted)
