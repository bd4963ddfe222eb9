"""Opening the store's lock files (``lock``, ``seal.lock``, ``locks/*.lock``) and the daemon's
log, and reading its small files (the marker, a session's state, the config).

A lock file in another shape than a regular file is damage, said in one line: a directory gave
"open the store lock failed: Is a directory" (exit 1), and a dangling symbolic link "not found"
(exit 3), where the store's other damage is exit 6. A symbolic link is never followed: O_CREAT
would make a file wherever it points (as root, anywhere). O_NONBLOCK: a FIFO in its place must
not hold the open until some writer comes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ksfs.errors import StoreDamaged

_NOT_A_FILE = {errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENXIO}


def open_lock_file(path: str | os.PathLike, store: str | os.PathLike, flags: int,
                   mode: int) -> int:
    """A descriptor of the lock file at ``path`` (made when missing, ``mode``), opened with
    ``flags`` (O_RDONLY or O_RDWR); StoreDamaged when something else is in its place. Any
    other OSError is the caller's to translate."""
    return open_store_file(path, store, flags, mode, "lock file")


def open_store_file(path: str | os.PathLike, store: str | os.PathLike, flags: int, mode: int,
                    what: str) -> int:
    """As ``open_lock_file``, for any file of the store ksfs makes and writes (``what`` names
    it in the damage's one line: "lock file", "daemon log"). The descriptor is non-blocking."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     mode)
    except OSError as exc:
        if exc.errno not in _NOT_A_FILE:
            raise
        raise StoreDamaged(path=store, why=_why(Path(path), what)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreDamaged(path=store, why=_why(Path(path), what))
        if st.st_nlink != 1:  # (security QA F18: O_NOFOLLOW does not see a hard link, and
            # the daemon's lock is truncated and written)
            raise StoreDamaged(path=store, why=hard_linked(path, st.st_nlink, what))
    except BaseException:
        os.close(fd)
        raise
    return fd


def hard_linked(path: str | os.PathLike, names: int, what: str) -> str:
    """Why a store file ksfs writes is damage when it has more names than its own."""
    return (f"its {what} {path} is a hard link ({names} names): it may be another file, so "
            "ksfs leaves it alone; remove it (ksfs makes it again)")


def _why(path: Path, what: str) -> str:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return (f"{path.parent} is not a directory, so its {what} {path.name} cannot be made "
                f"there: remove {path.parent} (ksfs makes it again)")
    except OSError as exc:
        return f"its {what} {path} cannot be opened: {exc.strerror}"
    return f"its {what} {path} is {file_kind(st.st_mode)}: remove it (ksfs makes it again)"


def read_store_file(path: str | os.PathLike, store: str | os.PathLike) -> bytes:
    """The bytes of the small store file at ``path`` (a marker, a state, a config), read
    without following a symbolic link and without waiting on a FIFO; StoreDamaged when
    something other than a regular file is there. FileNotFoundError (a missing file) and any
    other OSError are the caller's to translate."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno not in _NOT_A_FILE:
            raise
        raise StoreDamaged(path=store, why=_why_file(Path(path))) from None
    # (the file's kind before fdopen: that refuses a directory itself, with an error naming
    # the descriptor, "[Errno 21] Is a directory: 3": issue #2 review)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreDamaged(path=store, why=_why_file(Path(path)))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _why_file(path: Path) -> str:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be opened: {exc.strerror}"
    return f"{path} is {file_kind(st.st_mode)}"


def not_a_directory(path: str | os.PathLike) -> str | None:
    """What stands at ``path`` instead of a directory of its own ("a symbolic link", "not a
    directory"); None when it is one, or nothing is there. Other OSErrors are the caller's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    return "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"


def require_store_dir(path: str | os.PathLike, store: str | os.PathLike) -> None:
    """StoreDamaged when ``path`` (a directory of the store that ksfs makes when missing:
    ``locks``, ``guest-tokens``) is there as anything but a directory of its own. A link
    there would have files made and deleted wherever it points (security QA F12, F17)."""
    try:
        shape = not_a_directory(path)
    except OSError as exc:
        raise StoreDamaged(path=store, why=f"{path} cannot be looked at: {exc.strerror}") \
            from None
    if shape:
        raise StoreDamaged(path=store, why=f"{path} is {shape}: remove it (ksfs makes it "
                           "again)")


def is_store_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def file_kind(mode: int, otherwise: str = "not a regular file") -> str:
    """What a store file that is not what ksfs made there is, for its damage's message."""
    return ("a directory" if stat.S_ISDIR(mode) else
            "a symbolic link" if stat.S_ISLNK(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else otherwise)
