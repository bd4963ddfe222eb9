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
