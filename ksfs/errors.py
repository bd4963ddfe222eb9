"""The one error family of ksfs.

Every error ksfs raises on purpose is a ``KsfsError``. Each class carries the errno the mount
answers with and the exit code the command line ends with, and its docstring is its message
template (filled from the keyword arguments given to the constructor), as borg does it.
Lower-layer errors (lmdb, libvirt, OSError) are translated at each layer's boundary with
``translate`` into the most specific class here. This module does no I/O but one: asking how
much space a store's file system has left, to tell a full disk behind LMDB's EIO.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, as Ctrl-C's KeyboardInterrupt is (the command line
    installs the handler): a verb ends as it ends on Ctrl-C (an import's checkpoint marked
    failed with reason "terminated", its session taken back), not killed with its work half
    said. Not a KsfsError: like Ctrl-C, it is no error of the verb's. SIGHUP (the terminal
    closed) is taken the same way; ``signum`` says which came."""

    def __init__(self, signum: int = 15) -> None:
        super().__init__(signum)
        self.signum = signum


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


class CheckpointGone(NotFound):
    """{what}: checkpoint {checkpoint!r} of {session!r} was deleted and collected while open"""

    errno = _errno.ESTALE  # as NFS answers for a file handle whose file is gone


class NoSuchFile(NotFound):
    """{what} not found: {name}"""


class NoSuchAttribute(NotFound):
    """{path} has no extended attribute {name!r}"""

    errno = _errno.ENODATA  # what getxattr(2) answers for an absent attribute


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


class StoreDamaged(IntegrityError):
    """the store at {path} is damaged: {why}"""


class ChunkCorrupt(IntegrityError):
    """chunk {chunk} is damaged ({why})"""


class ChunkMissing(IntegrityError):
    """chunk {chunk} is missing from the store"""


class ManifestCorrupt(IntegrityError):
    """manifest {manifest} is damaged or missing ({why})"""


class RecordCorrupt(IntegrityError, ValueError):
    """a ledger record is damaged: it no longer decodes ({why})"""

    # also a ValueError: the ledger's readers and its verify, which catch undecodable values
    # as ValueError to report them one by one, keep doing so


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

    def __init__(self, message: str | None = None, **fields: object) -> None:
        super().__init__(message, **fields)
        if message is None and "session" in fields:
            s = fields["session"]
            # (QA, nineteenth session: a machine its guest suspended to RAM was told resume
            # boots it, where resume wakes it from its memory)
            if fields.get("state") == "pmsuspended":
                hint = f"its guest suspended it to RAM; `ksfs resume {s}` wakes it"
            else:
                crashed = "its guest crashed; " if fields.get("state") == "crashed" else ""
                hint = (f"{crashed}`ksfs resume {s}` boots it from its disks; "
                        f"`ksfs restore {s} CHECKPOINT` keeps its disks as a checkpoint first")
            self.message = f"{self.message} ({hint})"
            self.args = (self.message,)

    errno = _errno.ESRCH


class StoppedWhileSaved(NotRunning):
    """the machine of session {session!r} stopped while it was being saved"""

    def __init__(self, **fields: object) -> None:
        super().__init__(None, **fields)
        s = fields["session"]
        self.message = (f"the machine of session {s!r} stopped while it was being saved (its "
                        f"guest powered off or crashed, or it was destroyed): no checkpoint was "
                        f"made (`ksfs resume {s}` boots it from its disks)")
        self.args = (self.message,)


# --- exit 11 is not used: the gateway answers its guest over HTTP (402, 502, ...), and a
# command about it fails with one of the classes here (QA, eighteenth session: two classes
# for it were never raised).


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


class DaemonTimeout(DaemonError):
    """{message}"""

    # A wait for the mount's daemon ran out: it did not answer a verb, or still held its store
    # after `ksfs umount` unmounted it. Apart from 13 so a script can wait longer or look.
    errno = _errno.ETIMEDOUT
    exit_code = 14


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
        raise from_os_error(exc, what, path) from exc


def from_os_error(exc: OSError, what: str, path: object = "") -> KsfsError:
    """The ksfs error for an OSError met while doing ``what`` (see ``translate``)."""
    if exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
        return NoSpace(path=path or exc.filename, why=f"{what}: {exc.strerror}")
    if exc.errno == _errno.ENOENT:
        return NoSuchFile(what=what, name=str(exc.filename or path))
    if exc.errno == _errno.EROFS:
        return ReadOnly(what=str(exc.filename or path))
    if exc.errno in (_errno.EACCES, _errno.EPERM):
        return NotPermitted(f"{what} failed: {exc.strerror} ({exc.filename or path})")
    return KsfsError(f"{what} failed: {exc.strerror or exc}")


# LMDB's own classes (by name: this module imports no storage library) that mean the index's
# bytes are damaged, not that an operation failed. IncompatibleError: a named database's record
# that no longer reads as one (ksfs opens each with the flags it was made with);
# CursorFullError: a B-tree deeper than LMDB allows (pages that point back up); ProblemError:
# a page's contents LMDB cannot use. (Not BadTxnError, which a bug can cause: a database root
# past the file, which LMDB reports as that, is refused when the store opens.)
_LMDB_DAMAGE = {"CorruptedError", "PageNotFoundError", "InvalidError", "BadRslotError",
                "VersionMismatchError", "BadChecksumError", "IncompatibleError",
                "CursorFullError", "ProblemError"}
# What the last line of defence turns into a ksfs error; any other errno escaping every layer
# is a bug and keeps its traceback.
_FOREIGN_ERRNOS = {_errno.ENOSPC, _errno.EDQUOT, _errno.EACCES, _errno.EPERM, _errno.EROFS}
# LMDB reports a write its full disk cut short as EIO (mdb_page_flush: a short pwrite has no
# errno): an EIO with less than this free where the store lives is a full disk, not a bad one.
# A commit writes its dirty pages at once, so a few MiB can be missing and the rest still free.
NEARLY_FULL_BYTES = 8 << 20


def _free_bytes(where: object) -> int | None:
    try:
        st = os.statvfs(os.fspath(where))  # type: ignore[arg-type]
    except (OSError, TypeError, ValueError):  # not a path ("the store"), or gone
        return None
    # root (the daemon, LMDB under it) writes into the reserved blocks too
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def from_foreign(exc: BaseException, where: object = "the store",
                 what: str = "an index operation") -> KsfsError | None:
    """The ksfs error for an error a lower library raised past its layer's ``translate``, or
    None when it is not one ksfs knows (a bug, to be reported as one).

    The last line of defence of the command line and the daemon: a damaged LMDB index is
    damage (exit 6), a full disk is NoSpace, a refused permission is NotPermitted, a read-only
    filesystem ReadOnly; never a traceback for those. Anything else stays a bug.
    """
    if isinstance(exc, KsfsError):
        return exc
    if isinstance(exc, OSError):
        if exc.errno not in _FOREIGN_ERRNOS:
            return None
        return from_os_error(exc, "a file operation", where)
    if type(exc).__module__ == "lmdb":  # ``what``: what was being done with the index
        text = str(exc)
        if "No space" in text or type(exc).__name__ == "MapFullError":
            return NoSpace(path=where, why=f"{what}: {text}")
        # (before "Permission denied", which LMDB's text for a write on a read-only
        # environment also says: a store on a read-only file system is opened read-only, and
        # a write transaction on it is refused before any file is touched. py-lmdb raises
        # ReadonlyError for any EACCES, so the class alone says nothing.)
        if "Read-only file system" in text or "read-only environment" in text:
            return ReadOnly(what=f"the file system of the store at {where}")
        if "Permission denied" in text:
            return NotPermitted(f"the index of {where} cannot be opened: permission denied")
        if "Input/output error" in text:
            free = _free_bytes(where)
            if free is not None and free < NEARLY_FULL_BYTES:
                return NoSpace(path=where, why=f"{what}: {text} with {free} bytes left on its "
                               "file system (LMDB reports a write a full disk cut short as EIO)")
        if type(exc).__name__ in _LMDB_DAMAGE or _damage_said(exc, text):
            return IntegrityError(f"the index of {where} is damaged ({text.rstrip('.')}); "
                                  "its packs are "
                                  "untouched: restore the index from a backup")
        return KsfsError(f"{what} failed in the LMDB index at {where}: {text}")
    return None  # (a ledger record that no longer decodes is damage raised by ledger.keys)


def _damage_said(exc: BaseException, text: str) -> bool:
    """LMDB errors of a general class whose words say damage (QA, thirty-fourth session: one
    flipped byte each, both exit 1 with LMDB's words). A meta page whose format number is
    garbage is "LMDB data format vN is not supported" (a plain lmdb.Error). A read that meets a
    damaged page fails the transaction, and py-lmdb's cursor then reports MDB_BAD_TXN: from a
    read (mdb_get, mdb_cursor_get) that is damage, as no ksfs read goes on after a failure;
    from a write it can be a bug, and stays a plain error."""
    if "LMDB data format" in text and "not supported" in text:
        return True
    return type(exc).__name__ == "BadTxnError" and text.startswith(
        ("mdb_get:", "mdb_cursor_get:", "mdb_stat:", "mdb_cursor_count:"))
