"""One step of a libvirt operation: translate what fails inside it into a VMError.

libvirt, OS and subprocess errors leave every ksfs.vm entry point as one VMError sentence naming
the domain and the step. Also silences libvirt's default printing of every error to stderr.
Must never swallow an error.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator

import libvirt

from ksfs.errors import NoSpace, VMError


def _quiet_libvirt(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; ours become VMErrors instead."""


libvirt.registerErrorHandler(_quiet_libvirt, None)


@contextlib.contextmanager
def step(domain: str, what: str) -> Iterator[None]:
    """Re-raise libvirt, OS and subprocess failures of one step as a VMError naming both."""
    try:
        yield
    except VMError:
        raise
    except libvirt.libvirtError as exc:
        msg = exc.get_error_message()
        if "No space left on device" in (msg or ""):
            # libvirt reports a full disk only in its text; say so with NoSpace (exit 9).
            raise NoSpace(f"no space left on device: {what} of domain {domain} failed: "
                          f"{msg}") from exc
        raise VMError(f"{what} of domain {domain} failed: {msg}") from exc
    except subprocess.CalledProcessError as exc:
        err = (exc.stderr or b"").decode(errors="replace").strip()[-300:] if isinstance(
            exc.stderr, bytes) else str(exc.stderr or "").strip()[-300:]
        raise VMError(f"{what} of domain {domain} failed: {err or exc}") from exc
    except subprocess.SubprocessError as exc:
        raise VMError(f"{what} of domain {domain} failed: {exc}") from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"no space left on device: {what} of domain {domain} failed: "
                          f"{exc.strerror}") from exc
        raise VMError(f"{what} of domain {domain} failed: {exc.strerror or exc}") from exc
