"""Verbs on a session's virtual machine: new, adopt, save, restore, fork, pause, resume, rm.

Each verb holds the session's verb lock, writes its events, and leaves either its whole effect
or none: a checkpoint exists only once the transaction with its record commits, and any failure
records a ``*.failed`` event with the reason while the guest keeps running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ksfs import progress
from ksfs.crashpoints import crash_point
from ksfs.errors import (
    AlreadyExists,
    BadInput,
    BadName,
    KsfsError,
    NotFound,
    NotPermitted,
    NotRunning,
    RecordCorrupt,
    StoppedWhileSaved,
)
from ksfs.keeper.locks import drop_session_lock, new_session_lock, session_lock
from ksfs.keeper.offline import _reason, _tell
from ksfs.ledger import auto_checkpoint_name
from ksfs.model import (
    DEFAULT_TRANSCRIPT,
    CheckpointRecord,
    Event,
    FileRecord,
    SessionRecord,
    TranscriptInfo,
    validate_name,
)
from ksfs.regularfile import read_store_file

log = logging.getLogger("ksfs.keeper")
MEMORY_FILE = "memory"


def disk_file_name(index: int, target: str) -> str:
    """The first disk is ``disk.raw``; others are ``disk-<target>.raw``."""
    return "disk.raw" if index == 0 else f"disk-{target}.raw"


def stored_disks(record: Any) -> dict[str, str] | None:
    """Disk target -> file name of each disk a machine's checkpoint stored, by its own domain
    XML; None when its files are not those (no XML: an imported checkpoint; or one taken by a
    ksfs that also stored read-only disks, so ``disk.raw`` may be another disk). By target,
    not position: a disk detached since would shift every later one onto another's file."""
    from ksfs.vm import domxml

    if not record.domain_xml:
        return None
    try:
        disks = domxml.disks(record.domain_xml)
    except KsfsError:
        return None
    names = {d.target: disk_file_name(i, d.target) for i, d in enumerate(disks)}
    stored = {f.name for f in record.files if f.name != MEMORY_FILE}
    return names if set(names.values()) == stored else None


def _check_guest_values(spec: dict[str, Any], where: str) -> None:
    """BadInput naming the key for a guest.json value of the wrong kind (QA: "512MiB" for
    memory_mib was an internal error, 0 silently the default); keys it does not know are left
    to the tools that wrote them."""
    for key, low, high in (("memory_mib", 16, 1 << 20), ("vcpus", 1, 64)):
        if key in spec:
            v = spec[key]
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise BadInput(f"{where} {key} must be a whole number from {low} to {high}, "
                               f"not {json.dumps(v)}")
    if "disk_format" in spec and spec["disk_format"] not in ("raw", "qcow2"):
        # (said, not probed past: a disk's stated format is the one it is taken in)
        raise BadInput(f"{where} disk_format must be \"raw\" or \"qcow2\", not "
                       f"{json.dumps(spec['disk_format'])[:80]}")
    for key in ("cmdline", "transcript"):
        if key in spec:
            v = spec[key]
            if not isinstance(v, str) or not v.strip() or "\n" in v or "\0" in v:
                raise BadInput(f"{where} {key} must be one non-empty line of text, not "
                               f"{json.dumps(v)[:80]}")


def transcript_in_guest(path: str, what: str = "--transcript") -> str:
    """The transcript's path inside the guest's filesystem as records keep it (no leading
    "/"); BadInput for one that cannot name a file there."""
    # (not a string: no parts to name a file; "" and "/" come out as one empty part)
    parts = path.lstrip("/").split("/") if isinstance(path, str) else [""]
    # (a trailing "/" names a directory: QA, "/agent/" was kept as the directory "agent")
    if any(p in ("", ".", "..") or "\n" in p or "\0" in p for p in parts):
        raise BadInput(f"{what} must name a file inside the guest's filesystem, like "
                       f"/agent/transcript.jsonl, not {json.dumps(path)[:80]}")
    return "/".join(parts)


BASE_CMDLINE = "console=ttyS0 panic=-1 quiet"


def store_holding(path: Path | str) -> Path | None:
    """The ksfs store ``path`` lies under (a directory with the store's marker), as the path
    is named or once its links are resolved (a store's ``vm/`` may be a link to another
    disk), else None."""
    from ksfs.cas.store import FORMAT, MARKER

    path = Path(path)
    for where in (path, path.resolve()):
        for d in where.parents:
            try:
                with open(d / MARKER, encoding="utf-8") as f:
                    marker = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(marker, dict) and marker.get("format") == FORMAT:
                return d
    return None


def default_cmdline(plan: Any, named: Path | str | None = None) -> str:
    """The kernel command line of a guest that names none: the serial console and, when the
    disk says where its root filesystem is, ``root=/dev/vda`` (one bare filesystem, as tools
    like virt-make-fs make it) or ``root=/dev/vdaN`` (the partition ksfs would read as the
    guest's files: a GPT root type, else a Linux one holding /etc, else the largest), and
    ``rw``. Without it a distro's initramfs finds no root and the kernel panics in a loop
    while the machine looks running (QA). An initramfs that is the whole guest (ours) ignores
    both. ``named``: the disk as the user gave it, when ``plan`` is the session's copy."""
    root = root_device(plan)
    if root is None:
        log.warning("nothing on the disk %s says where the guest's root filesystem is: the "
                    "kernel command line gets no root= (give one with --cmdline)",
                    named or plan.source)
        return BASE_CMDLINE
    return f"{BASE_CMDLINE} root={root} rw"


def root_device(plan: Any) -> str | None:
    """The guest's name for the root filesystem of disk ``plan`` (the first disk, vda), or None
    when nothing says (no filesystem; an image qemu must convert first: ``session new`` asks
    of the converted copy)."""
    from ksfs.guestfs import GuestFS
    from ksfs.guestfs.image import FileImageReader, find_filesystems

    if plan.convert is not None or plan.fmt not in ("raw", "qcow2"):
        return None
    try:
        opened: Any
        if plan.fmt == "raw":
            opened = reader = FileImageReader(plan.source)
        else:
            from ksfs.vm import ChainSource

            opened = ChainSource(Path(plan.source), f"reading the disk {plan.source}", "qcow2")
            reader = _SourceReader(opened)
        with contextlib.closing(opened):
            parts = find_filesystems(reader)
            try:
                fs = GuestFS.open(reader)
                part = next(p for p in parts if p.offset == fs.volume.offset)
                if part.role != "root" and not fs.holds(b"etc", directory=True):
                    return None  # a lone /boot beside an LVM root is no root (review)
            except (KsfsError, StopIteration):
                # not ext (a root of xfs or btrfs, which the kernel mounts as well)
                part = parts[0]
                if part.why or part.content not in ("xfs", "btrfs"):
                    return None
    except (OSError, KsfsError):
        return None
    if part.role not in ("root", "linux"):  # /home, /srv and the like are not a root
        return None
    return "/dev/vda" if part.number == 0 else f"/dev/vda{part.number}"


def _gone(rec: SessionRecord, adopted: bool, removing: Event | None = None) -> NotRunning:
    if removing is not None:
        # A `session rm` cut short once the machine went: recover would finish it, not make
        # the machine again (QA 2); a restore keeps the session (docs/reliability.md)
        return NotRunning(f"the machine of session {rec.name!r} is gone: the `session rm` "
                          f"begun at seq {removing.seq} was cut short after it destroyed it; "
                          f"`ksfs session rm {rec.name}` (or `ksfs recover`) finishes the "
                          f"removal, `ksfs restore {rec.name} CHECKPOINT` makes the machine "
                          f"again and keeps the session")
    # (recover makes again only a machine ksfs made: QA, eighteenth session)
    return NotRunning(f"the machine of session {rec.name!r} is gone: its domain {rec.domain} "
                      f"is not defined in libvirt; `ksfs restore {rec.name} CHECKPOINT`"
                      + ("" if adopted else " (or `ksfs recover`)") + " makes it again")


def checkpoint_label(lineage: str, record: CheckpointRecord) -> str:
    """The label a disk's chain root is given when it holds ``record``'s disks (the VM
    controller keeps it in ``state.json``): ``SESSION/NAME/LINEAGE:SEQ``. A name alone is no
    identity: a checkpoint deleted and saved again under its name, or a session removed and
    made again, gives the name to other disks (QA: a fork's save patched its changes into the
    parent's new ``base`` and stored a disk the guest never had). The lineage id is new for
    every session and a seq is never used twice in a lineage, so this names one checkpoint
    for ever. (Names cannot hold "/", so the parts split back unambiguously.)"""
    return f"{record.session}/{record.name}/{lineage}:{record.seq}"


def parse_label(label: str | None) -> tuple[str, str, str | None, int | None] | None:
    """(session, name, lineage, seq) of a chain root's label; lineage and seq None for a label
    written before labels carried them ("SESSION/NAME": a name, which cannot be verified);
    None for anything else (no checkpoint: "snap-N", "restore-N", nothing)."""
    if not isinstance(label, str):
        return None
    parts = label.split("/")
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1], None, None
    if len(parts) == 3 and all(parts[:2]):
        lineage, colon, seq = parts[2].rpartition(":")
        if colon and lineage and seq.isdigit():
            return parts[0], parts[1], lineage, int(seq)
    return None


def label_name(label: str | None) -> str | None:
    """``SESSION/NAME`` of a label, as the user names the checkpoint (status's running_from,
    and restores and recover matching it by name); a label that names none as it is."""
    parsed = parse_label(label)
    return f"{parsed[0]}/{parsed[1]}" if parsed is not None else label


def _controller(uri: str, workdir: Path) -> Any:
    """The keeper's VM controller: ksfs.vm's, whose ``holds_checkpoint`` says the checkpoint by
    name as it always did (``held_label`` gives the whole label, identity and all)."""
    from ksfs.vm import DomainController

    class KeeperController(DomainController):
        def holds_checkpoint(self, session: str) -> str | None:
            return label_name(super().holds_checkpoint(session))

        def held_label(self, session: str) -> str | None:
            return super().holds_checkpoint(session)

    return KeeperController(uri, workdir)


DOMAIN_PREFIX = "ksfs-"
# libvirt keeps a persistent domain in /etc/libvirt/qemu/NAME.xml, written through NAME.xml.new:
# with the prefix, a session name longer than this makes a file name over 255 bytes.
DOMAIN_NAME_MAX = 255 - len(".xml.new") - len(DOMAIN_PREFIX)


def domain_name_for(session: str) -> str:
    """The libvirt domain of a session ksfs makes; BadName when libvirt could not keep it."""
    if len(session.encode("utf-8")) > DOMAIN_NAME_MAX:
        raise BadName(name=session[:20] + "...",
                      why=f"a session with a machine needs a name of at most {DOMAIN_NAME_MAX} "
                          f"bytes (its domain {DOMAIN_PREFIX}NAME is a file name for libvirt)")
    return f"{DOMAIN_PREFIX}{session}"


class MachineVerbs:
    # --- plumbing ----------------------------------------------------------------------------

    @property
    def vm(self):
        """The libvirt controller, connected on first use (offline verbs never need it)."""
        if self._vm is None:
            uri = os.environ.get("KSFS_LIBVIRT_URI", "qemu:///system")
            self._vm = _controller(uri, self.store_path / "vm")
        return self._vm

    def _machine(self, session: str) -> SessionRecord:
        rec = self.ledger.session(session)
        if rec.removed is not None:
            raise NotPermitted(f"session {session!r} was removed; its checkpoints are read-only")
        if not rec.domain:
            raise NotPermitted(f"session {session!r} has no machine (it was made by import)")
        return rec

    def machine_state(self, session: str) -> str:
        rec = self.ledger.session(session)
        if not rec.domain:
            return "offline"
        try:
            return self.vm.state(rec.domain)
        except KsfsError:
            return "unknown"

    def default_guest(self) -> Path:
        """The guest template of ``mkdir sessions/NAME``: $KSFS_GUEST, else the store's config."""
        guest, where = os.environ.get("KSFS_GUEST"), "KSFS_GUEST"
        config = self.store_path / "config.json"
        if not guest:
            where = f"default_guest in {config}"
            try:
                settings = json.loads(read_store_file(config, self.store_path))
            except FileNotFoundError:
                settings = {}
            except (ValueError, UnicodeDecodeError) as exc:
                raise NotPermitted(f"{config} is not valid JSON ({exc}), so no default guest "
                                   "template can be read from it") from None
            guest = settings.get("default_guest") if isinstance(settings, dict) else None
        if not guest:
            raise NotPermitted(
                f"no default guest template is set: set KSFS_GUEST or default_guest in "
                f"{config} (tools/build-guest makes one)"
            )
        if not (Path(guest) / "guest.json").is_file():
            # Said as what it is (QA, fifteenth session: a mkdir under sessions/ answered
            # ENOENT with nothing in the log, as if the new name were missing).
            raise NotPermitted(f"the default guest template {guest} ({where}) is not a guest "
                               "directory (no guest.json)")
        return Path(guest)

    # --- creating, adopting, removing --------------------------------------------------------

    def new_session(
        self,
        name: str,
        guest: str | None = None,
        kernel: str | None = None,
        initrd: str | None = None,
        disk: str | None = None,
        memory: int | None = None,
        vcpus: int | None = None,
        cmdline: str | None = None,
        transcript: str | None = None,
        disk_format: str | None = None,
    ) -> SessionRecord:
        """Define and start domain ``ksfs-NAME`` from a guest directory or kernel/initrd/disk.

        The disk is taken in the format ``disk_format`` or guest.json's ``disk_format`` give,
        never in one qemu-img guesses from its first bytes (a raw disk holds what its guest
        wrote: QA, a qcow2 header naming a host file made that file the session's disk); it
        is probed only when nothing states it."""
        validate_name(name, "session name", new=True)
        self._refuse_taken_session(name)  # before the guest is looked for: the likelier slip
        if transcript is not None:
            transcript = transcript_in_guest(transcript)
        spec = self._guest_spec(guest, kernel, initrd, disk)
        memory = int(memory or spec.get("memory_mib") or 256)
        vcpus = int(vcpus or spec.get("vcpus") or 1)
        if not 16 <= memory <= 1 << 20 or not 1 <= vcpus <= 64:
            raise BadInput("memory must be 16 MiB to 1 TiB and vcpus 1 to 64")
        from ksfs.vm.files import FORMATS, begins_like_qcow2, inspect_disk

        domain = domain_name_for(name)
        said, stated = "the disk format given", disk_format
        if stated is None and "disk_format" in spec:
            said, stated = "guest.json's disk_format", spec["disk_format"]
        if stated is not None and stated not in FORMATS:
            raise BadInput(f"{said} must be raw or qcow2, not {json.dumps(stated)[:80]}")
        # an encrypted or foreign disk: refused before a record
        plan = inspect_disk(spec["disk"], stated)
        if stated == "raw" and begins_like_qcow2(spec["disk"]):
            # Taken as raw all the same, as qemu takes a disk whose format is given: a guest
            # may have written those bytes. Said, for a guest.json copied beside a qcow2 disk.
            log.warning("%s is \"raw\", so the disk %s is taken as raw, though it begins "
                        "like a qcow2 image: its guest sees those bytes as its disk (say "
                        "\"qcow2\" if it is one)", said, spec["disk"])
        if cmdline is not None and (not cmdline.strip() or "\n" in cmdline or "\0" in cmdline):
            raise BadInput("--cmdline must be one non-empty line")
        if cmdline is None and "cmdline" in spec:
            cmdline = spec["cmdline"]
        # Else asked of the session's copy once it is made: a qcow2 with compressed clusters
        # or a backing file is read only after its conversion (QA: it got no root=).
        cmdline_for = cmdline if cmdline is not None else \
            functools.partial(default_cmdline, named=spec["disk"])
        if self.vm.exists(domain):  # said before a lock file is made (bad input changes nothing)
            raise AlreadyExists(what="libvirt domain", name=domain)
        with new_session_lock(self.store_path, name, self._session_made(name)), \
                self.activity.doing(name, "session new"):
            if self.vm.exists(domain):  # (again under the lock: one defined meanwhile)
                raise AlreadyExists(what="libvirt domain", name=domain)
            config = {
                "guest": {k: spec[k] for k in ("kernel", "initrd", "disk") if spec.get(k)},
                "memory_mib": memory,
                "vcpus": vcpus,
                "transcript_path": transcript or transcript_in_guest(
                    spec.get("transcript", DEFAULT_TRANSCRIPT), "guest.json transcript"),
                "gateway_port": self.allocate_gateway_port(),
            }
            with self.store.env.begin(write=True) as txn:
                rec = self.ledger.create_session(txn, name, domain=domain, config=config)
            with self._undone_on_failure(name, domain):
                self.gateway_listens()
                progress.report("defining and starting the machine")
                self.vm.create(
                    name, domain, spec["kernel"], spec["initrd"], plan,
                    memory_mib=memory, vcpus=vcpus,
                    cmdline=cmdline_for,
                    extra_cmdline=f"ksfs.lineage={rec.lineage}", fw_cfg=self.guest_facts(rec),
                )
            return rec

    def _handed_back(self, name: str, plan: dict[str, Any]) -> list[str]:
        try:
            return self.vm.handed_back(name, plan)
        except KsfsError:
            return []

    def _refuse_taken_session(self, name: str) -> None:
        """AlreadyExists naming the session (not its libvirt domain) when the name is taken,
        also by a removed session whose checkpoints were kept."""
        try:
            self.ledger.session(name)
        except NotFound:
            return
        raise AlreadyExists(what="session", name=name)

    @contextlib.contextmanager
    def _undone_on_failure(self, name: str, domain: str | None = None) -> Iterator[None]:
        """A session whose machine could not be set up is forgotten again, files and all; the
        domain too when ksfs made it (never an adopted one: that is the user's)."""
        try:
            yield
        except BaseException:
            lineage = None
            with contextlib.suppress(KsfsError):
                lineage = self.ledger.session(name).lineage
            try:
                if domain is not None:  # only the one ksfs made (a user's may race it)
                    self.vm.destroy_and_undefine(domain, session=name, made=True)
                self.vm.remove_files(name)
            finally:
                if lineage is not None:
                    self.drop_token_file(lineage)  # written for its start (guest_facts)
                with self.store.env.begin(write=True) as txn:
                    self.ledger.remove_session(txn, name)
                drop_session_lock(self.store_path, name)  # held by the caller: safe to drop
            raise

    def _guest_spec(self, guest, kernel, initrd, disk) -> dict[str, Any]:
        """kernel, initrd and disk as absolute paths (plus the rest of a guest.json). Paths in
        a guest.json are relative to its directory; those given as options to the current
        directory. Refuses a bad spec before anything is made."""
        if kernel or initrd or disk:
            if guest or not (kernel and disk):
                raise BadInput("give --guest DIR, or --kernel and --disk (and --initrd, unless "
                               "the kernel mounts its root itself)")
            spec: Any = {"kernel": kernel, "initrd": initrd, "disk": disk}
            base = Path.cwd()
            where = "the guest's"
        else:
            gdir = Path(guest) if guest else self.default_guest()
            try:
                spec = json.loads((gdir / "guest.json").read_text())
            except FileNotFoundError:
                raise NotFound(f"{gdir} is not a guest directory (no guest.json)") from None
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadInput(f"{gdir}/guest.json is not valid JSON: {exc}") from None
            except OSError as exc:
                raise BadInput(f"{gdir}/guest.json cannot be read: "
                               f"{exc.strerror or exc}") from None
            if not isinstance(spec, dict):
                raise BadInput(f"{gdir}/guest.json is not a JSON object")
            base = gdir.resolve()
            where = f"{gdir}/guest.json:"
            missing = [k for k in ("kernel", "disk") if spec.get(k) in (None, "")]
            if missing:
                raise BadInput(f"{where} {', '.join(missing)} missing (each must name a file; "
                               f"a relative path is relative to {gdir})")
            if spec.get("initrd") in (None, ""):  # a kernel that mounts its root itself
                spec["initrd"] = None
            wrong = [k for k in ("kernel", "initrd", "disk")
                     if spec[k] is not None and not isinstance(spec[k], str)]
            if wrong:
                raise BadInput(f"{where} {', '.join(wrong)} must be a string naming a file, "
                               f"not {json.dumps(spec[wrong[0]])}")
            _check_guest_values(spec, where)
        for key in ("kernel", "initrd", "disk"):
            if key == "initrd" and not spec[key]:
                continue
            path = base / Path(spec[key]).expanduser()  # an absolute path stays as it is
            if path.exists() and not path.is_file():
                raise BadInput(f"{where} {key} {path} is not a regular file")
            if not path.is_file():
                raise NotFound(f"{where} {key} {path} does not exist")
            spec[key] = str(path.resolve())
        return spec

    def adopt_session(self, name: str, domain: str, transcript: str | None = None,
                      start: bool = True) -> SessionRecord:
        """Take an existing libvirt domain (file-backed raw or qcow2 disks) under ksfs;
        ``transcript``: where its guest writes the transcript (default DEFAULT_TRANSCRIPT);
        ``start``: start it when it is shut off (False leaves it so)."""
        if not isinstance(start, bool):
            raise BadInput(f"start must be true or false, not {start!r}")
        validate_name(name, "session name", new=True)
        transcript = transcript_in_guest(transcript) if transcript is not None \
            else DEFAULT_TRANSCRIPT
        # What is refused is refused before a lock file is made (bad input changes nothing);
        # the holder is looked for again in the write transaction below, one at a time.
        if not self.vm.exists(domain):
            raise NotFound(f"no libvirt domain named {domain!r}")
        self._refuse_kept_domain(domain)
        self._refuse_domain_of_a_store(domain)
        with new_session_lock(self.store_path, name, self._session_made(name)):
            if not self.vm.exists(domain):
                raise NotFound(f"no libvirt domain named {domain!r}")
            with self.store.env.begin(write=True) as txn:
                # In the write transaction (one at a time, across processes): two adopts of
                # one domain under two names cannot both see it free.
                self._refuse_kept_domain(domain, txn)
                rec = self.ledger.create_session(
                    txn, name, domain=domain, config={"transcript_path": transcript},
                    adopted=True,
                )
            with self._undone_on_failure(name):
                self.vm.adopt(name, domain, start=start)
            return rec

    def _refuse_kept_domain(self, domain: str, txn: Any = None) -> None:
        """AlreadyExists when a session keeps ``domain``: two sessions on one domain would
        commit into each other's disk chains, and removing either would destroy the other's
        machine."""
        holder = next((s.name for s in self.ledger.sessions(txn) if s.domain == domain), None)
        if holder is not None:
            raise AlreadyExists(f"domain {domain!r} is already kept by session {holder!r}")

    def _refuse_domain_of_a_store(self, domain: str) -> None:
        """AlreadyExists when a disk chain of ``domain`` holds a file under a ksfs store's
        directory (this one's too: a file of its ``vm/`` no session of it keeps): the domain
        is that store's (made by it, or adopted and saved by it), and two stores on one
        domain move each other's layers, and either's ``session rm`` destroys the other's
        machine (QA). A domain's name says nothing here: ``ksfs-NAME`` is a name any user may
        give, and a domain ksfs made runs on its store's files, which this finds."""
        for f in sorted(self.vm.chain_files(domain)):
            store = store_holding(f)
            if store is not None and store.resolve() == Path(self.store_path).resolve():
                raise AlreadyExists(
                    f"domain {domain!r} runs on {f}, a file of this store's machines that no "
                    f"session of it keeps; point the domain at files of its own first")
            if store is not None:
                raise AlreadyExists(
                    f"domain {domain!r} runs on {f}, a file of the ksfs store {store}, which "
                    f"keeps it (`ksfs --store {store} session list` names its session); a "
                    f"domain is kept by one store at a time: `session rm --release` there "
                    f"hands it back first")

    def _session_made(self, name: str) -> Any:
        """Whether session ``name`` exists (for new_session_lock: a refused verb that made
        none leaves no lock file)."""
        def made() -> bool:
            try:
                self.ledger.session(name)
            except NotFound:
                return False
            return True
        return made

    def remove_session(self, name: str, keep_checkpoints: bool = False,
                       release: bool = False, damaged: bool = False) -> dict[str, Any]:
        """Destroy and undefine the session's domain, remove its files under ``vm/NAME/`` and
        forget it (with ``keep_checkpoints``: keep its records, read-only). An adopted domain's
        disk files outside ``vm/NAME/`` stay; see docs/limits.md. With ``release`` (adopted
        sessions only) the domain is handed back instead: defined, in its state, on disk files
        of its own outside ``vm/NAME/`` (vm.release). With ``damaged``: forget a session whose
        record no longer decodes (``forget_damaged_session``)."""
        if damaged:
            if keep_checkpoints or release:
                raise BadInput("--damaged forgets a damaged record and nothing else: it takes "
                               "neither --keep-checkpoints nor --release")
            return self.forget_damaged_session(name)
        try:
            rec = self.ledger.session(name)
        except RecordCorrupt as exc:  # the one way out of it, said where it is met
            raise RecordCorrupt(why=f"{exc.fields.get('why')}; `ksfs session rm {name} "
                                "--damaged` forgets it") from None
        if release and (rec.domain is None or rec.removed is not None):
            raise BadInput(f"session {name} has no machine to release")
        detached: dict[str, dict[str, str]] = {}
        with session_lock(self.store_path, name):
            adopted = bool(rec.domain) and rec.removed is None and self._adopted(name)
            plan = None
            begun = self._removal_begun(name) if rec.domain and rec.removed is None else None
            if begun is not None and begun.body.get("release") is not None:
                # A release killed part way (recover not run yet): carried out as it was
                # planned, whatever this call asked; destroying would take back the machine
                # it may already have handed back.
                plan, keep_checkpoints = begun.body["release"], bool(
                    begun.body.get("keep_checkpoints"))
            elif release:
                if not self._adopted(name):
                    raise BadInput(f"--release hands back a domain the session adopted; the "
                                   f"machine of {name} was made by ksfs (plain `session rm` "
                                   f"removes it)")
                # (its events go with the session: the result says them too)
                detached = self._hand_back_detached(rec)
                plan = self.vm.release_plan(name, rec.domain)  # refused: nothing changed yet
            intent = rec.domain is not None and rec.removed is None and begun is None
            if intent:
                # Said first: a removal killed after the machine went is finished by recover,
                # which would otherwise boot the machine again (or, for a release, finishes it).
                body: dict[str, Any] = {"keep_checkpoints": keep_checkpoints}
                if plan is not None:
                    body["release"] = plan
                self.ledger.record(name, "session.removing", body)
            steps: dict[str, bool] = {}
            try:
                released = self._remove_locked(rec, keep_checkpoints, plan, steps)
            except BaseException as exc:
                # Failed and said so: the session stays the user's (a machine destroyed on the
                # way is brought back by recover from its last checkpoint). Except once a
                # release handed the machine back: its disks are the user's files now, so
                # the removal stays open and recover (or the next session rm) finishes it.
                # A disk handed back is the user's file now: the release cannot be undone, so
                # the removal stays open and recover (or the next session rm) finishes it (QA,
                # eighteenth session: one disk handed back, the rest not, was "remove_failed",
                # the session the user's again, and its next save copied that disk out again)
                partly = self._handed_back(name, plan) if plan is not None else []
                handed_back = plan is not None and (steps.get("machine_gone") or partly)
                if (intent or begun is not None) and not handed_back:
                    with contextlib.suppress(KsfsError):
                        self.ledger.record(name, "session.remove_failed",
                                           {"reason": _reason(exc)})
                if partly or (steps.get("machine_gone") and not isinstance(exc, KsfsError)):
                    # QA (eighteenth session): "aborted" alone left a listed session whose
                    # machine was gone, or partly handed back
                    what = "destroyed" if plan is None else "handed back" \
                        if steps.get("machine_gone") else \
                        f"partly handed back (disks {', '.join(partly)})"
                    _tell(exc, f"the machine of session {name} is {what}, but the session is "
                               f"still listed: `ksfs session rm {name}` again finishes it")
                raise
            if not keep_checkpoints:  # last, still holding it: the name is free now
                drop_session_lock(self.store_path, name)
        out: dict[str, Any] = {"session": name, "removed": True,
                               "kept_checkpoints": keep_checkpoints}
        if adopted and steps.get("destroyed"):
            # the user's own domain went with it: said (QA, eighteenth session: one forgot
            # --release and was told "removed session" alone)
            out["destroyed_domain"] = rec.domain
        if plan is not None:
            out["released"] = {"domain": rec.domain, "disks": released}
            # Undefined by its user while ksfs held it: handed back as it is, and said (QA,
            # eighteenth session: "kept", then gone at its next shutdown). The removal is
            # done: a look that fails changes nothing of it.
            with contextlib.suppress(KsfsError):
                if released and self.vm.transient(rec.domain):
                    out["released"]["transient"] = True
            if detached:
                out["released"]["detached_disks"] = detached
        return out

    def _remove_locked(self, rec: SessionRecord, keep_checkpoints: bool,
                       release: dict[str, Any] | None = None,
                       steps: dict[str, bool] | None = None) -> dict[str, str]:
        released: dict[str, str] = {}
        if rec.domain and rec.removed is None:
            if release is not None:
                progress.report("handing the machine back on its own disks")
                released = self.vm.release(rec.name, rec.domain, release)
            else:
                destroyed = self.vm.destroy_and_undefine(rec.domain, session=rec.name)
                if steps is not None:
                    steps["destroyed"] = destroyed
            if steps is not None:
                steps["machine_gone"] = True  # destroyed, or handed back
            crash_point("session.remove")
        if rec.domain:
            # Kept checkpoints keep the kernel and initrd their forks boot from; a later
            # removal without --keep-checkpoints takes those too.
            self.vm.remove_files(rec.name, keep_boot=keep_checkpoints)
            self.drop_token_file(rec.lineage)
            crash_point("session.remove.files")
        with self.store.env.begin(write=True) as txn:
            self.ledger.remove_session(txn, rec.name, keep_checkpoints=keep_checkpoints)
        self.checkpoint_changed(rec.name, None)
        return released

    def forget_damaged_session(self, name: str) -> dict[str, Any]:
        """Forget session ``name`` whose record no longer decodes (one damaged record stops
        every verb that lists sessions, gc included): its record goes, and with it the
        checkpoint records and events of the lineage that names it. Its machine, if it had one,
        is left as it is: the record that named its domain is what is lost, and a domain is
        destroyed only on a record's word (docs/limits.md). ``machine_files``: its directory
        under ``vm/``, left for its owner to look at and remove."""
        with session_lock(self.store_path, name):
            with self.store.env.begin(write=True) as txn:
                lineage = self.ledger.forget_damaged_session(txn, name)
        self.checkpoint_changed(name, None)
        left = self.store_path / "vm" / name
        left_str = str(left) if left.is_dir() and not left.is_symlink() else None
        log.warning("session %s: its damaged record is forgotten%s%s", name,
                    "" if lineage else " (no lineage names it: its checkpoint records and "
                    "events, if any, are left to `ksfs ledger verify`)",
                    f"; its machine is left as it was: its files are in {left_str}, and "
                    "`virsh list --all` shows its domain" if left_str else "")
        return {"session": name, "forgotten": True, "lineage": lineage,
                "machine_files": left_str}

    def list_sessions(self, include_removed: bool = False) -> list[dict[str, Any]]:
        """Every live session's status; with ``include_removed`` also those removed with their
        checkpoints kept (their names stay taken)."""
        return [self.status(s.name)
                for s in self.ledger.sessions(include_removed=include_removed)]

    def ping(self) -> str:
        return "pong"

    # --- pause and resume --------------------------------------------------------------------

    def pause(self, session: str) -> dict[str, Any]:
        rec = self._machine(session)
        with session_lock(self.store_path, session):
            if self.vm.state(rec.domain) == "paused" and self._paused_by_user(session):
                # Nothing to do; a machine paused otherwise (virsh, a killed verb) gets the
                # event, so recover knows the user wants it paused.
                return {"session": session, "state": "paused", "seq": None}
            self.vm.pause(rec.domain, session)
            ev = self.ledger.record(session, "pause", {"domain": rec.domain})
        return {"session": session, "state": "paused", "seq": ev.seq}

    def resume(self, session: str) -> dict[str, Any]:
        rec = self._machine(session)
        with session_lock(self.store_path, session):
            state = self.vm.state(rec.domain)
            if state == "running" and not self._paused_by_user(session):
                return {"session": session, "state": "running", "seq": None,  # nothing to do
                        "booted": False, "woken": False}
            if state == "absent":
                # (QA: libvirt's own lookup error was all the user got)
                raise _gone(rec, self._adopted(session), self._removal_begun(session))
            self.vm.resume(rec.domain, fw_cfg=self.guest_facts(rec))  # (if it starts)
            body: dict[str, Any] = {"domain": rec.domain}
            if state == "pmsuspended":
                body["woken"] = True  # from its memory: suspended to RAM by the guest
            elif state not in ("paused", "running"):
                # Started from its disks, memory fresh: said, not taken for an unpause (QA,
                # eighteenth session: after a restore left it shut off, `resume` looked as if
                # it brought back the state the restore's save-first holds).
                body["booted"] = True
            ev = self.ledger.record(session, "resume", body)
        return {"session": session, "state": "running", "seq": ev.seq,
                "booted": body.get("booted", False), "woken": body.get("woken", False)}

    # --- save -----------------------------------------------------------------------------------

    def save(self, session: str, name: str | None = None, live: bool = True,
             lineage: str | None = None) -> CheckpointRecord:
        """An atomic checkpoint of the running machine; see docs/architecture.md. ``live``:
        copy memory while the guest runs (short pause); False pauses it for the whole copy
        (a guest dirtying memory faster than the copy, or one that must not run meanwhile).
        ``lineage``: the session the caller means (a mount's directory): NoSuchSession when
        the session by that name is another now, checked under its lock."""
        if not isinstance(live, bool):
            raise BadInput(f"live must be true or false, not {live!r}")
        validate_name(session, "session name")
        if name is not None:
            validate_name(name, "checkpoint name", new=True)
        rec = self._machine(session)
        with session_lock(self.store_path, session), \
                self.activity.doing(session, "save", checkpoint=name):
            self._require_lineage(session, lineage)
            # A restore killed after libvirt took its files (no daemon ran recover since):
            # finished first, so the log says where the machine came from and the save builds
            # on its chain.
            self._finish_killed_restore(rec)
            state = self.vm.state(rec.domain)
            if state not in ("running", "paused"):
                # Refused before its checkpoint.begin: no begin and failed for each refusal
                # (QA, eighteenth session). A disk the user detached meanwhile is given back
                # all the same: its writes are theirs, whatever becomes of the machine.
                self._hand_back_detached(rec)
                if state == "absent":
                    raise _gone(rec, self._adopted(session), self._removal_begun(session))
                raise NotRunning(session=session, state=state)
            return self._save_locked(rec, name, reason="save", live=live)

    def _hand_back_detached(self, rec: SessionRecord) -> dict[str, dict[str, str]]:
        """Before a save, restore, recover or release: a disk the user detached from an adopted
        machine while its writes were in ksfs's layers is given back first (vm.detached), and
        the log says where its bytes went. Raises (nothing removed) when it cannot be."""
        if not rec.domain:
            return {}

        def said(target: str, where: dict[str, str]) -> None:  # each as soon as it is done
            self.ledger.record(rec.name, "disk.handed_back", {"target": target, **where})

        return self.vm.hand_back_detached(rec.name, rec.domain, said)

    def _save_locked(self, rec: SessionRecord, name: str | None, reason: str,
                     live: bool = True) -> CheckpointRecord:
        session = rec.name
        self._hand_back_detached(rec)
        begin, name = self._begin_checkpoint(session, name, reason)
        frozen = None
        try:
            # The last host event when the guest froze: events after it (a model call that
            # finished during a live copy) are not in this checkpoint's machine state.
            frozen_at: list[int] = []
            progress.report("taking the snapshot")
            frozen = self.vm.snapshot(
                session, rec.domain, live=live,
                on_freeze=lambda: frozen_at.append(self.ledger.last_seq(session)))
            # (the last: a snapshot of a paused guest may be taken twice, see vm.checkpoint)
            record = self._ingest_frozen(rec, name, begin.seq, frozen,
                                         frozen_at[-1] if frozen_at else None)
        except BaseException as exc:
            if frozen is not None:
                try:
                    self.vm.abort(frozen)
                except KsfsError:
                    pass
            self._record_failure(session, name, exc, begin.seq)
            raise
        try:
            self.vm.finish(frozen, checkpoint=checkpoint_label(rec.lineage, record))
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM: not without the news it is there
            log.warning("%s: checkpoint %s/%s was published; only the folding of its layer was "
                        "cut short (the next save or `ksfs recover` finishes it)",
                        _reason(exc), session, name)
            raise
        except KsfsError as exc:
            # The checkpoint is published; only the chain stays one layer longer, and the next
            # save reads that layer as changed since the previous finished checkpoint.
            log.warning("checkpoint %s/%s published, but flattening its layer failed: %s",
                        session, name, exc)
            # Its open files and memory image go now (QA: a daemon kept the frozen layers open,
            # and a restore's deleting them pinned their space until it stopped).
            with contextlib.suppress(KsfsError):
                self.vm.abort(frozen)
        return record

    def _begin_checkpoint(self, session: str, name: str | None, reason: str
                          ) -> tuple[Event, str]:
        """Record ``checkpoint.begin``; returns it and the checkpoint's name (``name``, else
        c_ and the begin's seq). Called under the session lock, so the names are stable."""
        taken = set(self.ledger.checkpoint_names(session))
        if name is not None and name in taken:
            raise AlreadyExists(what="checkpoint", name=f"{session}/{name}")
        begin = self.ledger.record(session, "checkpoint.begin", {"name": name, "reason": reason})
        return begin, name or auto_checkpoint_name(begin.seq, taken)

    def _save_stopped_disks(self, rec: SessionRecord, reason: str) -> CheckpointRecord:
        """A checkpoint of the disks of the session's machine, which is not running (shut off,
        crashed): what it wrote since its last checkpoint, kept before anything replaces it.
        It has no memory: a restore or fork of it boots its disks."""
        session = rec.name
        self._hand_back_detached(rec)
        begin, name = self._begin_checkpoint(session, None, reason)
        frozen = None
        try:
            latest = self.ledger.latest_checkpoint(session)  # a gone machine's definition
            frozen = self.vm.stopped(session, rec.domain,
                                     xml_if_gone=latest.domain_xml if latest else None)
            return self._ingest_frozen(rec, name, begin.seq, frozen, None)
        except BaseException as exc:
            self._record_failure(session, name, exc, begin.seq)
            raise
        finally:
            if frozen is not None:
                frozen.close()

    def _ingest_frozen(self, rec: SessionRecord, name: str, seq: int, frozen,
                       frozen_seq: int | None = None):
        """Store the frozen memory and disks, then publish the record in one transaction."""
        session = rec.name
        base = self._base_checkpoint(frozen.base_checkpoint)
        ingested: list[tuple[str, Any]] = []  # (file name, IngestedFile)
        bytes_read = 0  # from the frozen disk layers (allocated data; zero clusters cost nothing)
        base_read = 0  # stored bytes of the disks' base chunks read back to patch changes
        memory_base_read = 0  # the old versions the memory's deltas were made against
        with self.store.ingest() as ingest:
            if frozen.memory_path is not None:  # else the disks of a stopped machine
                prev_memory = base.file(MEMORY_FILE) if base is not None else None
                f = ingest.add_file(str(frozen.memory_path), chunking="cdc",
                                    like=prev_memory.manifest if prev_memory else None,
                                    progress=_stepper("storing the memory"))
                memory_base_read = f.base_bytes_read
                ingested.append((MEMORY_FILE, f))
            for i, disk in enumerate(frozen.disks):
                fname = disk_file_name(i, disk.target)
                # the base's own file of this disk (not of whichever disk was i-th then)
                prev_name = (stored_disks(base) or {}).get(disk.target) if base else None
                prev = base.file(prev_name) if prev_name else None
                # Without the changed ranges (the disk's chain was rebuilt outside ksfs, e.g.
                # by a virsh blockcopy) the whole disk is read, and a base alone means nothing.
                changed = disk.changed if prev is not None else None
                before = disk.source.bytes_read
                f = ingest.add_file(disk.source, chunking="fixed",
                                    base=prev.manifest if prev and changed is not None else None,
                                    changed=changed, progress=_stepper(f"storing disk {fname}"))
                bytes_read += disk.source.bytes_read - before
                base_read += f.base_bytes_read
                ingested.append((fname, f))
            transcript, unreadable = self._read_frozen_transcript(rec, frozen)
            progress.report("publishing the checkpoint")
            ingest.seal()
            if frozen.memory_path is not None and self.vm.went_down(rec.domain):
                # Its memory may hold a guest past a power-off request that QEMU acted on
                # after the snapshot; restored, it would never finish powering off. Refused
                # rather than published: the machine is down, and what its disks hold is kept
                # by the next restore's save-first.
                raise StoppedWhileSaved(session=session)
            parent = self._built_on(rec)
            with self.store.env.begin(write=True) as txn:
                ingest.commit(txn)
                # the figures once committed: a chunk an import committed first (the same new
                # data stored at once) is its, not this checkpoint's
                files = tuple(FileRecord(fname, f.manifest, f.size, ingest.stored(f),
                                         f.chunking, f.digest) for fname, f in ingested)
                record = CheckpointRecord(
                    session=session, name=name, seq=seq, created=time.time(), files=files,
                    parent=parent, domain_xml=frozen.xml,
                    transcript_seq=_seen_seq(transcript),
                    frozen_seq=frozen_seq,
                )
                self.ledger.put_checkpoint(txn, record)
                body = self._published_body(record)
                body.update(paused_s=round(frozen.paused_s, 4),
                            snapshot_s=round(frozen.snapshot_s, 4), disk_bytes_read=bytes_read,
                            base_bytes_read=base_read, memory_base_bytes_read=memory_base_read,
                            incremental=base is not None)
                if frozen.pause_forced:
                    body["pause_forced"] = True  # the guest dirtied memory faster than the copy
                if frozen.memory_path is None:
                    body["disks_only"] = True  # a stopped machine's disks: nothing to run from
                elif not frozen.live:
                    body["live"] = False  # paused for the whole memory copy (save --no-live)
                self.ledger.append(txn, session, "checkpoint.published", body)
                if unreadable is not None:
                    # Said, not swallowed (QA: a damaged line gave transcript_seq null with no
                    # word anywhere, and every restore of it then reconciled "unrecorded").
                    self.ledger.append(txn, session, "fs.unreadable", {
                        "checkpoint": name, "what": "transcript", "why": unreadable[:1000]})
        crash_point("record.commit")
        self.checkpoint_changed(session, name)
        if unreadable is not None:
            log.warning("checkpoint %s/%s was stored, but the guest's transcript in it could not "
                        "be read, so it records no transcript seq: %s", session, name,
                        unreadable)
            return SavedCheckpoint(**{f.name: getattr(record, f.name)
                                      for f in dataclasses.fields(record)},
                                   transcript_unreadable=unreadable)
        return record

    def _built_on(self, rec: SessionRecord) -> str | None:
        """The checkpoint the machine being saved went on from: the last one the session
        published or restored to (so, after a restore, its target, not the restore's own
        save-first: review), deleted since or not; before any, a fork's ``SESSION/CHECKPOINT``
        it was forked from."""
        latest = self.ledger.latest_checkpoint(rec.name)
        last = latest.name if latest else None
        for ev in self.ledger.events(rec.name, latest.seq + 1 if latest else 0):
            if ev.type == "checkpoint.published" and ev.body.get("name"):
                last = ev.body["name"]
            elif ev.type == "restore.done" and ev.body.get("checkpoint"):
                last = ev.body["checkpoint"]
        if last is None and rec.parent is not None:
            return f"{rec.parent.session}/{rec.parent.checkpoint}"
        return last

    def _holds_exactly(self, session: str, checkpoint: str) -> bool:
        """Whether ``session``'s machine's chain root holds its checkpoint ``checkpoint`` itself,
        not one that had the name before (a label of an older ksfs, a name alone, by name)."""
        parsed = parse_label(getattr(self.vm, "held_label", self.vm.holds_checkpoint)(session))
        if parsed is None or parsed[:2] != (session, checkpoint):
            return False
        if parsed[2] is None:
            return True
        record, owner = self._labelled(session, checkpoint)
        return record is not None and (parsed[2], parsed[3]) == (owner, record.seq)

    def _labelled(self, session: str, name: str) -> tuple[CheckpointRecord | None, str | None]:
        """What a chain root's label is checked against: the checkpoint now named ``name`` in
        ``session`` and the lineage the session has now, each None when gone."""
        try:
            owner = self.ledger.session(session).lineage
        except NotFound:
            return None, None
        try:
            return self.ledger.checkpoint(session, name), owner
        except NotFound:
            return None, owner

    def _base_checkpoint(self, label: str | None) -> CheckpointRecord | None:
        """The checkpoint a frozen disk's changed ranges are relative to, when it is still
        stored and is the very one the label names (its session's lineage and its seq), else
        None: the ingest then reads the whole disk. A checkpoint found by name alone may be
        another that took the name since (the parent's ``rm base; save base``, or a parent
        session removed and made again whose c_0001 is the fork's c_0001): its disk patched
        with this interval's changes is a disk the guest never had (QA, critical). A label of
        an older ksfs (a name alone) cannot be verified: read whole once, the next is exact."""
        parsed = parse_label(label)
        if parsed is None:
            return None
        session, name, lineage, seq = parsed
        record, owner = self._labelled(session, name)
        if record is not None and lineage == owner and record.seq == seq:
            return record
        log.info("the disks were last at checkpoint %s/%s%s, which %s: the save reads them "
                 "whole", session, name, "" if lineage is None else f" (seq {seq})",
                 "is gone" if record is None else "is another now" if lineage is not None
                 else "cannot be told from one of that name made since (an older label)")
        return None

    def _fork_point(self, rec: SessionRecord) -> CheckpointRecord | None:
        """The checkpoint a fork was made from, when it still exists and is that very one
        (the parent's lineage and the seq the fork point records), else None: a checkpoint
        that took its name since, in the parent or in a session made again under the parent's
        name, is not it."""
        point = rec.parent
        if point is None:
            return None
        try:
            record = self.ledger.checkpoint(point.session, point.checkpoint)
            owner = self.ledger.session(point.session).lineage
        except NotFound:
            return None
        if record.seq != point.seq or (point.lineage and owner != point.lineage):
            return None
        return record

    def _frozen_transcript(self, rec: SessionRecord, frozen) -> TranscriptInfo | None:
        """The guest's transcript as the frozen disks hold it, or None (none there, or it
        could not be read: see _read_frozen_transcript)."""
        return self._read_frozen_transcript(rec, frozen)[0]

    def _read_frozen_transcript(self, rec: SessionRecord, frozen
                                ) -> tuple[TranscriptInfo | None, str | None]:
        """(the guest's transcript as the frozen disks hold it, None), on the first disk, and
        the partition of it, whose filesystem holds the transcript's path (as guest_disk
        chooses for fs/ and diff: the root need not be the first disk or the first partition);
        (None, None) when no disk holds it; (None, why) when one holds it and it cannot be
        read (a damaged line, a directory by its name)."""
        from ksfs.guestfs import GuestFS, read_transcript

        path = self.transcript_path(rec.name)
        for disk in frozen.disks:
            try:
                fs = GuestFS.open(_SourceReader(disk.source), holding=path)
                if not fs.holds(path):
                    continue
            except KsfsError:
                continue  # a data disk, or one this cannot read
            try:
                return read_transcript(fs, path), None
            except KsfsError as exc:
                why = str(exc)
                return None, (why if path in why else f"transcript {path}: {why}")
        return None, None


def _stepper(step: str):
    """An ingest's (done, total) callback reporting ``step``, or None when nobody listens."""
    sink = progress.current()
    if sink is None:
        return None
    return lambda done, total: progress.report(step, done, total, sink=sink)


def _seen_seq(transcript: TranscriptInfo | None) -> int | None:
    """The transcript seq a checkpoint records: its last line's; -1 for a transcript that is
    there but has no whole line yet (as reconcile counts an empty one), so a restore of a
    checkpoint taken before the guest's first line is consistent, not "unrecorded"; None when
    none was read."""
    if transcript is None:
        return None
    return -1 if transcript.last_seq is None else transcript.last_seq


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint(CheckpointRecord):
    """What a save returns when it has news beyond its record: ``transcript_unreadable``, why
    the guest's transcript in it could not be read (the record's transcript_seq is None; an
    ``fs.unreadable`` event says it in the log). A key of the save's result (``--json``) only
    when set; the ledger stores the plain record."""

    transcript_unreadable: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if d.get("transcript_unreadable") is None:
            d.pop("transcript_unreadable", None)
        return d


class _SourceReader:
    """Adapts a frozen disk source (``pread``) to the reader shape guestfs takes (``read``)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.size = source.size

    def read(self, offset: int, n: int) -> bytes:
        return self.source.pread(offset, n)

