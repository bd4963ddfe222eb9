"""What recover may delete of a session's files (review, tenth session): files are told apart
by device and inode, so a store reached by another spelling (a symlink, a bind mount) than
the one its machine's definition and state were written with never has its running chain
taken for leftovers; and a session killed before it had a state (a fork or session new
killed early) is left for recover to roll back, not failed on. No libvirt needed: these stop
before any is asked."""

from __future__ import annotations

from pathlib import Path

from ksfs.vm import restore
from ksfs.vm.controller import DomainController


def test_files_to_keep_are_known_by_inode_not_by_spelling(tmp_path: Path) -> None:
    real = tmp_path / "real"
    ctl = DomainController(workdir=real / "vm")
    d = real / "vm" / "s"
    d.mkdir(parents=True)
    for name in ("vda-base-1.raw", "vda-1.qcow2", "vda-base-2.raw", "vda-2.qcow2"):
        (d / name).write_bytes(b"x")
    alias = tmp_path / "alias"
    alias.symlink_to(real)
    # the chain in use, as the machine's definition spells it: through the symlink
    keep = {alias / "vm" / "s" / "vda-base-1.raw", alias / "vm" / "s" / "vda-1.qcow2"}
    left = sorted(p.name for p in restore._session_files_except(ctl, "s", keep))
    assert left == ["vda-2.qcow2", "vda-base-2.raw"]
    # a file to keep that cannot be looked at: nothing is known to be unused
    assert restore._session_files_except(ctl, "s", keep | {tmp_path / "gone.raw"}) == []


def test_a_session_with_no_state_yet_has_no_leftovers_to_drop(tmp_path: Path) -> None:
    ctl = DomainController(workdir=tmp_path / "vm")
    d = tmp_path / "vm" / "early"
    d.mkdir(parents=True)
    (d / "vda-base-1.raw.part").write_bytes(b"x" * 4096)
    assert restore.unused_disk_files(ctl, "early", "ksfs-early") == []
    # the half-written file still goes (it is a .part), and nothing raises
    assert ctl.drop_leftovers("early", "ksfs-early") >= 0
    assert not (d / "vda-base-1.raw.part").exists()


class _Dom:
    def isActive(self) -> int:  # noqa: N802 - libvirt's name
        return 0  # shut off: nothing to wait for


def _domain_xml(top: Path) -> str:
    return (f"<domain><devices><disk type='file' device='disk'><driver type='qcow2'/>"
            f"<source file='{top}'/><target dev='vda'/></disk></devices></domain>")


def _ctl_with(tmp_path: Path, top: Path) -> DomainController:
    ctl = DomainController(workdir=tmp_path / "vm")
    ctl.lookup = lambda domain: _Dom()  # the domain, as far as settle_commits asks it
    ctl.xml = lambda domain, inactive=False: _domain_xml(top)
    return ctl


def _state(ctl: DomainController, root: Path, committing: dict, target: str = "vda") -> None:
    from ksfs.vm.state import DiskState, SessionState

    (ctl.workdir / "s").mkdir(parents=True, exist_ok=True)
    ds = DiskState(str(root), "raw", "s/old", committing=committing)
    ctl.save_state("s", SessionState("ksfs-s", {target: ds}))


def test_settling_commits_gives_a_label_only_to_a_root_below_a_layer(tmp_path: Path) -> None:
    """Review (tenth session): a commit settled for a disk the domain no longer has blocked
    every later save; a root an outside block commit pivoted to the top (it takes writes no
    layer records) must not keep a label."""
    import subprocess

    from ksfs.vm.checkpoint import settle_commits

    base = tmp_path / "vm" / "s" / "base.raw"
    base.parent.mkdir(parents=True)
    base.write_bytes(bytes(1 << 20))
    top = tmp_path / "vm" / "s" / "top.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base),
                    str(top)], check=True)
    ctl = _ctl_with(tmp_path, top)
    gone = str(tmp_path / "vm" / "s" / "frozen.qcow2")  # committed and removed from the chain
    # the layers left the chain, the root is below a layer: it holds the new checkpoint
    _state(ctl, base, {"label": "s/new", "layers": [gone]})
    assert settle_commits(ctl, "s", "ksfs-s")
    ds = ctl.load_state("s").disks["vda"]
    assert ds.base_checkpoint == "s/new" and ds.committing is None
    # the layers still in the chain: the old label stays right
    _state(ctl, base, {"label": "s/new", "layers": [str(top)]})
    settle_commits(ctl, "s", "ksfs-s")
    assert ctl.load_state("s").disks["vda"].base_checkpoint == "s/old"
    # the root pivoted to the top: nothing is known of what it holds
    _state(ctl, top, {"label": "s/new", "layers": [gone]})
    settle_commits(ctl, "s", "ksfs-s")
    assert ctl.load_state("s").disks["vda"].base_checkpoint is None
    # a disk the domain no longer has: settled (no label), never waited for
    _state(ctl, base, {"label": "s/new", "layers": [gone]}, target="vdz")
    settle_commits(ctl, "s", "ksfs-s")
    ds = ctl.load_state("s").disks["vdz"]
    assert ds.base_checkpoint is None and ds.committing is None
