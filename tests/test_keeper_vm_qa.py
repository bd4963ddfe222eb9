"""QA findings on the machine verbs, against a real libvirtd, QEMU and the test guest: a fork's
save after its parent gave the fork point's name to another checkpoint, recover when the newest
checkpoint is an import, a damaged transcript at save, lock files of refused verbs, and what a
restore "forward" (to a later checkpoint of a timeline left) rolls back.

One booted session is shared by the module (the fork is removed by its test; the
recover test, which kills the machine, comes last); every domain made
here is destroyed and undefined at the end, even on failure.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_keeper_vm as kvm
from tests.cli_helpers import virsh
from tests.test_keeper_vm import events_of, run, save, transcript_lines

pytestmark = pytest.mark.vm
env, guest = kvm.env, kvm.guest  # the module's own store, its sessions removed at the end


@pytest.fixture(scope="module")
def agent(env) -> str:
    env["env"].setdefault("KSFS_DOMAIN_TYPE", "qemu")
    name = f"qa-{env['tag']}"
    env["made"].append(name)
    run(env["store"], "session", "new", name, env=env["env"])
    kvm.wait_transcript(env["store"], name, env["env"], 3)
    return name


def digest(path: Path) -> str:
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return h.hexdigest()


def root_of(domain: str) -> str:
    """The root of vda's chain: after a save, exactly the disk that checkpoint holds (the
    guest's writes since, even in the few milliseconds a paused guest runs after its
    snapshot, are in the overlay above it)."""
    out = virsh("domblklist", domain, check=True).stdout
    top = dict(line.split(None, 1) for line in out.splitlines() if line.strip())["vda"]
    chain = json.loads(subprocess.run(
        ["qemu-img", "info", "-U", "--backing-chain", "--output=json", top],
        capture_output=True, text=True, check=True).stdout)
    return chain[-1]["filename"]


def same_disk(store: Path, e: dict, session: str, checkpoint: str, tmp_path: Path) -> bool:
    """Whether the checkpoint's stored disk.raw is the disk the session's machine runs on."""
    now, stored = tmp_path / "now.raw", tmp_path / "stored.raw"
    subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", root_of(f"ksfs-{session}"),
                    str(now)], check=True)
    with open(stored, "wb") as f:
        subprocess.run([*kvm.KSFS, "--store", str(store), "cat", session, checkpoint,
                        "disk.raw"], stdout=f, check=True, env=e)
    try:
        return digest(stored) == digest(now)
    finally:
        now.unlink()
        stored.unlink()


def test_a_forks_save_stores_its_own_disk_after_the_parent_reuses_the_fork_points_name(
        env, agent: str, tmp_path: Path) -> None:
    """QA (critical): the fork's root was labelled "PARENT/base" and its next save patched its
    changes into whatever checkpoint had that name then: after the parent's `rm base; save
    base`, into the new base, storing a disk the guest never had (266,904 bytes differed)."""
    store, e = env["store"], env["env"]
    save(store, agent, e, "base")
    child = f"qa-child-{env['tag']}"
    env["made"].append(child)
    run(store, "fork", agent, "base", child, env=e)
    for s in (agent, child):  # both write
        kvm.guest_writes(store, s, 8)
    run(store, "rm", agent, "base", env=e)
    save(store, agent, e, "base")  # the parent's new 'base'
    run(store, "pause", child, env=e)
    save(store, child, e, "t1")
    assert same_disk(store, e, child, "t1", tmp_path), "the fork's checkpoint is another disk"
    published = [ev["body"] for ev in events_of(store, child, e)
                 if ev["type"] == "checkpoint.published"]
    assert published[-1]["name"] == "t1" and published[-1]["incremental"] is False
    # Its next save builds on t1 again, and is exact too.
    run(store, "resume", child, env=e)
    kvm.guest_writes(store, child, 2)
    save(store, child, e, "t2")
    published = [ev["body"] for ev in events_of(store, child, e)
                 if ev["type"] == "checkpoint.published"]
    assert published[-1]["incremental"] is True
    assert same_disk(store, e, child, "t2", tmp_path)
    status = next(s for s in json.loads(run(store, "session", "list", "--json", env=e).stdout)
                  if s["session"] == child)
    assert status["running_from"] == f"{child}/t2", status  # said by name, as before
    run(store, "session", "rm", child, env=e)


def test_a_transcript_that_cannot_be_read_at_save_is_said(env, agent: str) -> None:
    """QA: a damaged transcript line was swallowed at save: exit 0, transcript_seq null, no
    event. The session is pointed at a file of the guest's that is no transcript
    (agent/calls holds "0": a line without a seq)."""
    store, e = env["store"], env["env"]
    code = (
        "import sys\n"
        "from ksfs.keeper import Keeper\n"
        "k = Keeper(sys.argv[1])\n"
        "rec = k.ledger.session(sys.argv[2])\n"
        "with k.store.env.begin(write=True) as txn:\n"
        "    k.ledger.update_session(txn, rec.name, config=dict(rec.config,"
        " transcript_path=sys.argv[3]))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(store), agent, "agent/calls"], check=True,
                   env=e)
    try:
        res = run(store, "save", agent, "--json", env=e)
        rec = json.loads(res.stdout)
        assert rec["transcript_seq"] is None
        assert "agent/calls" in rec["transcript_unreadable"], rec
        assert "warning" in res.stderr and "transcript" in res.stderr, res.stderr
        said = [ev["body"] for ev in events_of(store, agent, e) if ev["type"] == "fs.unreadable"]
        assert said and said[-1]["checkpoint"] == rec["name"], said
        assert said[-1]["what"] == "transcript" and "agent/calls" in said[-1]["why"]
    finally:
        subprocess.run([sys.executable, "-c", code, str(store), agent,
                        "agent/transcript.jsonl"], check=True, env=e)
    res = run(store, "save", agent, "--json", env=e)
    assert "transcript_unreadable" not in json.loads(res.stdout)
    assert "warning" not in res.stderr


def test_refused_verbs_leave_no_lock_file(env, agent: str, tmp_path: Path) -> None:
    """QA: a fork or session new refused because libvirt has a domain of the new name, and an
    adopt of a domain another session keeps (or of none), each left STORE/locks/<hash>.lock."""
    store, e = env["store"], env["env"]
    taken = f"qa-taken-{env['tag']}"
    xml = tmp_path / "dom.xml"
    xml.write_text(f"<domain type='qemu'><name>ksfs-{taken}</name><memory unit='MiB'>64</memory>"
                   "<os><type arch='x86_64'>hvm</type></os></domain>")
    virsh("define", str(xml), check=True)
    try:
        cp = save(store, agent, e)
        before = sorted(p.name for p in (store / "locks").iterdir())
        for args in (("fork", agent, cp, taken), ("session", "new", taken),
                     ("session", "adopt", f"qa-z-{env['tag']}", f"ksfs-{agent}"),
                     ("session", "adopt", f"qa-z-{env['tag']}", f"ksfs-none-{env['tag']}")):
            res = run(store, *args, check=False, env=e)
            assert res.returncode in (3, 4), (args, res.returncode, res.stderr)
            assert sorted(p.name for p in (store / "locks").iterdir()) == before, args
    finally:
        virsh("undefine", f"ksfs-{taken}")


def test_a_restore_forward_says_what_the_left_timeline_loses(env, agent: str) -> None:
    """QA: restore to g1, the guest writes on, restore to a later checkpoint of the timeline
    left: the lines written since the first restore are lost (their seqs are in the target with
    other nonces), and reconcile said nothing was (it counted only seqs past the target's)."""
    store, e = env["store"], env["env"]
    g1 = save(store, agent, e, "g1")
    kvm.guest_writes(store, agent, 20)  # many lines past g1 on this timeline
    later = save(store, agent, e)
    run(store, "restore", agent, g1, env=e)
    kvm.guest_writes(store, agent, 4)  # a few lines of the new timeline
    res = json.loads(run(store, "restore", agent, later, "--json", env=e).stdout)
    rec = res["reconcile"]
    cur = rec["current_transcript_seq"]
    left = transcript_lines(store, agent, res["saved_as"], e)
    target = transcript_lines(store, agent, later, e)
    g1_seq = transcript_lines(store, agent, g1, e)[-1]["seq"]
    assert g1_seq < cur < target[-1]["seq"], (g1_seq, cur, target[-1]["seq"])  # forward
    shared = [a["seq"] for a, b in zip(left, target, strict=False) if a == b]
    split = shared[-1]
    assert g1_seq <= split < cur
    assert rec["transcript_rolled_back"] == {"from": split + 1, "to": cur}, rec
    assert rec["transcript_shared_seq"] == split, rec
    # A plain restore back (the target on the current timeline) is measured the same.
    res = json.loads(run(store, "restore", agent, g1, "--json", env=e).stdout)
    rec = res["reconcile"]
    assert rec["transcript_shared_seq"] == g1_seq, rec
    assert rec["transcript_rolled_back"] == {"from": g1_seq + 1,
                                             "to": rec["current_transcript_seq"]}, rec


def test_recover_brings_a_machine_back_to_a_checkpoint_with_a_machine_not_an_import(
        env, agent: str, tmp_path: Path) -> None:
    """QA: with an imported checkpoint newest, recover saved the dead machine's disks, then
    failed 'checkpoint g/notes has no domain XML' (exit 10), and did so again every run."""
    store, e = env["store"], env["env"]
    last = save(store, agent, e, "before-notes")
    notes = tmp_path / "notes.txt"
    notes.write_text("notes\n")
    run(store, "import", agent, "notes", str(notes), env=e)
    virsh("destroy", f"ksfs-{agent}", check=True)
    res = run(store, "recover", "--json", check=False, env=e)
    assert res.returncode == 0, res.stderr
    actions = " ".join(a for r in json.loads(res.stdout) if r["session"] == agent
                       for a in r["actions"])
    assert f"restored to checkpoint {last}" in actions, actions
    assert virsh("domstate", f"ksfs-{agent}").stdout.strip() == "running"
    assert json.loads(run(store, "recover", "--json", env=e).stdout) == []
