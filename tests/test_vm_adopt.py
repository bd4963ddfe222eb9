"""A domain the test defines itself with plain libvirt XML, then adopts: save, restore, fork.

The domain uses a qcow2 disk of its own outside the controller's directory and a pty serial
console logged by virtlogd, unlike the guests ``create`` makes. Every domain made here is
destroyed and undefined by a finalizer, even when a test fails.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from guest import (
    FileReader,
    copy_source,
    counters,
    guest_config,
    require_libvirt,
    settled_size,
    transcript,
    undefine_quietly,
    unique_domain,
    vm_workdir,
    wait_for_counter,
)

from ksfs.errors import VMError
from ksfs.vm import DomainController

pytestmark = pytest.mark.vm

PLAIN_XML = """<domain type='{dtype}'>
  <name>{name}</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64'>hvm</type>
    <kernel>{kernel}</kernel>
    <initrd>{initrd}</initrd>
    <cmdline>console=ttyS0 panic=-1 quiet ksfs.lineage=mine</cmdline>
  </os>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <interface type='user'><model type='virtio'/></interface>
    <serial type='pty'>
      <log file='{log}'/>
      <target port='0'/>
    </serial>
    <rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>
  </devices>
  <description>defined by the adoption test, not by ksfs</description>
</domain>
"""


@pytest.fixture(scope="module")
def adopted():
    require_libvirt()
    cfg = guest_config()
    work = vm_workdir()
    own = Path(tempfile.mkdtemp(prefix="ksfs-vmtest-own-", dir=work.parent))
    own.chmod(0o755)
    ctl = DomainController(workdir=work)
    name = unique_domain("ksfs-test-adopt")
    made = [name]
    try:
        disk = own / "mine.qcow2"
        subprocess.run(["qemu-img", "convert", "-O", "qcow2", cfg["disk"], str(disk)],
                       check=True)
        xml = PLAIN_XML.format(dtype=ctl.domain_type, name=name, kernel=cfg["kernel"],
                               initrd=cfg["initrd"], disk=disk, log=own / "serial.log")
        dom = ctl.conn.defineXML(xml)
        assert not dom.isActive()
        yield ctl, name, own, made
    finally:
        for n in made:
            try:
                ctl.destroy_and_undefine(n)
            except VMError:
                undefine_quietly(n)
        ctl.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(own, ignore_errors=True)


def test_adopted_domain_saves_restores_and_forks(adopted) -> None:
    ctl, name, own, made = adopted
    before_xml = ctl.xml(name, inactive=True)
    assert ctl.adopt("mine", name) == name
    assert ctl.state(name) == "running"
    assert ctl.xml(name, inactive=True) == before_xml, "adopting changed the definition"
    log = ctl.console_log("mine")
    assert log == own / "serial.log"
    wait_for_counter(log, at_least=3)

    copies = own / "copies"
    copies.mkdir()
    frozen = ctl.snapshot("mine", name)
    (fd,) = frozen.disks
    assert fd.top == str(own / "mine.qcow2") and fd.changed is None
    c1 = copies / "c1.disk"
    copy_source(fd.source, c1)
    shutil.copyfile(frozen.memory_path, copies / "c1.mem")
    ctl.finish(frozen, "c1")
    lines = transcript(c1)
    assert lines and lines[-1]["lineage"] == "mine"
    last = lines[-1]["seq"]

    # a second checkpoint commits into the user's own disk and stays incremental
    wait_for_counter(log, at_least=last + 4)
    frozen = ctl.snapshot("mine", name)
    (fd,) = frozen.disks
    assert frozen.base_checkpoint == "c1" and fd.changed
    assert fd.root == str(own / "mine.qcow2")
    ctl.finish(frozen, "c2")
    files = ctl.disk_files(name)
    info = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", files["vda"]],
                          capture_output=True, text=True, check=True).stdout
    assert info.count("image:") == 2 and str(own / "mine.qcow2") in info

    # restore to c1: the counter goes back to c1's
    wait_for_counter(log, at_least=last + 8)
    ctl.pause(name)
    offset = settled_size(log)  # what the old run printed before the pause landed
    ctl.restore("mine", name, FileReader(copies / "c1.mem"), {"vda": FileReader(c1)},
                checkpoint="c1")
    assert ctl.state(name) == "paused"
    # The user's log (no append='on' in their definition) keeps its history across the
    # restore (QA, fifteenth session: QEMU truncated it).
    assert log.stat().st_size >= offset
    ctl.resume(name)
    seen = wait_for_counter(log, at_least=last + 2, start=offset, count=2)
    assert last <= seen[0] <= last + 1
    after = ctl.xml(name, inactive=True)
    assert "defined by the adoption test" in after and "ksfs.lineage=mine" in after

    # fork c1 into a new domain beside it
    child = unique_domain("ksfs-test-adoptfork")
    made.append(child)
    res = ctl.fork("mine-child", child, FileReader(copies / "c1.mem"), {"vda": FileReader(c1)},
                   checkpoint="c1")
    assert res.domain == child and ctl.state(child) == "paused"
    child_log = ctl.console_log("mine-child")
    assert child_log is not None and child_log != log
    ctl.resume(child)
    seen = wait_for_counter(child_log, at_least=last + 2)
    assert last <= seen[0] <= last + 1
    assert ctl.state(name) == "running"
    parent_now = counters(log)[-1]
    wait_for_counter(log, at_least=parent_now + 1)
    child_xml = ctl.xml(child)
    assert "ksfs.lineage=mine-child" in child_xml
    assert str(own) not in child_xml.split("<devices>")[1].split("</disk>")[0]
