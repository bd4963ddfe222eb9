"""Reach the running mount daemon through its control socket (plain sockets, no trio).

``call_daemon`` returns ``NO_DAEMON`` when no daemon listens, so the caller does the work itself
under the same locks; a daemon that answers with an error raises it as a KsfsError with the same
exit code.

The store may be writable by a user other than the one running ksfs (root on a user's store):
``daemon.sock`` is connected to only when it is a socket itself, never through a symbolic link
(StoreDamaged, exit 6), and whatever answers is believed only in the protocol's shape
(DaemonError, exit 13, one line; security QA F13: a planted socket's answer was a traceback,
and a link to libvirtd's socket had ksfs write its request there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ksfs.daemon.protocol import (
    READING_VERBS,
    SOCKET_NAME,
    RemoteError,
    check_verb,
    encode,
    not_a_socket,
    unix_address,
)
from ksfs.errors import BadInput, DaemonError, DaemonTimeout

if TYPE_CHECKING:
    import socket

NO_DAEMON = object()
log = logging.getLogger("ksfs.daemon")

# A daemon asked with "alive" says so at once and every server.ALIVE_EVERY seconds while the
# verb runs, so silence means its loop is stuck or stopped, not that the verb is long (a save
# of a big machine takes minutes). Silent this long: said on stderr, once; this long: given up.
NOTICE_AFTER = 2.0
# No reply line of a ksfs daemon comes near this (a session list of thousands is some MB): a
# server at daemon.sock that never ends its line is not buffered without end.
MAX_LINE = 64 << 20
SILENCE_MAX = 30.0
# How long a caller waits through silence instead, for a host where a daemon may stall longer
# (a loaded machine) or a script that wants to know sooner: seconds, a number > 0.
SILENCE_ENV = "KSFS_DAEMON_SILENCE"


def silence_max() -> float:
    """SILENCE_MAX, or the seconds $KSFS_DAEMON_SILENCE gives; BadInput when it gives none."""
    said = os.environ.get(SILENCE_ENV)
    if said is None or said == "":
        return SILENCE_MAX
    try:
        seconds = float(said)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise BadInput(f"{SILENCE_ENV} must be a number of seconds > 0, not {said!r}")
    return seconds


def socket_path(store_path: str | Path) -> Path:
    return Path(store_path) / SOCKET_NAME


def daemon_pid(store_path: str | Path) -> int | None:
    """The pid the store's daemon wrote into its lock file (``daemon.lock``), if it says one."""
    try:
        pid = json.loads((Path(store_path) / "daemon.lock").read_bytes()[:4096]).get("pid")
    except (OSError, ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None


class _Silent(Exception):
    pass


class _NotAReply(Exception):
    """What came back is not the protocol's (its argument says what it was)."""


def _open_socket_file(path: Path) -> int | None:
    """An O_PATH descriptor of the control socket at ``path``, None when there is none;
    StoreDamaged when anything but a socket is there. The descriptor is what is connected to
    (through /proc), so a link put there after this look is not followed either."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # none, or no store to look in: the verb run here says what is wrong
        return None
    mode = os.fstat(fd).st_mode
    if stat.S_ISSOCK(mode):
        return fd
    os.close(fd)
    raise not_a_socket(path, mode)


def _address(fd: int, path: Path) -> contextlib.AbstractContextManager[str]:
    via = f"/proc/self/fd/{fd}"
    # without /proc (never on a normal system): the path, looked at a moment ago
    return contextlib.nullcontext(via) if os.path.exists(via) else unix_address(path)


def call_daemon(store_path: str | Path, verb: str, timeout: float = 600.0,
                progress: Callable[[str, int | None, int | None], None] | None = None,
                **args: Any) -> Any:
    """Run ``verb`` in the daemon of ``store_path``; NO_DAEMON when there is none.

    The daemon says it is alive while the verb runs: after NOTICE_AFTER seconds without a word
    from it, stderr says that this waits for it (once); after ``timeout`` seconds (at most
    ``silence_max()``), DaemonTimeout (exit 14). With ``progress``, the daemon's progress lines for
    the verb are handed to it as they come."""
    check_verb(verb)
    limit = min(timeout, silence_max())
    path = socket_path(store_path)
    fd = _open_socket_file(path)
    if fd is None:
        return NO_DAEMON
    # here, not at the top: most commands find no daemon, and the import is 3 ms of each
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(limit)
    begun = False  # the daemon took the request: it runs the verb whatever this side does
    what = verb.replace("_", " ")
    try:
        try:
            with _address(fd, path) as address:
                sock.connect(address)
        except (ConnectionRefusedError, FileNotFoundError):
            return NO_DAEMON  # a stale socket of a daemon that died: work locally
        finally:
            os.close(fd)
        request: dict[str, Any] = {"verb": verb, "args": args, "alive": True}
        if progress is not None:
            request["progress"] = True

        def notice() -> None:
            pid = daemon_pid(store_path)
            log.warning("waiting for the daemon%s to answer %s (nothing from it for %g s) ...",
                        f" (pid {pid})" if pid else "", what, NOTICE_AFTER)

        def heard() -> None:
            nonlocal begun
            begun = True

        try:
            sock.sendall(encode(request))
            reply = _read_reply(sock, progress, limit, notice, heard)
        except KeyboardInterrupt:
            # QA: Ctrl-C or SIGTERM here said "terminated" while the daemon, which has no
            # way to be called back, went on and finished the verb (a whole restore).
            if verb not in READING_VERBS:
                log.warning("the mount daemon finishes the %s it had begun; this command only "
                            "stops waiting for it", what)
            raise
        except TimeoutError:
            raise
        except OSError as exc:  # reset or hung up on: no answer, said as one (F13)
            raise DaemonError(f"the daemon's control socket {path} broke off when asked to "
                              f"{what}: {exc.strerror or exc}{_maybe_done(verb, what)}"
                              ) from None
        except DaemonError as exc:  # closed with no answer (the daemon died, kill -9)
            # (QA, thirty-fourth session: a save the daemon published just before it died was
            # said as failed, and nothing said it might have been done)
            raise DaemonError(f"{exc} when asked to {what}{_maybe_done(verb, what)}") from None
        why = _not_a_reply(reply)
        if why:
            raise _NotAReply(why)
    except (TimeoutError, _Silent):
        pid = daemon_pid(store_path)
        who = f"the daemon (pid {pid})" if pid else "the daemon"
        more = "" if verb in READING_VERBS else (
            f"; it may still finish the {what} it had begun" if begun else
            f"; the {what} was sent, and a daemon that comes back may still run it")
        dump = f" (`kill -USR1 {pid}` writes its threads' stacks to its log)" if pid else ""
        raise DaemonTimeout(
            f"{who} of {store_path} said nothing for {limit:g} s when asked to "
            f"{what}: it is stuck or stopped{dump}; see "
            f"{Path(store_path) / 'daemon.log'}{more}") from None
    except _NotAReply as exc:
        raise DaemonError(f"the daemon's control socket {path} answered {what} with {exc}: "
                          "that is no reply of a ksfs daemon") from None
    finally:
        sock.close()
    for said in reply.get("warnings") or ():  # logged here as the verb logged them there
        log.warning("%s", said)
    if not reply["ok"]:
        raise RemoteError(reply)
    return reply.get("result")


def _maybe_done(verb: str, what: str) -> str:
    """What a verb that got no answer may still have done (nothing, for one that only reads)."""
    if verb in READING_VERBS:
        return ""
    return (f"; the {what} may have been done before it stopped (`ksfs events SESSION` says "
            "whether it was)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _not_a_reply(reply: dict[str, Any]) -> str | None:
    """What in the verb's reply line is not as protocol.py defines it, if anything (the
    fields an older daemon leaves out may be missing)."""
    if not isinstance(reply.get("ok"), bool):
        return '"ok" neither true nor false'
    warnings = reply.get("warnings")
    if warnings is not None and not (isinstance(warnings, list)
                                     and all(isinstance(w, str) for w in warnings)):
        return "warnings that are not lines of text"
    if reply["ok"]:
        return None
    for name in ("error", "message"):
        if not isinstance(reply.get(name, ""), str):
            return f"an error whose {name} is not text"
    # 1..125: an error's code; never 0 (a failure said as success) nor a signal's
    code = reply.get("exit_code", 1)
    if not _is_int(code) or not 0 < code < 126:
        return f"an error whose exit code is {code!r}"
    if not _is_int(reply.get("errno", 5)) or reply.get("errno", 5) < 0:
        return f"an error whose errno is {reply.get('errno')!r}"
    return None


def _read_reply(sock: socket.socket, progress: Callable[..., None] | None, limit: float,
                notice: Callable[[], None], heard: Callable[[], None]) -> dict[str, Any]:
    """The verb's reply line, handing progress lines before it to ``progress`` and skipping
    the daemon's "alive" lines. ``notice()`` once after NOTICE_AFTER seconds of silence;
    _Silent after ``limit`` seconds of it."""
    buf = bytearray()
    last = time.monotonic()
    noticed = limit <= NOTICE_AFTER  # a caller's short wait (a courtesy call) says nothing
    while True:
        scanned = 0  # the bytes of buf already looked through for the line's end
        while (end := buf.find(b"\n", scanned)) < 0:
            scanned = len(buf)
            if scanned > MAX_LINE:
                raise _NotAReply(f"a line longer than {MAX_LINE >> 20} MiB")
            silent = time.monotonic() - last
            if silent >= limit:
                raise _Silent
            until = limit if noticed else NOTICE_AFTER
            sock.settimeout(max(until - silent, 0.01))
            try:
                part = sock.recv(65536)
            except TimeoutError:
                if not noticed and time.monotonic() - last >= NOTICE_AFTER:
                    noticed = True
                    notice()
                continue
            if not part:
                raise DaemonError("the daemon closed the control socket without answering")
            buf += part
            last = time.monotonic()
            heard()
        line = bytes(buf[:end])
        del buf[: end + 1]
        try:
            message = json.loads(line)
        except ValueError:  # (undecodable bytes too)
            raise _NotAReply("a line that is not JSON") from None
        if not isinstance(message, dict):
            raise _NotAReply(f"JSON that is not an object ({type(message).__name__})")
        if "alive" in message:
            continue
        if "progress" not in message:
            return message
        step = message["progress"]
        if not (isinstance(step, dict) and isinstance(step.get("step", ""), str)
                and all(v is None or _is_int(v) for v in (step.get("done"), step.get("total")))):
            raise _NotAReply("a progress line of another shape")
        if progress is not None:
            progress(step.get("step", ""), step.get("done"), step.get("total"))
