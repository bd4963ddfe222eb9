"""Per-session and store-wide verb locks that hold across threads and processes.

Verbs on one session are serialised; verbs on different sessions may run at once. The lock is an
flock on a file under ``STORE/locks/`` opened afresh for every acquisition, so it excludes other
threads of this process (each has its own open file description) as well as other processes: the
CLI working without a daemon and the daemon obey the same locks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

try:  # hashlib's blake2s itself, without hashlib loading OpenSSL (3 ms of every command)
    from _blake2 import blake2s
except ImportError:  # pragma: no cover - an interpreter without CPython's module
    from hashlib import blake2s

from ksfs.errors import Busy, translate
from ksfs.regularfile import open_lock_file, require_store_dir

# Times a waiter takes the lock again after finding its file unlinked by a session removal
# (bounded: a file system whose stat and fstat disagree must not loop for ever).
MAX_RENAMED_RETRIES = 100


def _lock_path(store_path: Path, session: str) -> Path:
    # Hash the name so no name, however odd, can reach outside locks/.
    return Path(store_path) / "locks" / (blake2s(session.encode()).hexdigest()[:32]
                                         + ".lock")


@contextlib.contextmanager
def session_lock(store_path: Path, session: str, timeout: float | None = None) -> Iterator[int]:
    """Hold the verb lock of ``session`` (by name: a name is one machine at a time); yields
    the locked file's descriptor."""
    _make_locks_dir(Path(store_path))
    path = _lock_path(store_path, session)
    deadline = None if timeout is None else time.monotonic() + timeout
    retries = 0
    while True:
        # Read-only and readable by all (locks/ itself is the owner's): flock needs no write
        # access, so a lock file another user made (root running one verb on a user's store)
        # still serves the store's owner instead of refusing every later verb of the session.
        with translate(f"open the lock of session {session!r}", path):
            fd = open_lock_file(path, store_path, os.O_RDONLY, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline else 0))
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise Busy(f"session {session!r} is busy with another verb") from None
                    time.sleep(0.05)
            if _still_named(fd, path) or retries >= MAX_RENAMED_RETRIES:
                break
            retries += 1
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the removal of a session unlinked this file while we waited: again
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def new_session_lock(store_path: Path, session: str, made: Callable[[], bool]
                     ) -> Iterator[None]:
    """The verb lock of a session a verb is about to make (session new, adopt, fork). A verb
    refused or failed leaves no lock file behind when the session does not exist after it
    (``made()`` false): bad input changes nothing (QA: a fork or session new refused for a
    libvirt domain of the name, an adopt of a domain another session keeps, each left
    ``locks/<hash>.lock``). Unlinked while still held, as drop_session_lock does, so a waiter
    takes a new file; only while the name is still the file this holds (a failure that
    removed the session has dropped it already, and a new holder may have made another)."""
    with session_lock(store_path, session) as fd:
        try:
            yield
        except BaseException:
            try:
                keep = made()
            except Exception:  # noqa: BLE001 - cannot tell: a file left is only a file
                keep = True
            path = _lock_path(store_path, session)
            if not keep and _still_named(fd, path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise


def _make_locks_dir(store_path: Path) -> None:
    """``locks/``, the store owner's alone (only they may take, and so hold up, its verbs);
    made by root in a user's store (one `sudo ksfs ...`), it is given to that user."""
    locks = store_path / "locks"
    with translate("make the session locks directory", locks):
        try:
            locks.mkdir(mode=0o700)
        except FileExistsError:
            require_store_dir(locks, store_path)
            return
        if os.geteuid() == 0:
            owner = os.stat(store_path)
            if owner.st_uid != 0:
                os.chown(locks, owner.st_uid, owner.st_gid)


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` locked (drop_session_lock may have
    unlinked it, and a newer holder lock a new file by that name)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def drop_session_lock(store_path: Path, session: str) -> None:
    """Unlink a removed session's lock file, holding that lock: waiters see it gone and take
    a new one (session_lock checks the name still names what it locked), so names used once
    do not leave a file each for ever."""
    with contextlib.suppress(OSError):  # the removal is done: a file left is only a file
        os.unlink(_lock_path(store_path, session))
