"""The one error family of ksfs.

Every error ksfs raises on purpose is a ``KsfsError``. Each class carries the errno the mount
answers with and the exit code the command line ends with, and its docstring is its message
template (filled from the keyword arguments given to the constructor), as borg does it.
Lower-layer errors (lmdb, libvirt, OSError) are translated at each layer's boundary with
``translate`` into the most specific class here. This module does no I/O.
"""

from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterator


class KsfsError(Exception):
    """{message}"""

    errno: int = _errno.EIO
    exit_code: int = 1

    def __init__(self, message: str | None = None, **fields: object) -> None:
        self.fields = fields
        if message is None:
            template = (type(self).__doc__ or "{message}").strip().splitlines()[0]
            try:
                message = template.format(**fields)
            except (KeyError, IndexError):
                message = template
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.message


# --- bad input: exit 2, EINVAL -------------------------------------------------------------


class BadInput(KsfsError):
    """{message}"""

    errno = _errno.EINVAL
    exit_code = 2


class BadName(BadInput):
    """invalid name {name!r}: {why}"""


# --- things that are not there: exit 3, ENOENT ---------------------------------------------


class NotFound(KsfsError):
    """{message}"""

    errno = _errno.ENOENT
    exit_code = 3


class NoSuchSession(NotFound):
    """no session named {session!r}"""


class NoSuchCheckpoint(NotFound):
    """session {session!r} has no checkpoint named {checkpoint!r}"""


class NoSuchFile(NotFound):
    """{what} not found: {name}"""


# --- things that are already there: exit 4, EEXIST -----------------------------------------


class AlreadyExists(KsfsError):
    """{what} {name!r} already exists"""

    errno = _errno.EEXIST
    exit_code = 4


# --- the store itself: exit 5 ----------------------------------------------------------------


class NotAStore(KsfsError):
    """{path} is not a ksfs store ({why})"""

    errno = _errno.ENOTDIR
    exit_code = 5


class IntegrityError(KsfsError):
    """{message}"""

    errno = _errno.EIO
    exit_code = 6


class ChunkCorrupt(IntegrityError):
    """chunk {chunk} is damaged ({why})"""


class ChunkMissing(IntegrityError):
    """chunk {chunk} is missing from the store"""


class ManifestCorrupt(IntegrityError):
    """manifest {manifest} is damaged or missing ({why})"""


class GuestFSUnreadable(IntegrityError):
    """guest filesystem cannot be read: {why}"""


class ChunkerUnavailable(KsfsError):
    """{message}"""

    errno = _errno.ELIBBAD
    exit_code = 7


class Busy(KsfsError):
    """{message}"""

    errno = _errno.EBUSY
    exit_code = 8


class NoSpace(KsfsError):
    """no space left for the store at {path}: {why}"""

    errno = _errno.ENOSPC
    exit_code = 9


# --- the virtual machine: exit 10 ------------------------------------------------------------


class VMError(KsfsError):
    """{message}"""

    errno = _errno.EIO
    exit_code = 10


class NotRunning(VMError):
    """the machine of session {session!r} is not running"""

    errno = _errno.ESRCH


# --- the gateway: exit 11 -------------------------------------------------------------------


class BudgetExceeded(KsfsError):
    """session {session!r} is over its budget: {why}"""

    errno = _errno.EDQUOT
    exit_code = 11


class UpstreamError(KsfsError):
    """upstream model provider failed: {why}"""

    errno = _errno.EIO
    exit_code = 11


# --- the mount and daemon: exit 12 -----------------------------------------------------------


class ReadOnly(KsfsError):
    """{what} is read-only"""

    errno = _errno.EROFS
    exit_code = 12


class NotPermitted(KsfsError):
    """{message}"""

    errno = _errno.EPERM
    exit_code = 12


class DaemonError(KsfsError):
    """{message}"""

    errno = _errno.EIO
    exit_code = 13


@contextlib.contextmanager
def translate(what: str, path: object = "") -> Iterator[None]:
    """Re-raise OSError from the block as the most specific ksfs error, naming ``what``.

    KsfsError passes through untouched; anything else is a bug and propagates as it is.
    """
    try:
        yield
    except KsfsError:
        raise
    except OSError as exc:
        if exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
            raise NoSpace(path=path or exc.filename, why=f"{what}: {exc.strerror}") from exc
        if exc.errno == _errno.ENOENT:
            raise NoSuchFile(what=what, name=str(exc.filename or path)) from exc
        raise KsfsError(f"{what} failed: {exc.strerror or exc}") from exc
