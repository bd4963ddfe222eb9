"""What a restore rolls back of the guest's transcript is measured from where the current
machine's timeline and the target's split, not from the target's seq (QA: restore to g1 at seq
236, the guest writes 237-246, restore "forward" to a checkpoint of the timeline left at seq 306:
the event said nothing was lost, though 237-246 were, their seqs in the target with other
nonces). No machine needed: the transcripts are read out of imported ext4 disks as a restore
reads them out of its save-first and its target; tests/test_keeper_vm_qa.py does it with a real
guest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ksfs.guestfs.mkimage import build_ext4, have_tools
from ksfs.keeper import Keeper
from ksfs.ledger import decide_reconcile
from ksfs.model import CheckpointRecord

needs_mkfs = pytest.mark.skipif(not have_tools() or shutil.which("mkfs.ext4") is None,
                                reason="needs mkfs.ext4")


def line(seq: int, nonce: str) -> str:
    return json.dumps({"seq": seq, "lineage": "L", "nonce": nonce, "op": "write"}) + "\n"


def test_rolled_back_is_counted_from_the_split_when_it_was_measured() -> None:
    cp = CheckpointRecord(session="g", name="c_0015", seq=40, created=0.0, files=(),
                          transcript_seq=306)
    args = dict(session_lineage="L", ancestry=[], checkpoint_lineage="L", after=[])
    tr = type("T", (), {"last_seq": 306, "lineage": "L", "count": 306})()
    # what it said before: the current disk's 246 is below the target's 306, so nothing
    body = decide_reconcile(cp, tr, current_transcript_seq=246, **args)
    assert body["transcript_rolled_back"] is None and "transcript_shared_seq" not in body
    body = decide_reconcile(cp, tr, current_transcript_seq=246, shared_transcript_seq=236,
                            **args)
    assert body["transcript_rolled_back"] == {"from": 237, "to": 246}
    assert body["transcript_shared_seq"] == 236
    # a restore back along the current timeline: the split is the target's own last line
    body = decide_reconcile(cp, tr, current_transcript_seq=400, shared_transcript_seq=306,
                            **args)
    assert body["transcript_rolled_back"] == {"from": 307, "to": 400}
    # nothing shared at all: every line the machine has is lost
    body = decide_reconcile(cp, tr, current_transcript_seq=5, shared_transcript_seq=-1, **args)
    assert body["transcript_rolled_back"] == {"from": 0, "to": 5}
    # the current machine is all the target's beginning: nothing of it is lost
    body = decide_reconcile(cp, tr, current_transcript_seq=236, shared_transcript_seq=236,
                            **args)
    assert body["transcript_rolled_back"] is None


@needs_mkfs
@pytest.mark.parametrize("piece", [1 << 20, 97])  # read whole, and in pieces that cut lines
def test_the_split_is_read_from_both_disks(tmp_path: Path, monkeypatch, piece: int) -> None:
    from ksfs.keeper import branching

    monkeypatch.setattr(branching, "TRANSCRIPT_PIECE", piece)

    def disk(name: str, text: str) -> Path:
        tree = tmp_path / name
        (tree / "agent").mkdir(parents=True)
        (tree / "agent" / "transcript.jsonl").write_text(text)
        build_ext4(tree, tmp_path / f"{name}.img", 8)
        return tmp_path / f"{name}.img"

    common = "".join(line(i, f"a{i}") for i in range(1, 237))
    g1 = disk("g1", common)
    left = disk("left", common + "".join(line(i, f"b{i}") for i in range(237, 247)))
    later = disk("later", common + "".join(line(i, f"a{i}") for i in range(237, 307)))
    torn = disk("torn", common + line(237, "a237").rstrip("\n"))  # a whole last line, no \n
    with Keeper(tmp_path / "store", create=True) as k:
        recs = {}
        for name, img in (("g1", g1), ("left", left), ("later", later), ("torn", torn)):
            (tmp_path / "disk.raw").unlink(missing_ok=True)
            (tmp_path / "disk.raw").symlink_to(img)
            k.import_files("g", name, [tmp_path / "disk.raw"])
            recs[name] = k.ledger.checkpoint("g", name)
        assert k._shared_transcript_seq(recs["left"], recs["later"]) == 236
        assert k._shared_transcript_seq(recs["later"], recs["left"]) == 236
        assert k._shared_transcript_seq(recs["later"], recs["g1"]) == 236
        assert k._shared_transcript_seq(recs["g1"], recs["g1"]) == 236
        assert k._shared_transcript_seq(recs["later"], recs["torn"]) == 237
        assert k._shared_transcript_seq(recs["left"], recs["torn"]) == 236
        # the restore's reconcile, as `restore` records it with its save-first
        ev = k._reconcile_to("g", recs["later"], 246, recs["left"])
        assert ev.body["transcript_rolled_back"] == {"from": 237, "to": 246}, ev.body
        assert ev.body["transcript_shared_seq"] == 236
        ev = k._reconcile_to("g", recs["g1"], 306, recs["later"])
        assert ev.body["transcript_rolled_back"] == {"from": 237, "to": 306}, ev.body
