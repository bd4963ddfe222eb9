"""The QA report on guests other than the project's test guest (second VM round), through the
command line against a real libvirtd and QEMU.

- A raw disk is never taken for the format its first bytes look like: a guest that wrote a
  qcow2 header naming a host file as backing file into its raw disk got that host file stored
  as its checkpoint's disk and given back to it by restore (adopt), and `session new` took a
  raw disk so even when guest.json said raw.

The domains are tiny BIOS machines (a 512-byte boot sector, or none: a disk that does not boot
leaves SeaBIOS waiting, which is a running machine all the same), so nothing here boots a
kernel but the `session new` case. One store per module; every domain and session made here
is removed at the end, even on failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from ksfs.vm.chain import ChainSource, create_overlay
from ksfs.vm.files import inspect_disk
from tests.cli_helpers import KSFS, guest_dir, ksfs, remove_sessions, virsh

pytestmark = pytest.mark.vm

MiB = 1 << 20
# cli; 1: hlt; jmp 1b ... 0x55aa: a machine that boots and halts
BOOT_SECTOR = b"\xfa\xf4\xeb\xfd".ljust(510, b"\0") + b"\x55\xaa"


def run(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return ksfs(env["store"], env["env"], *args, check=check)


def cat(env: dict, session: str, checkpoint: str, name: str) -> bytes:
    res = subprocess.run([*KSFS, "--store", str(env["store"]), "cat", session, checkpoint, name],
                         capture_output=True, env=env["env"], timeout=300)
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    guest = guest_dir()  # libvirtd up (and the test guest built, for session new)
    base = tmp_path_factory.mktemp("vmqa2")
    base.chmod(0o755)
    store = base / "store"
    e = dict(os.environ, KSFS_GUEST=str(guest))
    sessions: list[str] = []
    domains: list[str] = []
    yield {"store": store, "env": e, "tag": uuid.uuid4().hex[:6], "sessions": sessions,
           "domains": domains, "base": base, "guest": guest,
           "spec": json.loads((guest / "guest.json").read_text())}
    remove_sessions(store, e, sessions)
    for dom in domains:
        virsh("destroy", dom)
        virsh("undefine", dom)
    shutil.rmtree(base, ignore_errors=True)


def new_dir(env: dict, name: str) -> Path:
    d = env["base"] / name
    d.mkdir()
    d.chmod(0o755)
    return d


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def define(env: dict, name: str, devices: str, boot: str = "hd") -> str:
    """Define a user's BIOS domain (TCG, 32 MiB) with ``devices`` (again: redefined, its UUID
    being its name's); removed at the end."""
    dom = f"qa2-{name}-{env['tag']}"
    xml = (f"<domain type='qemu'><name>{dom}</name>"
           f"<uuid>{uuid.uuid5(uuid.NAMESPACE_URL, dom)}</uuid><memory unit='MiB'>32</memory>"
           f"<vcpu>1</vcpu><os><type arch='x86_64' machine='pc'>hvm</type>"
           f"<boot dev='{boot}'/></os><devices>{devices}<memballoon model='none'/>"
           f"</devices></domain>")
    path = env["base"] / f"{dom}.xml"
    path.write_text(xml)
    env["domains"].append(dom)
    res = virsh("define", str(path))
    assert res.returncode == 0, res.stderr
    return dom


def file_disk(path: Path, fmt: str, target: str = "hda", extra: str = "",
              device: str = "disk", bus: str = "ide") -> str:
    return (f"<disk type='file' device='{device}'><driver name='qemu' type='{fmt}'/>"
            f"<source file='{path}'/><target dev='{target}' bus='{bus}'/>{extra}</disk>")


def planted_raw_disk(d: Path, size: int) -> tuple[Path, Path]:
    """(a host file the guest must never see, a raw disk whose first bytes are a qcow2
    header naming that file as its backing file, as a guest writing sector 0 makes it)."""
    secret = d / "secret.txt"
    secret.write_bytes(b"HOST-SECRET-" + uuid.uuid4().hex.encode() + b"\n")
    os.truncate(secret, MiB)
    payload = d / "payload.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=512",
                    "-b", str(secret), "-F", "raw", str(payload), "1M"], check=True)
    disk = d / "disk.raw"
    with open(disk, "wb") as f:
        f.write(payload.read_bytes())
        f.seek(size // 2)
        f.write(b"GUEST-OWN-DATA")  # what the guest's disk holds past the header
        f.truncate(size)
    disk.chmod(0o644)
    return secret, disk


def test_chain_helpers_read_a_raw_disk_as_raw_whatever_it_begins_with(tmp_path) -> None:
    """No libvirt: a raw file holding a qcow2 header is read as the raw file when its format
    is given, and so is it under one of ksfs's overlays (made with -F)."""
    secret, disk = planted_raw_disk(tmp_path, 4 * MiB)
    own = disk.read_bytes()
    src = ChainSource(disk, "raw disk", fmt="raw")
    try:
        assert src.size == 4 * MiB and src.files == [disk]
        assert src.pread(0, src.size) == own
    finally:
        src.close()
    plan = inspect_disk(disk, "raw")
    assert (plan.fmt, plan.convert) == ("raw", None)
    overlay = tmp_path / "hda-1.qcow2"
    create_overlay(overlay, disk, "raw", "overlay", 4096)
    src = ChainSource(overlay, "overlay", fmt="qcow2")
    try:
        assert src.files == [overlay, disk] and src.formats == ["qcow2", "raw"]
        assert src.pread(0, src.size) == own
    finally:
        src.close()


def test_adopted_raw_disk_with_a_qcow2_header_is_kept_as_its_own_bytes(env) -> None:
    """QA (critical): the first save of an adopted raw disk whose guest wrote a qcow2 header
    naming a host file stored that host file as the disk (1 MiB of it, not the 8 MiB disk), and
    restore gave it to the guest. Save, restore and release now keep the raw disk's bytes."""
    d = new_dir(env, "probe")
    secret, disk = planted_raw_disk(d, 8 * MiB)
    own = disk.read_bytes()
    dom = define(env, "probe", file_disk(disk, "raw"))
    s = f"qa2-probe-{env['tag']}"
    env["sessions"].append(s)
    run(env, "session", "adopt", s, dom)
    run(env, "save", s, "p1")
    stored = cat(env, s, "p1", "disk.raw")
    assert b"HOST-SECRET" not in stored
    assert len(stored) == len(own) and sha(stored) == sha(own)
    assert disk.read_bytes() == own  # the commit into the user's raw file changed nothing

    run(env, "restore", s, "p1")
    info = virsh("domblkinfo", dom, "hda", check=True).stdout
    assert f"Capacity:       {8 * MiB}" in info, info
    (base,) = (env["store"] / "vm" / s).glob("hda-base-*.raw")
    assert base.read_bytes() == own
    run(env, "save", s, "p2")
    assert sha(cat(env, s, "p2", "disk.raw")) == sha(own)

    # handed back after the restore: a copy of the restored disk, raw, beside the user's
    run(env, "session", "rm", s, "--release")
    env["sessions"].remove(s)
    released = d / "disk.released.raw"
    assert released.read_bytes() == own
    xml = virsh("dumpxml", dom, check=True).stdout
    assert str(released) in xml and "type='raw'" in xml, xml
    assert secret.read_bytes().startswith(b"HOST-SECRET")


def test_session_new_follows_guest_json_disk_format(env) -> None:
    """QA (critical): `session new` took a raw disk that begins with a qcow2 header for qcow2
    against guest.json's "disk_format": "raw" (a warning only), and flattened its backing host
    file into the session's disk. The stated format wins; one that is not raw or qcow2, or
    qcow2 for a disk that is not one, is refused before anything is made."""
    d = new_dir(env, "newraw")
    secret, disk = planted_raw_disk(d, 16 * MiB)
    own = disk.read_bytes()
    spec = dict(env["spec"], disk=str(disk), disk_format="raw")
    (d / "guest.json").write_text(json.dumps(spec))
    s = f"qa2-newraw-{env['tag']}"
    env["sessions"].append(s)
    made = run(env, "session", "new", s, "--guest", str(d))
    assert "taken as raw" in made.stderr and "qcow2" in made.stderr, made.stderr
    vmdir = env["store"] / "vm" / s
    assert (vmdir / "vda-0.raw").read_bytes() == own
    run(env, "save", s, "n1")
    stored = cat(env, s, "n1", "disk.raw")
    assert b"HOST-SECRET" not in stored and sha(stored) == sha(own)

    (d / "plain.raw").write_bytes(bytes(MiB))
    bad = f"qa2-newbad-{env['tag']}"
    for name, fmt, words in (("plain.raw", "qcow2", "not a qcow2 image"),
                             ("disk.raw", "vmdk", "disk_format")):
        (d / "guest.json").write_text(json.dumps(dict(spec, disk=name, disk_format=fmt)))
        res = run(env, "session", "new", bad, "--guest", str(d), check=False)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], res.stderr
        assert not (env["store"] / "vm" / bad).exists()
        assert virsh("domstate", f"ksfs-{bad}").returncode != 0


def assert_refused(env: dict, res: subprocess.CompletedProcess, code: int, session: str,
                   dom: str, *words: str) -> None:
    """One error line with ``words``, exit ``code``; no session, no files, the domain left
    shut off."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, (res.returncode, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("ksfs: error: "), res.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert virsh("domstate", dom).stdout.strip() == "shut off"
    assert not (env["store"] / "vm" / session).exists()
    if env["store"].exists():  # (else the refused verb was the first: it made no store)
        listed = run(env, "session", "list", "--json")
        assert session not in [s["session"] for s in json.loads(listed.stdout)]


def test_adopt_refuses_a_writable_floppy(env) -> None:
    """QA: a floppy without <readonly/> was left out of checkpoints as if the guest could not
    change it: a restore left it holding later writes, and a fork failed on QEMU's write lock.
    Adopt refuses it, naming the floppy and the fix; a read-only floppy is still taken."""
    d = new_dir(env, "floppy")
    floppy, hd = d / "floppy.img", d / "hd.raw"
    floppy.write_bytes(BOOT_SECTOR)
    os.truncate(floppy, 1474560)
    hd.write_bytes(bytes(4 * MiB))
    before = floppy.read_bytes()
    fd = file_disk(floppy, "raw", "fda", device="floppy", bus="fdc")
    dom = define(env, "floppy", fd + file_disk(hd, "raw"), boot="fd")
    s = f"qa2-floppy-{env['tag']}"
    res = run(env, "session", "adopt", s, dom, check=False)
    assert_refused(env, res, 2, s, dom, f"floppy fda of domain {dom} ({floppy}) is writable",
                   "<readonly/>", "attach the image as a disk")
    assert floppy.read_bytes() == before

    # read-only: the guest cannot change it, so leaving it out of checkpoints is right
    fd = file_disk(floppy, "raw", "fda", "<readonly/>", device="floppy", bus="fdc")
    dom = define(env, "floppy", fd + file_disk(hd, "raw"), boot="fd")
    env["sessions"].append(s)
    run(env, "session", "adopt", s, dom, "--no-start")
    run(env, "session", "rm", s)
    env["sessions"].remove(s)


def bios_qcow2(d: Path) -> Path:
    """A qcow2 disk that boots a machine which halts."""
    raw, disk = d / "boot.raw", d / "disk.qcow2"
    raw.write_bytes(BOOT_SECTOR)
    os.truncate(raw, 4 * MiB)
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(disk)],
                   check=True)
    raw.unlink()
    return disk


def test_adopt_refuses_a_domain_another_store_keeps(env) -> None:
    """QA: a domain store A keeps was adopted by store B too; B's saves then moved A's layers
    into A's session directory, and B's `session rm` destroyed the domain A's session ran on.
    A domain whose disk chain holds a file under another store is refused (exit 4, naming that
    store), whether A adopted it (and saved) or made it (a fork); A goes on as before."""
    d = new_dir(env, "cross")
    disk = bios_qcow2(d)
    dom = define(env, "cross", file_disk(disk, "qcow2"))
    a, f, b = (f"qa2-cross{x}-{env['tag']}" for x in "afb")
    store_b = env["base"] / "storeB"
    env["sessions"] += [a, f]
    run(env, "session", "adopt", a, dom)
    run(env, "save", a, "a1")
    try:
        for target in (dom, f"ksfs-{f}"):
            if target != dom:
                run(env, "fork", a, "a1", f)  # a domain store A made
            res = ksfs(store_b, env["env"], "session", "adopt", b, target, check=False)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 4, (res.returncode, res.stderr)
            assert len(lines) == 1 and lines[0].startswith("ksfs: error: "), res.stderr
            assert f"a file of the ksfs store {env['store']}" in lines[0], lines[0]
            assert f"domain '{target}' runs on {env['store']}/vm/" in lines[0], lines[0]
            assert not (store_b / "vm" / b).exists()
            assert virsh("domstate", target).stdout.strip() == "running"
        run(env, "save", a, "a2")  # store A's session undisturbed
        assert sorted(p.name for p in (env["store"] / "vm" / a).iterdir()
                      if p.suffix == ".qcow2" and "layer" in p.name) == []
    finally:
        remove_sessions(store_b, env["env"], [b])
    assert virsh("domstate", dom).stdout.strip() == "running"


def test_adopt_refuses_a_transient_disk(env) -> None:
    """QA: a domain with a <transient/> disk was adopted, then every save failed (libvirt runs
    no block job on a transient disk). Adopt refuses it, naming the disk and the fix."""
    d = new_dir(env, "transient")
    disk = bios_qcow2(d)
    dom = define(env, "transient", file_disk(disk, "qcow2", extra="<transient/>"))
    s = f"qa2-transient-{env['tag']}"
    res = run(env, "session", "adopt", s, dom, check=False)
    assert_refused(env, res, 2, s, dom, f"disk hda of domain {dom} is transient",
                   "remove <transient/>")


def test_session_new_disk_format_option_and_no_initrd(env) -> None:
    """QA: `session new --kernel K --disk D` with no initrd was refused (a kernel that mounts
    its root itself needs none; guest.json without "initrd" said 'initrd missing'), and only
    guest.json could state a disk's format. Now --disk-format raw keeps a raw disk raw, whatever
    it begins with, and a session without an initrd is defined with none, runs and saves."""
    d = new_dir(env, "noinitrd")
    _, disk = planted_raw_disk(d, 16 * MiB)
    own = disk.read_bytes()
    kernel = str(env["guest"] / "vmlinuz")
    s = f"qa2-noinitrd-{env['tag']}"
    env["sessions"].append(s)
    run(env, "session", "new", s, "--kernel", kernel, "--disk", str(disk),
        "--disk-format", "raw", "--memory", "128")
    dumped = virsh("dumpxml", f"ksfs-{s}").stdout
    assert "<kernel>" in dumped and "<initrd>" not in dumped, dumped
    assert (env["store"] / "vm" / s / "vda-0.raw").read_bytes() == own
    run(env, "save", s, "n1")
    assert sha(cat(env, s, "n1", "disk.raw")) == sha(own)
    run(env, "restore", s, "n1")  # restores and forks boot QEMU from the files it names
    f = f"qa2-noinitrdf-{env['tag']}"
    env["sessions"].append(f)
    run(env, "fork", s, "n1", f)
    assert "<initrd>" not in virsh("dumpxml", f"ksfs-{f}").stdout
    # the same from a guest.json without an initrd
    spec = {k: v for k, v in env["spec"].items() if k != "initrd"}
    (d / "guest.json").write_text(json.dumps(dict(spec, kernel=kernel, disk="disk.raw",
                                                  disk_format="raw", memory_mib=128)))
    g = f"qa2-noinitrdg-{env['tag']}"
    env["sessions"].append(g)
    run(env, "session", "new", g, "--guest", str(d))
    assert "<initrd>" not in virsh("dumpxml", f"ksfs-{g}").stdout
    # a kernel is still needed, and --disk-format takes raw or qcow2 only
    for args, code in ((["--disk", str(disk)], 2),
                       (["--kernel", kernel, "--disk", str(disk), "--disk-format", "vmdk"], 2)):
        bad = run(env, "session", "new", f"qa2-bad-{env['tag']}", *args, check=False)
        assert bad.returncode == code and "Traceback" not in bad.stderr, bad.stderr


def test_adopt_refuses_what_only_the_next_boots_definition_holds(env) -> None:
    """Review: adopt looked only at a running domain's live XML, so a <transient/> disk or a
    writable floppy defined for its next boot was adopted, and the first save or fork after
    a restart failed. Both are refused from the definition too; the machine keeps running."""
    d = new_dir(env, "defined")
    disk = bios_qcow2(d)
    floppy = d / "floppy.img"
    floppy.write_bytes(bytes(1474560))
    plain = file_disk(disk, "qcow2")
    for name, later, words in (
            ("deftr", file_disk(disk, "qcow2", extra="<transient/>"), "is transient"),
            ("deffl", plain + file_disk(floppy, "raw", "fda", device="floppy", bus="fdc"),
             "is writable")):
        dom = define(env, name, plain)
        assert virsh("start", dom).returncode == 0
        define(env, name, later)  # the definition changes; the running machine does not
        s = f"qa2-{name}-{env['tag']}"
        res = run(env, "session", "adopt", s, dom, check=False)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and words in lines[0], res.stderr
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert not (env["store"] / "vm" / s).exists()
        virsh("destroy", dom)


def test_planted_console_log_and_kernel_links_are_not_followed(env) -> None:
    """Security QA: a console.log link in a session's directory had libvirt (root) append the
    guest's console to the file it named at a restore, and a kernel link had a fork copy the
    file it named (root-only) into the fork's directory, readable by all. The link is removed
    before the machine starts (its victim untouched), and a fork refuses a copy that is no
    regular file, making nothing."""
    s = f"qa2-planted-{env['tag']}"
    env["sessions"].append(s)
    run(env, "session", "new", s, "--memory", "128")
    run(env, "save", s, "p1")
    d = env["store"] / "vm" / s
    victim = env["base"] / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    (d / "console.log").unlink()
    (d / "console.log").symlink_to(victim)
    run(env, "restore", s, "p1")
    assert victim.read_text() == "precious\n"
    assert not (d / "console.log").is_symlink()

    (d / "kernel").rename(d / "kernel.moved")
    (d / "kernel").symlink_to(victim)
    f = f"qa2-plantedf-{env['tag']}"
    res = run(env, "fork", s, "p1", f, check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 10 and len(lines) == 1, res.stderr
    assert "is not a regular file" in lines[0], lines[0]
    assert not (env["store"] / "vm" / f).exists()
    assert virsh("domstate", f"ksfs-{f}").returncode != 0
    (d / "kernel").unlink()
    (d / "kernel.moved").rename(d / "kernel")
