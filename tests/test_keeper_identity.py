"""A chain root's label names one checkpoint for ever (its session's lineage and its seq), not
whichever checkpoint holds its name now (QA, critical: a fork's save patched its changes into the
parent's new ``base`` and stored a disk the guest never had). No machine needed: the labels and
their look-ups are the keeper's; tests/test_keeper_vm_qa.py does it with a real guest."""

from __future__ import annotations

from pathlib import Path

from ksfs.keeper import Keeper
from ksfs.keeper.machine import checkpoint_label, label_name, parse_label
from ksfs.model import ForkPoint


def test_labels_split_back_and_say_the_name_alone_to_users() -> None:
    assert parse_label("p/base/ab12:7") == ("p", "base", "ab12", 7)
    assert parse_label("p/base") == ("p", "base", None, None)  # an older ksfs's
    for other in (None, "", "snap-3", "restore-2", "p/", "/c", "p/c/x", "p/c/:3", "a/b/c/d"):
        assert parse_label(other) is None, other
    assert label_name("p/base/ab12:7") == "p/base"
    assert label_name("p/base") == "p/base"
    assert label_name("restore-2") == "restore-2" and label_name(None) is None


def test_a_checkpoint_that_took_the_name_is_not_the_base(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\n")
    with Keeper(tmp_path / "store", create=True) as k:
        k.import_files("p", "base", [tmp_path / "a.txt"])
        first = k.ledger.checkpoint("p", "base")
        label = checkpoint_label(k.ledger.session("p").lineage, first)
        assert k._base_checkpoint(label) == first
        assert k._base_checkpoint("p/base") is None  # a name alone: not trusted
        # the parent's `rm base; save base`
        k.delete_checkpoint("p", "base")
        assert k._base_checkpoint(label) is None
        k.import_files("p", "base", [tmp_path / "a.txt"])
        assert k.ledger.checkpoint("p", "base").seq != first.seq
        assert k._base_checkpoint(label) is None
        # the session removed and made again: same name, same seq, another lineage
        again = k.ledger.checkpoint("p", "base")
        label = checkpoint_label(k.ledger.session("p").lineage, again)
        k.remove_session("p")
        k.import_files("p", None, [tmp_path / "a.txt"])
        k.delete_checkpoint("p", k.ledger.checkpoint_names("p")[0])
        k.import_files("p", "base", [tmp_path / "a.txt"])
        now = k.ledger.checkpoint("p", "base")
        assert now.seq == again.seq, (now.seq, again.seq)  # the collision QA found (c_0001)
        assert k._base_checkpoint(label) is None


def test_the_fork_point_recover_reconciles_to_is_that_very_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\n")
    with Keeper(tmp_path / "store", create=True) as k:
        k.import_files("p", "base", [tmp_path / "a.txt"])
        cp = k.ledger.checkpoint("p", "base")
        with k.store.env.begin(write=True) as txn:
            k.ledger.create_session(txn, "child", parent=ForkPoint("p", "base", cp.seq))
        child = k.ledger.session("child")
        assert k._fork_point(child) == cp
        k.delete_checkpoint("p", "base")
        assert k._fork_point(child) is None
        k.import_files("p", "base", [tmp_path / "a.txt"])  # another 'base'
        assert k._fork_point(child) is None


class HeldAt:
    """A controller whose machine's chain root holds ``label`` (the keeper's own says the
    name alone through holds_checkpoint and the whole label through held_label)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def held_label(self, session: str) -> str:
        return self.label

    def holds_checkpoint(self, session: str) -> str | None:
        return label_name(self.label)


def test_recover_brings_a_machine_back_to_its_very_checkpoint_never_an_import(
        tmp_path: Path) -> None:
    """Review of QA 5's fix: _last_good found the checkpoint the chain root holds by name, so
    after `rm base; import base` it chose that import (no domain XML: recover saved the disks,
    then failed), and saves after the real base were passed over."""
    import dataclasses

    from ksfs.ledger import keys as K
    from ksfs.ledger.records import checkpoint_dict

    (tmp_path / "memory").write_text("pages\n")
    (tmp_path / "a.txt").write_text("one\n")

    def machine_checkpoint(k: Keeper, name: str, *files: Path):
        rec = k.import_files("s", name, list(files))
        rec = dataclasses.replace(k.ledger.checkpoint("s", rec.name), domain_xml="<domain/>")
        lineage = K.lineage_bytes(k.ledger.session("s").lineage)
        with k.store.env.begin(write=True) as txn:  # as a save would have published it
            txn.put(K.ckpt_name_key(lineage, name), K.dumps(checkpoint_dict(rec)),
                    db=k.ledger._ckpts)
        return rec

    with Keeper(tmp_path / "store", create=True) as k:
        machine_checkpoint(k, "old", tmp_path / "memory")
        base = machine_checkpoint(k, "base", tmp_path / "a.txt")
        k._vm = HeldAt(checkpoint_label(k.ledger.session("s").lineage, base))
        assert k._last_good("s") == "base"
        machine_checkpoint(k, "later", tmp_path / "a.txt")
        k.import_files("s", "notes", [tmp_path / "a.txt"])  # an import: no machine
        assert k._last_good("s") == "later"
        k.delete_checkpoint("s", "base")
        assert k._last_good("s") == "later"  # saves after a deleted root's checkpoint count
        k.delete_checkpoint("s", "later")
        k.import_files("s", "base", [tmp_path / "a.txt"])  # an import took the name
        assert k._last_good("s") == "old"  # the newest with a machine and its memory
        # an older ksfs's label (the name alone) is still taken by name, but never an import
        k._vm = HeldAt("s/base")
        assert k._last_good("s") == "old"


def test_a_restore_is_taken_for_done_only_on_its_very_checkpoint(tmp_path: Path) -> None:
    """Review: recover's finishing of a killed restore, and a restore's 'left paused' check,
    compared the name the chain root holds with the target's: a root still labelled with a
    checkpoint deleted and saved again under that name passed for the restore's."""
    (tmp_path / "a.txt").write_text("one\n")
    with Keeper(tmp_path / "store", create=True) as k:
        base = k.import_files("s", "base", [tmp_path / "a.txt"])
        k._vm = HeldAt(checkpoint_label(k.ledger.session("s").lineage, base))
        assert k._holds_exactly("s", "base")
        assert not k._holds_exactly("s", "other")
        k.delete_checkpoint("s", "base")
        assert not k._holds_exactly("s", "base")  # gone
        k.import_files("s", "base", [tmp_path / "a.txt"])
        assert not k._holds_exactly("s", "base")  # another took the name
        k._vm = HeldAt("s/base")  # an older ksfs's label: the name is all there is
        assert k._holds_exactly("s", "base")
        k._vm = HeldAt("restore-3")
        assert not k._holds_exactly("s", "base")
