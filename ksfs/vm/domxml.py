"""Domain XML: the definition of a new guest and the few rewrites checkpoints need.

Pure text-to-text functions over libvirt domain XML (ElementTree); no libvirt calls, no I/O.
Rewrites touch only what they name (disk sources, name, UUID, MACs, serial log path, the
kernel command line's ``ksfs.lineage=``); everything else in a definition is kept as it is, so a
user's own domain loses nothing. Must never guess at devices it does not understand.
"""

from __future__ import annotations

import contextlib
import random
import re
import uuid as uuidlib
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from ksfs.errors import VMError


@dataclass(frozen=True)
class DiskInfo:
    """One file-backed disk of a domain: its target, current top file, format and chain below."""

    target: str
    source: str
    fmt: str
    backing: tuple[str, ...]  # the chain below ``source``, nearest first, as libvirt knows it


def new_domain_xml(
    name: str,
    domain_type: str,
    kernel: Path,
    initrd: Path | None,
    disk: Path,
    disk_format: str,
    memory_mib: int,
    vcpus: int,
    cmdline: str,
    console_log: Path,
) -> str:
    """The definition of a fresh direct-kernel-boot guest: one virtio disk, user-mode virtio net."""
    mac = random_mac()
    initrd_line = f"\n    <initrd>{escape(str(initrd))}</initrd>" if initrd else ""
    return f"""<domain type={quoteattr(domain_type)}>
  <name>{escape(name)}</name>
  <uuid>{uuidlib.uuid4()}</uuid>
  <memory unit='MiB'>{int(memory_mib)}</memory>
  <currentMemory unit='MiB'>{int(memory_mib)}</currentMemory>
  <vcpu>{int(vcpus)}</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{escape(str(kernel))}</kernel>{initrd_line}
    <cmdline>{escape(cmdline)}</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type={quoteattr(disk_format)} cache='none' discard='unmap'/>
      <source file={quoteattr(str(disk))}/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <interface type='user'>
      <mac address='{mac}'/>
      <model type='virtio'/>
    </interface>
    <serial type='file'>
      <source path={quoteattr(str(console_log))} append='on'/>
      <target port='0'/>
    </serial>
    <console type='file'>
      <source path={quoteattr(str(console_log))} append='on'/>
      <target type='serial' port='0'/>
    </console>
    <rng model='virtio'>
      <backend model='random'>/dev/urandom</backend>
    </rng>
    <memballoon model='none'/>
  </devices>
</domain>
"""


def random_mac() -> str:
    return "52:54:00:" + ":".join(f"{random.randrange(256):02x}" for _ in range(3))


_XMLNS = re.compile(r"""xmlns:([A-Za-z_][\w.-]*)\s*=\s*["']([^"']+)["']""")


def _parse(xml: str) -> ET.Element:
    # ElementTree writes namespaces back as ns0:, ns1:...; a user's <metadata> (or libvirt's
    # qemu: command line) must come back with the prefixes it was written with.
    for prefix, uri in _XMLNS.findall(xml):
        with contextlib.suppress(ValueError):  # ns0-style prefixes are ElementTree's own
            ET.register_namespace(prefix, uri)
    try:
        return ET.fromstring(xml)
    except ET.ParseError as exc:
        raise VMError(f"domain XML does not parse: {exc}") from exc


def domain_name(xml: str) -> str:
    el = _parse(xml).find("name")
    return el.text if el is not None and el.text else ""


def disks(xml: str) -> list[DiskInfo]:
    """The disks ksfs keeps, in definition order: every writable disk (or lun), which must be a
    file. Cdroms, floppies and read-only disks are left out (the guest cannot change
    them: snapshots mark them ``snapshot='no'`` and restores attach the file the checkpoint
    named; a writable floppy is refused at adoption, ``refuse_unkept_writable``); a writable
    disk that is not a file, or that other machines write too (``<shareable/>``), cannot be
    snapshotted and is refused with what to do about it."""
    root = _parse(xml)
    out = []
    for disk in root.iterfind("devices/disk"):
        if disk.get("device") in ("cdrom", "floppy") or disk.find("readonly") is not None:
            continue
        target = disk.find("target")
        source = disk.find("source")
        if target is None:
            continue
        dev, name = target.get("dev", ""), root.findtext("name") or "?"
        fix = (f": detach it (virsh detach-disk {name} {dev}, with --live and --config as "
               f"it is attached) or attach it read-only")
        if disk.get("type") != "file" or source is None or not source.get("file"):
            raise VMError(f"disk {dev} of domain {name} is not a plain file (type="
                          f"{disk.get('type')!r}); ksfs keeps only file-backed raw or qcow2 "
                          f"disks{fix}")
        if disk.find("shareable") is not None:
            raise VMError(f"disk {dev} of domain {name} is shareable (<shareable/>): other "
                          f"machines may write it, so no snapshot of this one can hold it{fix}")
        driver = disk.find("driver")
        fmt = driver.get("type", "raw") if driver is not None else "raw"
        chain = []
        node = disk.find("backingStore")
        while node is not None:
            src = node.find("source")
            if src is None or not src.get("file"):
                break
            chain.append(src.get("file"))
            node = node.find("backingStore")
        out.append(DiskInfo(dev, source.get("file", ""), fmt, tuple(chain)))
    return out


def refuse_unkept_writable(xml: str) -> None:
    """VMError naming the first device the guest can write that no checkpoint would hold: a
    floppy without ``<readonly/>`` (``disks`` leaves floppies out, as images the guest cannot
    change; a writable one it can: a restore would not roll it back, and a fork would open the
    parent's file for writing beside it, which QEMU's image lock refuses). Said at adoption:
    a definition ksfs makes has none."""
    root = _parse(xml)
    name = root.findtext("name") or "?"
    for disk in root.iterfind("devices/disk"):
        if disk.get("device") != "floppy" or disk.find("readonly") is not None:
            continue
        source = disk.find("source")
        path = source.get("file") or source.get("dev") if source is not None else None
        if not path:
            continue  # an empty drive: nothing to write
        target = disk.find("target")
        dev = target.get("dev", "") if target is not None else ""
        raise VMError(f"floppy {dev} of domain {name} ({path}) is writable: ksfs keeps no "
                      f"floppy in its checkpoints, so a restore would not roll it back; make "
                      f"it read-only (<readonly/> in its <disk>, virsh edit {name}) or attach "
                      f"the image as a disk")


def transient_disks(xml: str) -> list[str]:
    """Targets of the disks ksfs would keep (writable) that are ``<transient/>``: QEMU throws
    their writes away when the machine stops, and libvirt runs no snapshot or block job on
    them, so every save of such a domain fails (QA). Refused at adoption."""
    out = []
    for disk in _parse(xml).iterfind("devices/disk"):
        if disk.get("device") in ("cdrom", "floppy") or disk.find("readonly") is not None:
            continue
        target = disk.find("target")
        if disk.find("transient") is not None and target is not None:
            out.append(target.get("dev", ""))
    return out


def file_sources(xml: str) -> list[str]:
    """The file of every disk the domain names, kept by ksfs or not (cdroms, read-only disks):
    what must not be deleted while the domain uses it."""
    return [src.get("file") for src in _parse(xml).iterfind("devices/disk/source")
            if src.get("file")]


def formatted_sources(xml: str) -> list[tuple[str, str]]:
    """(file, format) of every disk the domain names, kept by ksfs or not, as ``file_sources``:
    the format its driver gives (libvirt takes a disk without one as raw, and so does ksfs:
    a format known is never left to qemu-img to guess)."""
    out = []
    for disk in _parse(xml).iterfind("devices/disk"):
        source, driver = disk.find("source"), disk.find("driver")
        if source is not None and source.get("file"):
            out.append((source.get("file"),
                        driver.get("type", "raw") if driver is not None else "raw"))
    return out


def files_to_start(xml: str, kept: set[str], from_memory: bool) -> list[tuple[str, str]]:
    """(what, path) for each host file a start of ``xml`` needs that is not one of the disks
    in ``kept`` (which the caller makes): cdrom and read-only images, the firmware loader.
    A disk whose startupPolicy lets libvirt drop it when missing is not needed ('optional';
    'requisite' on a restore from memory, as libvirt documents)."""
    root = _parse(xml)
    out = []
    for disk in root.iterfind("devices/disk"):
        target = disk.find("target")
        dev = target.get("dev", "") if target is not None else ""
        if dev in kept:
            continue
        source = disk.find("source")
        path = source.get("file") or source.get("dev") if source is not None else None
        policy = source.get("startupPolicy") if source is not None else None
        if not path or policy == "optional" or (policy == "requisite" and from_memory):
            continue
        out.append((f"{disk.get('device', 'disk')} {dev}", path))
    loader = root.findtext("os/loader")
    if loader and loader.strip():
        out.append(("firmware loader", loader.strip()))
    return out


def match_disks(xml: str, to: str, stale: Callable[[str], bool],
                keep_addresses: bool = True) -> str:
    """``xml`` (a persistent definition) with the disk devices of ``to`` (the machine a
    restore started): a disk ``to`` lacks is removed when ``stale`` says its file is one the
    restore deletes (a disk hot-plugged after the checkpoint and layered by a save since; one
    attached for the next boot only is the user's and stays); a disk only ``to`` has (unplugged
    since the checkpoint) is added from it, without its device address unless
    ``keep_addresses`` (that slot may be another device's now). Disks both have are kept as
    ``xml`` has them, sources and all (the caller points them at their new files), unless
    the definition's is another kind of disk (read-only, shareable, another device or type):
    then the restored one takes its place."""
    root, want = _parse(xml), _parse(to)
    devices = root.find("devices")
    if devices is None:
        devices = ET.SubElement(root, "devices")

    def key(disk: ET.Element) -> str:
        t = disk.find("target")
        return t.get("dev", "") if t is not None else ""

    def definable(disk: ET.Element) -> ET.Element:
        """A running machine's disk element as a definition takes it."""
        for el in list(disk):
            if (el.tag == "backingStore" or (el.tag == "address" and not keep_addresses)
                    or (el.tag == "alias" and not (el.get("name") or "").startswith("ua-"))):
                disk.remove(el)
        source = disk.find("source")
        if source is not None:
            source.attrib.pop("index", None)
        return disk

    wanted = {key(d): d for d in want.iterfind("devices/disk")}
    have = set()
    for disk in list(devices.iterfind("disk")):
        source = disk.find("source")
        path = source.get("file") if source is not None else None
        k = key(disk)
        if k in wanted and _kind(disk) != _kind(wanted[k]):
            # another disk on the same target since (a read-only one where the checkpoint
            # had a writable one): the restored one takes its place, as it runs
            at = list(devices).index(disk)
            devices.remove(disk)
            devices.insert(at, definable(wanted[k]))
        elif k not in wanted and path and stale(path):
            devices.remove(disk)
            continue
        have.add(k)
    kept = devices.findall("disk")
    # after the disks it keeps (the first disk is often the one booted), else first
    anchor = list(devices).index(kept[-1]) + 1 if kept else 0
    for k, disk in wanted.items():
        if k not in have:
            devices.insert(anchor, definable(disk))
            anchor += 1
    return ET.tostring(root, encoding="unicode")


def _kind(disk: ET.Element) -> tuple:
    return (disk.get("device", "disk"), disk.get("type"), disk.find("readonly") is not None,
            disk.find("shareable") is not None)


def set_disk_sources(xml: str, sources: dict[str, tuple[str, str]]) -> str:
    """Point each named disk target at (file, format) and drop libvirt's recorded backing chain.

    libvirt re-reads the chain from the qcow2 headers when the domain starts or restores.
    """
    root = _parse(xml)
    for disk in root.iterfind("devices/disk"):
        target = disk.find("target")
        if target is None or target.get("dev") not in sources:
            continue
        path, fmt = sources[target.get("dev")]
        source = disk.find("source")
        if source is None:
            source = ET.SubElement(disk, "source")
        for attr in list(source.attrib):
            if attr != "file":
                del source.attrib[attr]
        for child in list(source):
            source.remove(child)
        source.set("file", path)
        disk.set("type", "file")
        driver = disk.find("driver")
        if driver is None:
            driver = ET.SubElement(disk, "driver", {"name": "qemu"})
        driver.set("type", fmt)
        for bs in disk.findall("backingStore"):
            disk.remove(bs)
    return ET.tostring(root, encoding="unicode")


def rename_for_fork(xml: str, name: str, console_log: Path | None, lineage: str | None,
                    session_dir: Path | None = None) -> str:
    """The same machine as a new domain: new name, UUID and MACs; log path and lineage
    rewritten; host endpoints the parent holds (see ``_own_endpoints``) made the fork's own."""
    root = _parse(xml)
    _own_endpoints(root, session_dir)
    root.find("name").text = name  # type: ignore[union-attr]
    uuid_el = root.find("uuid")
    if uuid_el is None:
        uuid_el = ET.SubElement(root, "uuid")
    uuid_el.text = str(uuidlib.uuid4())
    for mac in root.iterfind("devices/interface/mac"):
        mac.set("address", random_mac())
    if console_log is not None:
        for kind in ("serial", "console"):
            for dev in root.iterfind(f"devices/{kind}"):
                src = dev.find("source")
                if dev.get("type") == "file" and src is not None and src.get("path"):
                    src.set("path", str(console_log))
                log = dev.find("log")
                if log is not None and log.get("file"):
                    log.set("file", str(console_log))
    if lineage is not None:
        cmd = root.find("os/cmdline")
        if cmd is not None:
            cmd.text = set_cmdline_arg(cmd.text or "", "ksfs.lineage", lineage)
    # Drop the fields that name the old process or its identity outside the definition.
    for tag in ("seclabel",):
        for el in root.findall(tag):
            if el.get("type") == "dynamic":
                root.remove(el)
    root.attrib.pop("id", None)
    return ET.tostring(root, encoding="unicode")


CHARDEVS = ("serial", "console", "channel", "parallel")


# sun_path holds 108 bytes with its NUL; a socket path longer than this goes to SOCKET_DIR.
SOCKET_PATH_MAX = 107
SOCKET_DIR = Path("/run/ksfs")


def _own_endpoints(root: ET.Element, session_dir: Path | None) -> None:
    """Give a fork its own host endpoints where the parent's definition fixes them, since the
    parent keeps running on them: a fixed VNC/SPICE port becomes an automatic one, a graphics
    or character device listening on a unix socket gets a socket of the fork's own (in its
    directory, or ``SOCKET_DIR`` when that path would be too long for a socket), one listening
    on a TCP port a free port of the same host. None of this is guest-visible (it is not in the
    migration stream), so the fork's memory still fits its devices."""
    for n, g in enumerate(root.iterfind("devices/graphics")):
        if g.get("autoport") == "no" or g.get("port") not in (None, "-1"):
            g.set("autoport", "yes")
            for attr in ("port", "tlsPort"):
                g.attrib.pop(attr, None)
        if g.get("websocket") not in (None, "-1"):
            g.set("websocket", "-1")
        for el in (g, *g.iterfind("listen")):
            if el.get("socket") and session_dir is not None:
                el.set("socket", _own_socket(session_dir, f"graphics{n}"))
    moved: dict[tuple[str, ...], str] = {}  # a console that mirrors serial0 moves with it
    for kind in CHARDEVS:
        for n, dev in enumerate(root.iterfind(f"devices/{kind}")):
            src = dev.find("source")
            if src is None or src.get("mode") != "bind":
                continue
            if dev.get("type") == "tcp" and src.get("service"):
                key = ("tcp", src.get("host") or "", src.get("service") or "")
                if key not in moved:
                    # no host: QEMU listens on every address, so the port must be free on all
                    moved[key] = str(_free_port(src.get("host") or "0.0.0.0"))
                src.set("service", moved[key])
            elif dev.get("type") == "unix" and src.get("path") and session_dir is not None:
                key = ("unix", src.get("path") or "")
                if key not in moved:
                    moved[key] = _own_socket(session_dir, f"{kind}{n}")
                src.set("path", moved[key])


def _own_socket(session_dir: Path, name: str) -> str:
    """A socket path of the fork's own, short enough for sun_path whatever its name's length
    (a fork of a fork gets the same short name, not a longer one)."""
    path = str(session_dir / f"{name}.sock")
    if len(path.encode()) <= SOCKET_PATH_MAX:
        return path
    import hashlib

    digest = hashlib.blake2b(path.encode(), digest_size=10).hexdigest()
    return str(SOCKET_DIR / f"{digest}.sock")


def _free_port(host: str) -> int:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError as exc:
        raise VMError(f"finding a free port on {host} for a fork's serial device failed: "
                      f"{exc.strerror or exc}") from exc


KSFS_FW_CFG = "opt/ksfs/"


def set_fw_cfg(xml: str, entries: dict[str, str | Path]) -> str:
    """Set the domain's ksfs fw_cfg entries (``<sysinfo type='fwcfg'>``, names under
    ``opt/ksfs/``), replacing the ksfs ones it had and keeping every other entry (an adopted
    domain's own). A Path value is given as the entry's file, which QEMU reads: a text value
    ends up on QEMU's command line, which every local user can read.

    fw_cfg is how a guest learns per-domain facts that must follow a restore or fork rather than
    its memory: QEMU builds the entries from the new definition, they are not in the migration
    stream.
    """
    for name in entries:
        if not name.startswith(KSFS_FW_CFG):
            raise VMError(f"fw_cfg entry {name!r} must start with {KSFS_FW_CFG}")
    root = _parse(xml)
    sysinfo = root.find("sysinfo[@type='fwcfg']")
    if sysinfo is not None:
        for el in list(sysinfo):
            if (el.get("name") or "").startswith(KSFS_FW_CFG):
                sysinfo.remove(el)
    if entries:
        if sysinfo is None:
            sysinfo = ET.SubElement(root, "sysinfo", {"type": "fwcfg"})
        for name, value in sorted(entries.items()):
            if isinstance(value, Path):
                ET.SubElement(sysinfo, "entry", {"name": name, "file": str(value)})
            else:
                ET.SubElement(sysinfo, "entry", {"name": name}).text = value
    if sysinfo is not None and len(sysinfo) == 0:
        root.remove(sysinfo)
    return ET.tostring(root, encoding="unicode")


def fw_cfg(xml: str) -> dict[str, str | Path]:
    """The domain's fw_cfg entries: name -> text, or the Path of the file QEMU reads."""
    root = _parse(xml)
    return {e.get("name"): Path(e.get("file")) if e.get("file") else e.text or ""
            for e in root.iterfind("sysinfo[@type='fwcfg']/entry")}


def set_cmdline_arg(cmdline: str, key: str, value: str) -> str:
    """``cmdline`` with the kernel parameter ``key`` set to ``value``: each ``key=`` the
    kernel would parse as a parameter of its own is replaced, not one inside another's double
    quotes (QA, nineteenth session: a fork rewrote ``a="x ksfs.lineage=y"``); else appended."""
    pattern = re.compile(rf"(^|\s){re.escape(key)}=\S*")
    out, pos, found = [], 0, False
    for m in pattern.finditer(cmdline):
        if cmdline.count('"', 0, m.start()) % 2:
            continue  # inside quotes: part of another parameter's value
        out += [cmdline[pos:m.start()], f"{m.group(1)}{key}={value}"]
        pos, found = m.end(), True
    if found:
        return "".join(out) + cmdline[pos:]
    return f"{cmdline} {key}={value}".strip()


def append_console_logs(xml: str) -> str:
    """``xml`` with every file a serial or console device writes (a file source, or a pty's
    <log>) opened for appending: QEMU otherwise truncates it when a restore starts the
    machine again, and an adopted domain's own console log lost its history at every restore
    (QA, fifteenth session)."""
    root = _parse(xml)
    changed = False
    for kind in ("serial", "console"):
        for dev in root.iterfind(f"devices/{kind}"):
            src = dev.find("source")
            targets = [src] if dev.get("type") == "file" and src is not None else []
            targets += [el for el in (dev.find("log"),) if el is not None]
            for el in targets:
                if (el.get("path") or el.get("file")) and el.get("append") != "on":
                    el.set("append", "on")
                    changed = True
    return ET.tostring(root, encoding="unicode") if changed else xml


def console_log_path(xml: str) -> str | None:
    """The file the serial console is written to, from a file serial or a pty's <log>."""
    root = _parse(xml)
    for dev in root.iterfind("devices/serial"):
        src = dev.find("source")
        if dev.get("type") == "file" and src is not None and src.get("path"):
            return src.get("path")
        log = dev.find("log")
        if log is not None and log.get("file"):
            return log.get("file")
    return None


def nvram(xml: str) -> tuple[str | None, str | None]:
    """(file, template) of a UEFI domain's variable store (``<os><nvram>``, in either of the
    forms libvirt writes: its text, or ``type='file'`` with ``<source file=...>``); (None, None)
    when the domain has none."""
    el = _parse(xml).find("os/nvram")
    if el is None:
        return None, None
    src = el.find("source")
    path = src.get("file") if src is not None else (el.text or "").strip()
    return path or None, el.get("template")


def set_nvram(xml: str, path: Path | str) -> str:
    root = _parse(xml)
    el = root.find("os/nvram")
    if el is None:
        raise VMError("the domain has no <nvram> to point elsewhere")
    src = el.find("source")
    if src is not None:
        src.set("file", str(path))
    else:
        el.text = str(path)
    return ET.tostring(root, encoding="unicode")


def uuid_of(xml: str) -> str:
    el = _parse(xml).find("uuid")
    return el.text if el is not None and el.text else ""


BOOT_TAGS = ("kernel", "initrd")


def boot_files(xml: str) -> dict[str, str]:
    """The direct-boot files a domain names: {"kernel": path, "initrd": path} (those it has)."""
    root = _parse(xml)
    out = {}
    for tag in BOOT_TAGS:
        el = root.find(f"os/{tag}")
        if el is not None and el.text and el.text.strip():
            out[tag] = el.text.strip()
    return out


def set_boot_files(xml: str, paths: dict[str, str]) -> str:
    """Point ``os/kernel`` and ``os/initrd`` at new paths (only those the XML already has)."""
    root = _parse(xml)
    for tag, path in paths.items():
        el = root.find(f"os/{tag}")
        if el is not None:
            el.text = path
    return ET.tostring(root, encoding="unicode")
