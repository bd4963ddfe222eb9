"""Unit tests of the save image header rewrite and the domain XML rewrites (no libvirt needed)."""

from __future__ import annotations

import re
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ksfs.errors import VMError
from ksfs.vm import domxml, saveimage

XML = """<domain type='qemu'>
  <name>ksfs-parent</name>
  <uuid>11111111-2222-3333-4444-555555555555</uuid>
  <os><type>hvm</type><kernel>/k</kernel>
    <cmdline>console=ttyS0 ksfs.lineage=parent quiet</cmdline></os>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/w/parent/vda-3.qcow2' index='2'/>
      <backingStore type='file' index='1'><format type='raw'/>
        <source file='/w/parent/vda-0.raw'/><backingStore/></backingStore>
      <target dev='vda' bus='virtio'/>
    </disk>
    <disk type='file' device='cdrom'><source file='/iso/x.iso'/>
      <target dev='hdc' bus='ide'/><readonly/></disk>
    <interface type='user'><mac address='52:54:00:aa:bb:cc'/><model type='virtio'/></interface>
    <serial type='file'><source path='/w/parent/console.log' append='on'/>
      <target port='0'/></serial>
    <console type='file'><source path='/w/parent/console.log' append='on'/>
      <target type='serial' port='0'/></console>
  </devices>
</domain>"""
COOKIE = "<cookie>\n  <cpu mode='custom'/>\n</cookie>\n"
STREAM = b"QEVM\x00\x00\x00\x03" + bytes(range(256)) * 64


def make_image(path: Path, xml: str = XML, cookie: str = COOKIE, pad: int = 4096,
               version: int = 2, magic: bytes = saveimage.MAGIC) -> None:
    data = xml.encode() + b"\0"
    cookie_off = 0
    if cookie:
        cookie_off = len(data)
        data += cookie.encode() + b"\0"
    data += bytes(pad)
    head = struct.pack("<16s19I", magic, version, len(data), 1, 0, cookie_off, *([0] * 14))
    path.write_bytes(head + data + STREAM)


def test_read_header_returns_xml_cookie_and_lengths(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img)
    h = saveimage.read_header(img)
    assert (h.version, h.was_running, h.compressed) == (2, 1, 0)
    assert h.xml == XML and h.cookie == COOKIE
    assert h.cookie_offset == len(XML.encode()) + 1
    assert h.free == 4096


def test_rewrite_replaces_xml_moves_cookie_and_keeps_the_stream(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img)
    before = img.read_bytes()
    new_xml = XML.replace("ksfs-parent", "ksfs-a-much-longer-fork-name-than-before")
    h = saveimage.rewrite_xml(img, new_xml)
    after = img.read_bytes()
    assert len(after) == len(before)
    assert after.endswith(STREAM)  # QEMU's migration stream is untouched
    assert h.xml == new_xml and h.cookie == COOKIE
    assert h.cookie_offset == len(new_xml.encode()) + 1
    off = saveimage.HEADER_SIZE + h.cookie_offset
    assert after[off:off + len(COOKIE)] == COOKIE.encode()
    assert h.data_len == saveimage.read_header(img).data_len
    assert h.free == 4096 - (len(new_xml) - len(XML))


def test_rewrite_shorter_xml_zero_fills_the_rest(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img, pad=64)
    short = "<domain><name>x</name></domain>"
    h = saveimage.rewrite_xml(img, short)
    raw = img.read_bytes()
    data = raw[saveimage.HEADER_SIZE:saveimage.HEADER_SIZE + h.data_len]
    assert data == short.encode() + b"\0" + COOKIE.encode() + b"\0" + bytes(h.free)


def test_xml_that_does_not_fit_fails_clearly_and_changes_nothing(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img, pad=16)
    before = img.read_bytes()
    with pytest.raises(VMError, match="does not fit"):
        saveimage.rewrite_xml(img, XML + "<!--" + "x" * 100 + "-->")
    assert img.read_bytes() == before


def test_image_without_cookie(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img, cookie="", version=1)
    h = saveimage.rewrite_xml(img, XML.replace("parent", "child"))
    assert h.cookie == "" and h.cookie_offset == 0 and "ksfs-child" in h.xml


@pytest.mark.parametrize("magic,what", [(b"LibvirtQemudPart", "incomplete"),
                                        (b"NotASaveImage!!!", "bad magic")])
def test_bad_or_partial_magic_is_refused(tmp_path: Path, magic: bytes, what: str) -> None:
    img = tmp_path / "m.save"
    make_image(img, magic=magic)
    with pytest.raises(VMError, match=what):
        saveimage.read_header(img)


def test_truncated_image_is_refused(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img)
    img.write_bytes(img.read_bytes()[:200])
    with pytest.raises(VMError, match="ends inside"):
        saveimage.read_header(img)


def test_set_was_running(tmp_path: Path) -> None:
    img = tmp_path / "m.save"
    make_image(img)
    saveimage.set_was_running(img, False)
    assert saveimage.read_header(img).was_running == 0
    assert img.read_bytes().endswith(STREAM)


# --- domain XML rewrites ------------------------------------------------------------------------


def test_disks_lists_file_disks_with_their_chain() -> None:
    (d,) = domxml.disks(XML)
    assert d.target == "vda" and d.fmt == "qcow2"
    assert d.source == "/w/parent/vda-3.qcow2" and d.backing == ("/w/parent/vda-0.raw",)


def test_disks_refuses_a_network_disk() -> None:
    xml = XML.replace("<disk type='file' device='disk'>", "<disk type='network' device='disk'>")
    xml = xml.replace("<source file='/w/parent/vda-3.qcow2' index='2'/>",
                      "<source protocol='nbd' name='x'/>")
    with pytest.raises(VMError, match="not a plain file"):
        domxml.disks(xml)


def _with_disk(xml: str, disk: str) -> str:
    return xml.replace("<interface", disk + "\n    <interface", 1)


def test_disks_leaves_read_only_disks_alone_and_refuses_a_shareable_one() -> None:
    ro = ("<disk type='file' device='disk'><driver type='raw'/><source file='/img/ro.raw'/>"
          "<target dev='vdb' bus='virtio'/><readonly/></disk>")
    ro_block = ("<disk type='block' device='disk'><source dev='/dev/sdz'/>"
                "<target dev='vdc' bus='virtio'/><readonly/></disk>")
    assert [d.target for d in domxml.disks(_with_disk(XML, ro + ro_block))] == ["vda"]
    shared = ("<disk type='file' device='disk'><source file='/img/shared.raw'/>"
              "<target dev='vdb' bus='virtio'/><shareable/></disk>")
    with pytest.raises(VMError, match=r"disk vdb of domain ksfs-parent is shareable.*"
                                      r"detach-disk ksfs-parent vdb"):
        domxml.disks(_with_disk(XML, shared))
    lun = ("<disk type='block' device='lun'><source dev='/dev/sdz'/>"
           "<target dev='sda' bus='scsi'/></disk>")
    with pytest.raises(VMError, match=r"disk sda of domain ksfs-parent is not a plain file "
                                      r"\(type='block'\).*detach"):
        domxml.disks(_with_disk(XML, lun))


def test_files_to_start_names_what_libvirt_needs_and_may_drop() -> None:
    disks = ("<disk type='file' device='disk'><source file='/img/ro.raw'/>"
             "<target dev='vdb' bus='virtio'/><readonly/></disk>"
             "<disk type='file' device='cdrom'><source file='/iso/opt.iso' "
             "startupPolicy='optional'/><target dev='hdd' bus='ide'/><readonly/></disk>"
             "<disk type='file' device='cdrom'><source file='/iso/req.iso' "
             "startupPolicy='requisite'/><target dev='sdb' bus='sata'/><readonly/></disk>"
             "<disk type='file' device='cdrom'><target dev='sdc' bus='sata'/></disk>")
    xml = _with_disk(XML, disks).replace("<kernel>/k</kernel>",
                                         "<loader readonly='yes'>/fw/code.fd</loader>")
    assert domxml.files_to_start(xml, {"vda"}, from_memory=True) == [
        ("cdrom hdc", "/iso/x.iso"), ("disk vdb", "/img/ro.raw"),
        ("firmware loader", "/fw/code.fd")]
    assert ("cdrom sdb", "/iso/req.iso") in domxml.files_to_start(xml, {"vda"}, False)
    assert ("disk vda", "/w/parent/vda-3.qcow2") in domxml.files_to_start(xml, set(), False)


def test_match_disks_gives_a_definition_the_restored_machines_disks() -> None:
    hot = ("<disk type='file' device='disk'><source file='/w/parent/vdb-4.qcow2'/>"
           "<target dev='vdb' bus='virtio'/></disk>")
    next_boot = ("<disk type='file' device='disk'><source file='/img/later.raw'/>"
                 "<target dev='vdd' bus='virtio'/></disk>")
    unplugged = ("<disk type='file' device='disk'><driver type='raw'/>"
                 "<source file='/img/data.raw' index='3'/><backingStore/>"
                 "<target dev='vdc' bus='virtio'/><alias name='virtio-disk2'/>"
                 "<address type='pci' domain='0x0000' bus='0x00' slot='0x07' function='0x0'/>"
                 "</disk>")
    inactive = _with_disk(XML, hot + next_boot)
    restored = _with_disk(XML, unplugged).replace("/w/parent/vda-3", "/w/parent/vda-9")

    def ours(path: str) -> bool:
        return path.startswith("/w/parent/")

    out = domxml.match_disks(inactive, restored, ours)
    root = ET.fromstring(out)
    by_target = {d.find("target").get("dev"): d for d in root.iterfind("devices/disk")}
    # vdb (on a file the restore deletes) gone; vdd, attached for the next boot only, kept;
    # vdc added after the disks kept
    assert list(by_target) == ["vda", "hdc", "vdd", "vdc"]
    vdc = by_target["vdc"]
    assert vdc.find("source").attrib == {"file": "/img/data.raw"}
    assert vdc.find("alias") is None and vdc.find("backingStore") is None
    assert vdc.find("address").get("slot") == "0x07"
    # a disk both have keeps the definition's source (the caller points it anew)
    assert by_target["vda"].find("source").get("file") == "/w/parent/vda-3.qcow2"
    bare = ET.fromstring(domxml.match_disks(inactive, restored, ours, keep_addresses=False))
    assert [d.find("address") for d in bare.iterfind("devices/disk")
            if d.find("target").get("dev") == "vdc"] == [None]
    # a read-only disk attached on vdc since the checkpoint, which had a writable vdc there
    swapped = _with_disk(XML, unplugged.replace("/img/data.raw", "/img/ro2.raw").replace(
        "</disk>", "<readonly/></disk>"))
    out = ET.fromstring(domxml.match_disks(swapped, restored, ours))
    vdcs = [d for d in out.iterfind("devices/disk") if d.find("target").get("dev") == "vdc"]
    assert len(vdcs) == 1 and vdcs[0].find("readonly") is None
    assert vdcs[0].find("source").get("file") == "/img/data.raw"
    assert domxml.match_disks(XML, XML, ours) == ET.tostring(ET.fromstring(XML),
                                                             encoding="unicode")
    assert domxml.file_sources(inactive) == ["/w/parent/vda-3.qcow2", "/iso/x.iso",
                                             "/w/parent/vdb-4.qcow2", "/img/later.raw"]


def test_set_disk_sources_drops_the_recorded_chain_and_keeps_the_rest() -> None:
    out = domxml.set_disk_sources(XML, {"vda": ("/w/child/vda-1.qcow2", "qcow2")})
    (d,) = domxml.disks(out)
    assert d.source == "/w/child/vda-1.qcow2" and d.backing == ()
    assert "/iso/x.iso" in out and "index=" not in out.split("<target dev='vda'")[0][-200:]
    assert domxml.uuid_of(out) == domxml.uuid_of(XML)


def test_rename_for_fork_changes_identity_log_and_lineage_only() -> None:
    out = domxml.rename_for_fork(XML, "ksfs-child", Path("/w/child/console.log"), "child")
    assert domxml.domain_name(out) == "ksfs-child"
    assert domxml.uuid_of(out) not in ("", domxml.uuid_of(XML))
    macs = re.findall(r"<mac address=[\"']([0-9a-f:]+)", out)
    assert len(macs) == 1 and macs[0] != "52:54:00:aa:bb:cc" and macs[0].startswith("52:54:00:")
    assert domxml.console_log_path(out) == "/w/child/console.log"
    assert "/w/parent/console.log" not in out
    assert "ksfs.lineage=child" in out and "ksfs.lineage=parent" not in out
    assert "console=ttyS0" in out and "quiet" in out
    assert domxml.disks(out) == domxml.disks(XML)  # disks are the caller's to rewrite


@pytest.mark.parametrize("cmdline,expected", [
    ("console=ttyS0", "console=ttyS0 ksfs.lineage=L"),
    ("ksfs.lineage=old quiet", "ksfs.lineage=L quiet"),
    ("a xksfs.lineage=keep", "a xksfs.lineage=keep ksfs.lineage=L"),
    ("", "ksfs.lineage=L"),
    # inside another parameter's quotes: that value is the user's (QA, nineteenth session)
    ('a="x ksfs.lineage=foo y" ksfs.lineage=old', 'a="x ksfs.lineage=foo y" ksfs.lineage=L'),
    ('a="x ksfs.lineage=foo y"', 'a="x ksfs.lineage=foo y" ksfs.lineage=L'),
    ('ksfs.lineage=a b="c" ksfs.lineage=d', "ksfs.lineage=L b=\"c\" ksfs.lineage=L"),
])
def test_set_cmdline_arg(cmdline: str, expected: str) -> None:
    assert domxml.set_cmdline_arg(cmdline, "ksfs.lineage", "L") == expected


def test_set_fw_cfg_replaces_only_the_ksfs_entries() -> None:
    # QA (eighth session): a fork of an adopted domain lost the user's own fw_cfg entries.
    xml = ("<domain type='qemu'><name>d</name><sysinfo type='fwcfg'>"
           "<entry name='opt/user/setting'>kept</entry>"
           "<entry name='opt/ksfs/gateway'>http://old</entry></sysinfo></domain>")
    new = domxml.set_fw_cfg(xml, {"opt/ksfs/gateway": "http://new", "opt/ksfs/token": "t"})
    assert domxml.fw_cfg(new) == {"opt/user/setting": "kept", "opt/ksfs/gateway": "http://new",
                                  "opt/ksfs/token": "t"}
    assert domxml.fw_cfg(domxml.set_fw_cfg(xml, {})) == {"opt/user/setting": "kept"}
    bare = "<domain type='qemu'><name>d</name></domain>"
    assert "sysinfo" not in domxml.set_fw_cfg(bare, {})
    with pytest.raises(VMError):
        domxml.set_fw_cfg(bare, {"opt/other": "x"})


def test_a_path_fw_cfg_value_is_given_as_a_file() -> None:
    """A text entry goes on QEMU's command line, which every local user can read: secrets go
    as a file QEMU reads, and replace a text entry of the same name."""
    xml = ("<domain type='qemu'><name>d</name><sysinfo type='fwcfg'>"
           "<entry name='opt/ksfs/token'>in-the-clear</entry></sysinfo></domain>")
    new = domxml.set_fw_cfg(xml, {"opt/ksfs/token": Path("/s/guest-tokens/L")})
    assert "in-the-clear" not in new
    assert "file=\"/s/guest-tokens/L\"" in new
    assert domxml.fw_cfg(new) == {"opt/ksfs/token": Path("/s/guest-tokens/L")}


def test_a_fork_gets_its_own_host_endpoints() -> None:
    # QA (eighth session): a fixed VNC port or a TCP serial made forks fail ("Failed to reserve
    # port", "Address already in use"), and a unix channel was taken over from the parent.
    xml = """<domain type='qemu'><name>p</name><uuid>6f1c7a55-0d4f-4c4e-9a3b-6c1d2f3e4a5b</uuid>
<devices>
<graphics type='vnc' port='5977' autoport='no' websocket='5978' listen='127.0.0.1'/>
<graphics type='spice' autoport='yes'/>
<serial type='tcp'><source mode='bind' host='127.0.0.1' service='4577'/>
<protocol type='raw'/><target port='0'/></serial>
<console type='tcp'><source mode='bind' host='127.0.0.1' service='4577'/>
<protocol type='raw'/><target type='serial' port='0'/></console>
<serial type='tcp'><source mode='connect' host='127.0.0.1' service='4600'/><target port='1'/>
</serial>
<channel type='unix'><source mode='bind' path='/run/user/agent.sock'/>
<target type='virtio' name='org.qemu.guest_agent.0'/></channel>
</devices></domain>"""
    out = ET.fromstring(domxml.rename_for_fork(xml, "ksfs-f", None, None, Path("/s/f")))
    vnc, spice = out.findall("devices/graphics")
    assert vnc.get("autoport") == "yes" and vnc.get("port") is None
    assert vnc.get("websocket") == "-1" and vnc.get("listen") == "127.0.0.1"
    assert spice.attrib == {"type": "spice", "autoport": "yes"}
    serial0, serial1 = out.findall("devices/serial")
    port = serial0.find("source").get("service")
    assert port != "4577" and int(port) > 0
    assert out.find("devices/console/source").get("service") == port  # mirrors serial0
    assert serial1.find("source").get("service") == "4600"  # connecting: left alone
    assert out.find("devices/channel/source").get("path") == "/s/f/channel0.sock"


def test_a_fork_keeps_the_namespace_prefixes_of_the_definition() -> None:
    xml = ("<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
           "<name>p</name><metadata><qa:note xmlns:qa='http://example.org/qa/1'>kept"
           "</qa:note></metadata><qemu:commandline><qemu:arg value='-no-user-config'/>"
           "</qemu:commandline></domain>")
    out = domxml.rename_for_fork(xml, "ksfs-f", None, None)
    assert "<qa:note" in out and "<qemu:commandline>" in out and "ns0:" not in out


def test_a_fork_socket_path_stays_short_whatever_the_names() -> None:
    # Review (eighth session): sockets were named after the parent's, growing with each
    # generation, and a long session name went past sun_path's 108 bytes.
    xml = ("<domain type='qemu'><name>p</name><devices>"
           "<graphics type='vnc'><listen type='socket' socket='/var/run/p/vnc.sock'/></graphics>"
           "<channel type='unix'><source mode='bind' path='/run/user/agent.sock'/>"
           "<target type='virtio' name='org.qemu.guest_agent.0'/></channel></devices></domain>")
    short = ET.fromstring(domxml.rename_for_fork(xml, "f", None, None, Path("/s/vm/f")))
    assert short.find("devices/graphics/listen").get("socket") == "/s/vm/f/graphics0.sock"
    again = domxml.rename_for_fork(ET.tostring(short, encoding="unicode"), "g", None, None,
                                   Path("/s/vm/g"))
    assert ET.fromstring(again).find("devices/channel/source").get("path") == \
        "/s/vm/g/channel0.sock"
    deep = Path("/root/.local/share/ksfs/vm") / ("n" * 200)
    long = ET.fromstring(domxml.rename_for_fork(xml, "h", None, None, deep))
    path = long.find("devices/channel/source").get("path")
    assert path.startswith(str(domxml.SOCKET_DIR) + "/") and len(path) <= 107


def test_a_checkpoints_disks_are_found_by_target_not_position() -> None:
    """A save incremental against a checkpoint whose disks were others (one detached since, or
    a read-only disk an older ksfs stored first) must not patch one disk onto another's file."""
    from ksfs.keeper.machine import stored_disks
    from ksfs.model import CheckpointRecord, FileRecord

    vdb = ("<disk type='file' device='disk'><source file='/img/data.raw'/>"
           "<target dev='vdb' bus='virtio'/></disk>")

    def record(xml: str | None, *names: str) -> CheckpointRecord:
        files = tuple(FileRecord(n, "00" * 32, 1) for n in ("memory", *names))
        return CheckpointRecord("s", "c", 1, 0.0, files, domain_xml=xml)

    two = _with_disk(XML, vdb)
    assert stored_disks(record(two, "disk.raw", "disk-vdb.raw")) == {
        "vda": "disk.raw", "vdb": "disk-vdb.raw"}
    # vda detached since: vdb is now the first disk, but in that checkpoint it is disk-vdb.raw
    only_vdb = ET.tostring(ET.fromstring(two), encoding="unicode")
    root = ET.fromstring(only_vdb)
    devices = root.find("devices")
    devices.remove(next(d for d in devices.iterfind("disk")
                        if d.find("target").get("dev") == "vda"))
    assert stored_disks(record(ET.tostring(root, encoding="unicode"), "disk.raw")) == {
        "vdb": "disk.raw"}
    # an older ksfs stored read-only vdb too: its files do not match what the XML keeps now
    legacy = _with_disk(XML, vdb.replace("</disk>", "<readonly/></disk>"))
    assert stored_disks(record(legacy, "disk.raw", "disk-vdb.raw")) is None
    assert stored_disks(record(None, "disk.raw")) is None  # an imported checkpoint


def test_a_handed_back_copy_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    """QA: a hand-back killed mid-copy left a valid-looking partial disk under the name the
    user would take for the whole one."""
    from ksfs.vm.detached import _write_whole

    dest = tmp_path / "data.released.qcow2"

    def dies(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _write_whole(dest, dies)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".data.released.qcow2.ksfs-part").write_bytes(b"a killed one's")
    _write_whole(dest, lambda tmp: tmp.write_bytes(b"whole"))
    assert [p.name for p in tmp_path.iterdir()] == [dest.name] and dest.read_bytes() == b"whole"


def test_console_files_are_opened_for_appending() -> None:
    """QA (fifteenth session): QEMU truncates a serial file (or a pty's log) without
    append='on' when a restore starts the machine again: an adopted domain's console log
    lost its history at every restore."""
    xml = ("<domain type='qemu'><name>d</name><devices>"
           "<serial type='file'><source path='/var/log/d.log'/><target port='0'/></serial>"
           "<serial type='pty'><log file='/var/log/d1.log'/><target port='1'/></serial>"
           "<serial type='pty'><target port='2'/></serial>"
           "<console type='file'><source path='/var/log/d.log'/></console>"
           "</devices></domain>")
    new = domxml.append_console_logs(xml)
    root = ET.fromstring(new)
    assert [s.find("source").get("append") for s in root.iterfind("devices/serial[@type='file']")
            ] == ["on"]
    assert root.find("devices/serial/log").get("append") == "on"
    assert root.find("devices/console/source").get("append") == "on"
    assert domxml.append_console_logs(new) == new  # nothing left to change: the same text
