"""Per-session bookkeeping of the controller and its records: what a checkpoint hands over.

``workdir/<session>/state.json`` remembers, per disk, the root file of the overlay chain (the
file that holds the content of the last finished or restored checkpoint) and that checkpoint's
label, so the next snapshot knows which clusters changed since then. Also the ``Frozen`` and
``FrozenDisk`` records. No libvirt here.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ksfs.errors import StoreDamaged, VMError
from ksfs.regularfile import read_store_file
from ksfs.vm.chain import ChainSource


@dataclass
class DiskState:
    root: str  # the bottom file ksfs tracks (the session's copy, a restored base, an adopted disk)
    root_fmt: str
    base_checkpoint: str | None = None  # label of the checkpoint ``root`` holds, if any
    # A commit of frozen layers into ``root`` that finish() began and has not recorded the
    # end of: {"label": the checkpoint root holds once it is done, "layers": [files]}; see
    # checkpoint.settle_commits.
    committing: dict | None = None
    # The overlay the machine ran on after the last save or restore (its writes since go
    # there), and the root's (dev, ino, size, mtime_ns) then: how vm.detached tells a disk
    # detached with writes in ksfs's layer, and whether its user's file changed since.
    top: str | None = None
    root_stat: list | None = None
    # A hand-back of this disk under way (vm.detached): {"top": the layer, "tmp": a copy's
    # temporary file, if any}: a commit killed part way is done again, not taken for a user's
    # change, and a killed copy's temporary file is removed even by a plain session rm.
    handing_back: dict | None = None

    @property
    def running_file(self) -> tuple[str, str]:
        """(file, format) the machine last ran this disk on: its overlay, else the root."""
        return (self.top, "qcow2") if self.top else (self.root, self.root_fmt)


@dataclass
class SessionState:
    domain: str
    disks: dict[str, DiskState] = field(default_factory=dict)
    counter: int = 0  # numbers the files a session's snapshots and restores create
    adopted: bool = False
    # A restore between handing its files to libvirt and recording them in ``disks``:
    # {"label", "bases": {target: path}, "overlays": {target: path}}; see restore.settle.
    pending: dict | None = None
    # An adopted domain's own disks as it was adopted: target -> [file, format]; where
    # ``session rm --release`` puts a disk that a restore replaced (vm.release).
    origins: dict[str, list[str]] = field(default_factory=dict)
    # The UUID of the domain this session's machine is: ksfs destroys a domain of the session's
    # name only when it is this one, never a user's domain that took the name (a fork racing a
    # `virsh define` destroyed the user's). None in a state.json from before it.
    uuid: str | None = None

    def next_number(self) -> int:
        self.counter += 1
        return self.counter


# (the fields a later one is written beside only while it has a value: a state.json without
# them stays readable by a ksfs from before them)
FIELDS_V1 = ("root", "root_fmt", "base_checkpoint")


def file_stat(path: str | Path) -> list | None:
    """(dev, ino, size, mtime_ns) of a file, None when it cannot be looked at."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def load_state(path: Path) -> SessionState | None:
    try:
        data = json.loads(read_store_file(path, path.parent))
    except FileNotFoundError:
        return None
    except StoreDamaged:  # a link (never followed) or a FIFO (never waited on) in its place
        raise VMError(f"controller state {path} is not a regular file") from None
    except (OSError, ValueError) as exc:
        raise VMError(f"controller state {path} is unreadable: {exc}") from exc
    disks = {t: DiskState(**d) for t, d in data.get("disks", {}).items()}
    return SessionState(data["domain"], disks, data.get("counter", 0), data.get("adopted", False),
                        data.get("pending"), data.get("origins", {}), data.get("uuid"))


def save_state(path: Path, state: SessionState) -> None:
    data = {
        "domain": state.domain,
        "counter": state.counter,
        "adopted": state.adopted,
        "disks": {t: {k: v for k, v in vars(d).items() if k in FIELDS_V1 or v is not None}
                  for t, d in state.disks.items()},
    }
    if state.pending is not None:
        data["pending"] = state.pending
    if state.origins:
        data["origins"] = state.origins
    if state.uuid is not None:
        data["uuid"] = state.uuid
    write_whole_file(path, (json.dumps(data, indent=1) + "\n").encode())


def write_whole_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, fsynced, through a new temporary file beside it. The
    temporary file is made with O_EXCL (mkstemp): a link planted at a fixed temporary name
    in a store its user writes had root truncate and write the file it named."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass
class FrozenDisk:
    """One disk of a checkpoint: the frozen layer chain as a random-access source.

    ``changed`` lists the (offset, length) guest ranges written since ``Frozen.base_checkpoint``
    (allocated in a layer above the root), or is None when the whole image must be read.
    """

    target: str
    size: int
    source: ChainSource
    changed: list[tuple[int, int]] | None
    top: str  # the frozen top file
    root: str  # the file the frozen layers commit into at finish
    layers: list[str]  # frozen files above ``root`` (top first), deleted after the commit


@dataclass
class Frozen:
    """A checkpoint taken but not yet finished: memory image, domain XML and frozen disks.

    ``xml`` is the domain XML held in the memory image's header (the definition at the snapshot
    instant, its disk sources naming the frozen chain). Valid until ``finish`` or ``abort``.
    """

    session: str
    domain: str
    token: str
    memory_path: Path | None  # None: the disks of a stopped machine (no memory to save)
    xml: str
    disks: list[FrozenDisk]
    base_checkpoint: str | None  # what ``changed`` is relative to; None with changed=None
    paused_s: float = 0.0  # how long the guest was paused inside the snapshot call
    snapshot_s: float = 0.0  # wall time of the snapshot call
    pause_forced: bool = False  # a live copy ran past LIVE_COPY_LIMIT and the guest was paused
    live: bool = True  # the memory was copied while the guest ran (False: paused throughout)
    finished: bool = False

    def disk(self, target: str) -> FrozenDisk:
        for d in self.disks:
            if d.target == target:
                return d
        raise VMError(f"checkpoint of {self.domain} has no disk {target!r}")

    def close(self) -> None:
        for d in self.disks:
            d.source.close()


@dataclass(frozen=True)
class Restored:
    """What restore and fork hand back: the paused domain and the new chain roots."""

    domain: str
    session: str
    disks: dict[str, str]  # target -> the materialized base file (root of the new chain)
    base_checkpoint: str
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step, for benches
