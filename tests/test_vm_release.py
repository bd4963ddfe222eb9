"""`ksfs session rm --release`: an adopted domain handed back to its user, defined and in its
state, on disk files outside the store, against a real libvirtd, QEMU and the test guest.

Every domain made here is destroyed and undefined at the end, even on failure (``adopted``).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from ksfs.vm import domxml
from tests import test_keeper_vm as kvm
from tests.cli_helpers import virsh
from tests.test_keeper_vm import (
    adopted,
    plain_domain_xml,
    run,
    save,
    transcript_lines,
    wait_transcript,
)

pytestmark = pytest.mark.vm
env, guest = kvm.env, kvm.guest  # the module's own store (a fixture per module), no booted agent


def sources(dom: str, inactive: bool = False) -> dict[str, str]:
    """target -> source file of the domain's disks, live or as defined."""
    xml = virsh("dumpxml", *(["--inactive"] if inactive else []), dom, check=True).stdout
    return {d.target: d.source for d in domxml.disks(xml)}


def chain_of(path: str) -> list[str]:
    info = json.loads(subprocess.run(["qemu-img", "info", "-U", "--backing-chain",
                                      "--output=json", path], capture_output=True, text=True,
                                     check=True).stdout)
    return [i["filename"] for i in info]


def raw_domain(env: dict, guest: Path, tmp_path: Path, prefix: str) -> tuple[str, Path, str]:
    """(domain name, its raw disk, its XML): a user's domain on a copy of the guest's disk."""
    spec = json.loads((guest / "guest.json").read_text())
    own = tmp_path / "own.raw"
    subprocess.run(["cp", "--sparse=always", spec["disk"], str(own)], check=True)
    tmp_path.chmod(0o755)
    dom = f"{prefix}-{env['tag']}"
    return dom, own, plain_domain_xml(dom, spec, [(own, "raw", "vda")])


def test_release_after_a_restore_copies_out_and_the_machine_goes_on(
        env, guest: Path, tmp_path: Path) -> None:
    store, e = env["store"], env["env"]
    spec = json.loads((guest / "guest.json").read_text())
    dom, name, again = (f"rel-{env['tag']}", f"rel-{env['tag']}", f"rel2-{env['tag']}")
    home = tmp_path / "o'b"  # QA: a quote in the user's path broke the copy's disk XML
    home.mkdir()
    own = home / "own.qcow2"
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", spec["disk"], str(own)], check=True)
    tmp_path.chmod(0o755)
    home.chmod(0o755)
    xml = plain_domain_xml(dom, spec, [(own, "qcow2", "vda")]).replace(
        f"file='{own}'", f'file="{own}"')
    with adopted(env, tmp_path / "dom.xml", xml, dom, name, again):
        c1 = wait_transcript(store, name, e, 2)
        at_c1 = transcript_lines(store, name, c1, e)
        save(store, name, e)
        run(store, "restore", name, c1, env=e)  # the disk now runs on a file ksfs wrote
        run(store, "restore", name, c1, env=e)
        # QA: each restore of an adopted session left the one before's whole disk copy
        assert len(list((store / "vm" / name).glob("*-base-*.raw"))) == 1
        assert str(store / "vm" / name) in sources(dom)["vda"]
        res = json.loads(run(store, "session", "rm", name, "--release", "--json", env=e).stdout)
        released = str(home / "own.released.qcow2")
        assert res["released"] == {"domain": dom, "disks": {"vda": released}}
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert sources(dom) == sources(dom, inactive=True) == {"vda": released}
        assert chain_of(released) == [released]  # self-contained, in the domain's own format
        assert oct(Path(released).stat().st_mode & 0o777) == oct(own.stat().st_mode & 0o777)
        assert json.loads(subprocess.run(["qemu-img", "info", "-U", "--output=json", released],
                                         capture_output=True, text=True).stdout)["format"] == \
            "qcow2"
        assert not (store / "vm" / name).exists() and own.exists()
        assert name not in run(store, "session", "list", env=e).stdout
        # The machine went on from c1 through the release: adopted again, its transcript is
        # c1's, then lines written after the restore, on the released disk.
        run(store, "session", "adopt", again, dom, env=e)
        later = wait_transcript(store, again, e, len(at_c1) + 2)
        lines = transcript_lines(store, again, later, e)
        assert lines[: len(at_c1)] == at_c1 and lines[len(at_c1)]["seq"] == at_c1[-1]["seq"] + 1
        # No restore since this adoption: the layers are committed into the released file. A
        # release killed once the machine was handed back is finished by recover.
        save(store, again, e)
        killed = run(store, "session", "rm", again, "--release", check=False,
                     env=dict(e, KSFS_CRASH_AT="session.remove"))
        assert killed.returncode == -signal.SIGKILL
        report = json.loads(run(store, "recover", "--json", env=e).stdout)
        actions = {r["session"]: r["actions"] for r in report}[again]
        assert any("finished (machine released)" in a for a in actions), actions
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert sources(dom) == sources(dom, inactive=True) == {"vda": released}
        assert chain_of(released) == [released]
        assert not (store / "vm" / again).exists()


def test_release_of_a_shut_off_domain_commits_and_it_boots(
        env, guest: Path, tmp_path: Path) -> None:
    store, e = env["store"], env["env"]
    dom, own, xml = raw_domain(env, guest, tmp_path, "relo")
    name = dom
    with adopted(env, tmp_path / "dom.xml", xml, dom, name, f"unused-{env['tag']}"):
        cp = wait_transcript(store, name, e, 2)
        at_cp = transcript_lines(store, name, cp, e)
        virsh("destroy", dom, check=True)
        res = json.loads(run(store, "session", "rm", name, "--release", "--json", env=e).stdout)
        assert res["released"]["disks"] == {"vda": str(own)}
        assert virsh("domstate", dom).stdout.strip() == "shut off"
        assert sources(dom, inactive=True) == {"vda": str(own)} and chain_of(str(own)) == [str(own)]
        assert not (store / "vm" / name).exists()
        virsh("start", dom, check=True)
        run(store, "session", "adopt", name, dom, env=e)
        later = wait_transcript(store, name, e, 1)
        # booted again from the committed disk: the transcript written before the release
        # (as of the checkpoint at least) is on it
        assert transcript_lines(store, name, later, e)[: len(at_cp)] == at_cp
        # the user undefined it meanwhile: nothing to hand back, said as bad input
        virsh("destroy", dom, check=True)
        virsh("undefine", dom, check=True)
        gone = run(store, "session", "rm", name, "--release", check=False, env=e)
        assert gone.returncode == 2 and "is gone" in gone.stderr, gone.stderr
        assert name in run(store, "session", "list", env=e).stdout


def test_a_release_cut_short_changes_nothing_or_is_finished_never_destroyed(
        env, guest: Path, tmp_path: Path) -> None:
    """Review (eleventh session): a release failing mid-copy left the block job mirroring
    (every later save refused); one killed after the session's files went could never be
    finished, and a plain `session rm` then destroyed the machine it had handed back."""
    store, e = env["store"], env["env"]
    dom, own, xml = raw_domain(env, guest, tmp_path, "relc")
    name = dom
    with adopted(env, tmp_path / "dom.xml", xml, dom, name, f"unused-{env['tag']}"):
        cp = wait_transcript(store, name, e, 1)
        run(store, "restore", name, cp, env=e)  # a copy, so a job runs for a while
        failed = run(store, "session", "rm", name, "--release", check=False,
                     env=dict(e, KSFS_FAIL_AT="vm.release.job"))
        assert failed.returncode == 1 and "injected fault" in failed.stderr
        assert not (tmp_path / "own.released.raw").exists()
        assert str(store / "vm" / name) in sources(dom)["vda"]
        assert name in run(store, "session", "list", env=e).stdout
        save(store, name, e)  # no job left behind: the session saves as before
        # killed with its copy running: recover pivots to it and finishes the release
        killed = run(store, "session", "rm", name, "--release", check=False,
                     env=dict(e, KSFS_CRASH_AT="vm.release.job"))
        assert killed.returncode == -signal.SIGKILL
        run(store, "recover", env=e)
        released = str(tmp_path / "own.released.raw")
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert sources(dom) == sources(dom, inactive=True) == {"vda": released}
        assert name not in run(store, "session", "list", "--all", env=e).stdout
        # adopted again; killed once its files are gone: a plain rm finishes the release it
        # finds begun, and destroys nothing
        run(store, "session", "adopt", name, dom, env=e)
        save(store, name, e)
        killed = run(store, "session", "rm", name, "--release", check=False,
                     env=dict(e, KSFS_CRASH_AT="session.remove.files"))
        assert killed.returncode == -signal.SIGKILL
        assert sources(dom) == {"vda": released}
        run(store, "session", "rm", name, env=e)
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert sources(dom) == sources(dom, inactive=True) == {"vda": released}
        assert name not in run(store, "session", "list", "--all", env=e).stdout


def test_a_released_copy_adopted_again_gets_the_next_number(tmp_path: Path) -> None:
    from ksfs.vm.release import released_name

    disk = tmp_path / "disk.qcow2"
    assert released_name(disk) == tmp_path / "disk.released.qcow2"
    (tmp_path / "disk.released.qcow2").touch()
    assert released_name(tmp_path / "disk.released.qcow2") == \
        tmp_path / "disk.released-2.qcow2"
    (tmp_path / "disk.released-2.qcow2").touch()
    assert released_name(tmp_path / "disk.released-2.qcow2") == \
        tmp_path / "disk.released-3.qcow2"


def test_a_release_cut_short_after_one_disk_is_finished_not_undone(
        env, guest: Path, tmp_path: Path) -> None:
    """QA (eighteenth session): Ctrl-C once one disk of two was handed back recorded the
    removal failed and kept that disk as the session's: the next save copied it out again as
    a detached disk (a stale second copy), and its file stayed 0600. Now the handed-back disk
    is the user's at once, and the removal stays open: `session rm` or recover finishes it."""
    store, e = env["store"], env["env"]
    spec = json.loads((guest / "guest.json").read_text())
    own, data = tmp_path / "own.raw", tmp_path / "data.raw"
    subprocess.run(["cp", "--sparse=always", spec["disk"], str(own)], check=True)
    with open(data, "wb") as f:
        f.truncate(8 << 20)
    tmp_path.chmod(0o755)
    own.chmod(0o644)
    dom = name = f"reltwo-{env['tag']}"
    xml = plain_domain_xml(dom, spec, [(own, "raw", "vda"), (data, "raw", "vdb")])
    released = {"vda": str(tmp_path / "own.released.raw"),
                "vdb": str(tmp_path / "data.released.raw")}
    with adopted(env, tmp_path / "dom.xml", xml, dom, name, f"unused-{env['tag']}"):
        cp = wait_transcript(store, name, e, 1)
        run(store, "restore", name, cp, env=e)  # both disks now run on files ksfs wrote
        cut = run(store, "session", "rm", name, "--release", check=False,
                  env=dict(e, KSFS_INTERRUPT_AT="vm.release.disk"))
        assert cut.returncode == 130, cut.stderr
        assert (f"the machine of session {name} is partly handed back (disks vda), but the "
                f"session is still listed: `ksfs session rm {name}` again finishes it"
                ) in cut.stderr, cut.stderr
        now = sources(dom)
        assert now["vda"] == released["vda"] and str(store / "vm" / name) in now["vdb"]
        assert sources(dom, inactive=True)["vda"] == released["vda"]
        assert oct(Path(released["vda"]).stat().st_mode & 0o777) == "0o644"
        kinds = [ev["type"] for ev in kvm.events_of(store, name, e)]
        assert kinds[-1] == "session.removing", kinds[-3:]  # open, not remove_failed
        saved = run(store, "save", name, env=e)  # vda is no detached disk of the session's
        assert "detached" not in saved.stderr, saved.stderr
        assert not list(tmp_path.glob("own.released-*"))
        run(store, "session", "rm", name, env=e)  # finishes the release it finds begun
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert sources(dom) == sources(dom, inactive=True) == released
        assert name not in run(store, "session", "list", "--all", env=e).stdout
        # killed at the same place instead: recover finishes it
        run(store, "session", "adopt", name, dom, env=e)
        cp = wait_transcript(store, name, e, 1)
        run(store, "restore", name, cp, env=e)
        killed = run(store, "session", "rm", name, "--release", check=False,
                     env=dict(e, KSFS_CRASH_AT="vm.release.disk"))
        assert killed.returncode == -signal.SIGKILL
        run(store, "recover", env=e)
        again = {t: p.replace(".released.", ".released-2.") for t, p in released.items()}
        assert virsh("domstate", dom).stdout.strip() == "running"
        assert sources(dom) == sources(dom, inactive=True) == again
        assert name not in run(store, "session", "list", "--all", env=e).stdout
