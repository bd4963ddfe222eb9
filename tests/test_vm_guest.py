"""The controller against a real libvirtd, QEMU and the test guest: snapshot, restore, fork.

One guest boots per module; checkpoints are ingested with a plain file copy (the store is the
keeper's business). Every domain made here is destroyed and undefined by a finalizer, even when
a test fails.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
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

from ksfs.errors import AlreadyExists, VMError
from ksfs.vm import DomainController, saveimage

pytestmark = pytest.mark.vm


@dataclass
class Booted:
    ctl: DomainController
    session: str
    domain: str
    log: Path
    store: Path  # where the tests keep their copies of checkpoints
    made: list[str]  # every domain name made in this module, for the finalizer


@dataclass
class Checkpoint:
    disk: Path
    memory: Path
    last_seq: int
    lines: list[dict]


@pytest.fixture(scope="module")
def booted() -> Booted:
    require_libvirt()
    cfg = guest_config()
    work = vm_workdir()
    ctl = DomainController(workdir=work)
    made: list[str] = []
    domain = unique_domain()
    made.append(domain)
    b = Booted(ctl, "parent", domain, work / "parent" / "console.log", work / "copies", made)
    b.store.mkdir()
    try:
        ctl.create("parent", domain, cfg["kernel"], cfg["initrd"], cfg["disk"],
                   memory_mib=cfg["memory_mib"], cmdline=cfg["cmdline"])
        wait_for_counter(b.log, at_least=3)
        yield b
    finally:
        for name in made:
            try:
                ctl.destroy_and_undefine(name)
            except VMError:
                undefine_quietly(name)
        ctl.close()
        shutil.rmtree(work, ignore_errors=True)


def take(b: Booted, name: str, session: str | None = None, domain: str | None = None,
         base: Path | None = None) -> tuple[Checkpoint, dict]:
    """Snapshot, copy out (incrementally over ``base`` when the controller allows), finish."""
    frozen = b.ctl.snapshot(session or b.session, domain or b.domain)
    info: dict = {"base_checkpoint": frozen.base_checkpoint}
    try:
        (disk,) = frozen.disks
        info["changed"] = disk.changed
        info["top"] = disk.top
        out = b.store / f"{name}.disk"
        use_base = base if disk.changed is not None else None
        info["bytes_read"] = copy_source(disk.source, out, disk.changed, use_base)
        ref = b.store / f"{name}.ref"
        subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", disk.top, str(ref)],
                       check=True)
        info["equal"] = out.read_bytes() == ref.read_bytes()
        ref.unlink()
        mem = b.store / f"{name}.mem"
        shutil.copyfile(frozen.memory_path, mem)
        info["xml"] = frozen.xml
        info["memory_path"] = frozen.memory_path
    except BaseException:
        b.ctl.abort(frozen)
        raise
    b.ctl.finish(frozen, name)
    lines = transcript(out)
    return Checkpoint(out, mem, lines[-1]["seq"] if lines else 0, lines), info


@pytest.fixture(scope="module")
def c1(booted: Booted) -> tuple[Checkpoint, dict]:
    return take(booted, "c1")


def test_guest_boots_and_counts(booted: Booted) -> None:
    start = counters(booted.log)[-1]
    seen = wait_for_counter(booted.log, at_least=start + 3)
    assert seen == sorted(seen) and seen[-1] >= start + 3
    assert booted.ctl.state(booted.domain) == "running"


def test_first_checkpoint_reads_whole_frozen_image_equal_to_convert(
        booted: Booted, c1: tuple[Checkpoint, dict]) -> None:
    cp, info = c1
    assert info["changed"] is None and info["base_checkpoint"] is None
    assert info["equal"], "the frozen disk read through Frozen.source differs from qemu-img"
    assert cp.last_seq >= 3
    assert [line["seq"] for line in cp.lines] == list(range(1, cp.last_seq + 1))
    assert saveimage.read_header(cp.memory).xml == info["xml"]
    assert not Path(info["memory_path"]).exists(), "finish leaves the staging memory image"
    assert booted.ctl.state(booted.domain) == "running"


def test_incremental_checkpoint_reads_only_changed_clusters(
        booted: Booted, c1: tuple[Checkpoint, dict]) -> None:
    cp1, _ = c1
    wait_for_counter(booted.log, at_least=cp1.last_seq + 8)
    cp2, info = take(booted, "c2", base=cp1.disk)
    assert info["base_checkpoint"] == "c1"
    changed = info["changed"]
    assert changed, "the guest wrote between the checkpoints, so something changed"
    # c1 + the changed ranges = the frozen image: the ranges cover every write
    assert info["equal"]
    assert sum(n for _, n in changed) == info["bytes_read"] < 8 << 20
    assert cp2.last_seq > cp1.last_seq + 5
    assert cp2.lines[:len(cp1.lines)] == cp1.lines
    # the chain stays short: the active overlay sits right on the root after finish
    files = booted.ctl.disk_files(booted.domain)
    chain = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", files["vda"]],
                           capture_output=True, text=True, check=True).stdout
    assert chain.count("image:") == 2


def test_restore_continues_from_the_checkpoint_not_from_now(
        booted: Booted, c1: tuple[Checkpoint, dict]) -> None:
    cp1, _ = c1
    before = wait_for_counter(booted.log, at_least=cp1.last_seq + 12)[-1]
    booted.ctl.pause(booted.domain)  # so nothing the old run prints lands after ``offset``
    offset = settled_size(booted.log)  # (what it printed before the pause still on its way)
    mem, disk = FileReader(cp1.memory), FileReader(cp1.disk)
    try:
        res = booted.ctl.restore(booted.session, booted.domain, mem, {"vda": disk},
                                 checkpoint="c1")
    finally:
        mem.close()
        disk.close()
    assert res.base_checkpoint == "c1"
    assert booted.ctl.state(booted.domain) == "paused"
    time.sleep(1)
    assert counters(booted.log, offset) == [], "a paused guest printed"
    booted.ctl.resume(booted.domain)
    seen = wait_for_counter(booted.log, at_least=cp1.last_seq + 3, start=offset, count=3)
    assert cp1.last_seq <= seen[0] <= cp1.last_seq + 1 < before
    assert seen == sorted(seen)
    # the transcript on disk matches: c1's lines, then a gapless continuation from c1's seq
    cp3, info = take(booted, "c3", base=cp1.disk)
    assert info["base_checkpoint"] == "c1" and info["equal"]
    assert cp3.lines[:len(cp1.lines)] == cp1.lines
    assert [line["seq"] for line in cp3.lines] == list(range(1, cp3.last_seq + 1))


def test_two_forks_run_at_once_and_diverge_parent_undisturbed(
        booted: Booted, c1: tuple[Checkpoint, dict]) -> None:
    cp1, _ = c1
    forks = []
    for i in range(2):
        name = unique_domain("ksfs-test-fork")
        booted.made.append(name)
        mem, disk = FileReader(cp1.memory), FileReader(cp1.disk)
        try:
            res = booted.ctl.fork(f"fork{i}", name, mem, {"vda": disk}, checkpoint="c1")
        finally:
            mem.close()
            disk.close()
        assert res.domain == name and booted.ctl.state(name) == "paused"
        forks.append(name)
    parent_before = counters(booted.log)[-1]
    for name in forks:
        booted.ctl.resume(name)
    logs = [booted.ctl.console_log(f"fork{i}") for i in range(2)]
    assert logs[0] != logs[1] != booted.log
    for log in logs:
        seen = wait_for_counter(log, at_least=cp1.last_seq + 4)
        assert cp1.last_seq <= seen[0] <= cp1.last_seq + 1
    assert all(booted.ctl.state(n) == "running" for n in forks)
    parent_now = wait_for_counter(booted.log, at_least=parent_before + 2)[-1]
    assert parent_now > parent_before and booted.ctl.state(booted.domain) == "running"
    xmls = [booted.ctl.xml(n) for n in (booted.domain, *forks)]
    uuids = {x.split("<uuid>")[1].split("</uuid>")[0] for x in xmls}
    assert len(uuids) == 3
    # each fork has its own disk and its own future: same past, different new lines
    cps = [take(booted, f"fork{i}-a", session=f"fork{i}", domain=n)[0]
           for i, n in enumerate(forks)]
    for cp in cps:
        assert cp.lines[:len(cp1.lines)] == cp1.lines
        assert cp.last_seq > cp1.last_seq + 2
    new = [[(ln["seq"], ln["nonce"]) for ln in cp.lines[len(cp1.lines):]] for cp in cps]
    common = min(len(new[0]), len(new[1]))
    assert new[0][:common] != new[1][:common]
    for name in forks:
        booted.ctl.destroy_and_undefine(name)
        assert booted.ctl.state(name) == "absent"


def test_fork_refuses_an_existing_domain_name(booted: Booted,
                                              c1: tuple[Checkpoint, dict]) -> None:
    cp1, _ = c1
    with pytest.raises(AlreadyExists):
        booted.ctl.fork("dup", booted.domain, FileReader(cp1.memory),
                        {"vda": FileReader(cp1.disk)})
    assert booted.ctl.state(booted.domain) == "running"


def test_failed_snapshot_leaves_the_guest_running_and_no_files(booted: Booted) -> None:
    state = booted.ctl.load_state(booted.session)
    n = state.counter + 1
    # an overlay file already in the way makes libvirt refuse the snapshot
    blocker = booted.ctl.session_dir(booted.session) / f"vda-{n}.qcow2"
    blocker.write_bytes(b"in the way")
    try:
        with pytest.raises(VMError, match=booted.domain):
            booted.ctl.snapshot(booted.session, booted.domain)
    finally:
        blocker.unlink(missing_ok=True)
    assert booted.ctl.state(booted.domain) == "running"
    staging = booted.ctl.session_dir(booted.session) / "staging"
    assert list(staging.iterdir()) == []
    start = counters(booted.log)[-1]
    wait_for_counter(booted.log, at_least=start + 2)
    # and the next snapshot works
    frozen = booted.ctl.snapshot(booted.session, booted.domain)
    booted.ctl.finish(frozen)
    assert booted.ctl.state(booted.domain) == "running"


def test_small_overlay_clusters_give_finer_changed_ranges(
        booted: Booted, c1: tuple[Checkpoint, dict]) -> None:
    fine = DomainController(workdir=booted.ctl.workdir, cluster_size=4096)
    try:
        first = fine.snapshot(booted.session, booted.domain)  # its overlay gets 4 KiB clusters
        fine.finish(first, "fine-1")
        start = counters(booted.log)[-1]
        wait_for_counter(booted.log, at_least=start + 4)
        frozen = fine.snapshot(booted.session, booted.domain)
        try:
            (disk,) = frozen.disks
            assert frozen.base_checkpoint == "fine-1" and disk.changed
            info = subprocess.run(["qemu-img", "info", "-U", disk.top], capture_output=True,
                                  text=True, check=True).stdout
            assert "cluster_size: 4096" in info
            assert all(off % 4096 == 0 and n % 4096 == 0 for off, n in disk.changed)
            assert any(n % 65536 for _, n in disk.changed), "ranges are finer than 64 KiB"
            ref = booted.store / "fine.ref"
            subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", disk.top, str(ref)],
                           check=True)
            data = ref.read_bytes()
            for off, n in disk.changed:
                assert disk.source.pread(off, n) == data[off:off + n]
            ref.unlink()
        except BaseException:
            fine.abort(frozen)
            raise
        fine.finish(frozen, "fine-2")
    finally:
        fine.close()
    assert booted.ctl.state(booted.domain) == "running"


def test_live_snapshot_pauses_briefly_and_a_long_copy_is_cut_short(
        booted: Booted, c1: tuple[Checkpoint, dict], monkeypatch) -> None:
    """Live is the default: the guest is paused only at the end of the memory copy, and the
    keeper is told how long. A copy that runs past LIVE_COPY_LIMIT gets the guest paused so it
    ends (here the limit is 0, so the guard always fires), and the guest runs on afterwards."""
    from ksfs.vm import checkpoint

    frozen = booted.ctl.snapshot(booted.session, booted.domain)
    booted.ctl.finish(frozen, "live-1")
    assert 0 < frozen.paused_s <= frozen.snapshot_s and not frozen.pause_forced
    monkeypatch.setattr(checkpoint, "LIVE_COPY_LIMIT", 0.0)
    # a copy this short is over before it could be seen: say it is still going, so the guard
    # fires (its job-stats test is what a slow copy meets)
    monkeypatch.setattr(checkpoint._PauseMeter, "_still_copying", lambda self: True)
    start = counters(booted.log)[-1]
    frozen = booted.ctl.snapshot(booted.session, booted.domain)
    try:
        assert booted.ctl.state(booted.domain) == "running"
        assert frozen.pause_forced
        assert 0 < frozen.paused_s <= frozen.snapshot_s
        assert saveimage.read_header(frozen.memory_path).xml
    finally:
        booted.ctl.finish(frozen, "live-2")
    wait_for_counter(booted.log, at_least=start + 2)  # and the guest keeps working


def test_checkpoint_round_trips_through_the_chunk_store(
        booted: Booted, c1: tuple[Checkpoint, dict]) -> None:
    """Ingest a checkpoint into a real ChunkStore, then fork from the store's readers."""
    cas = pytest.importorskip("ksfs.cas")
    store = cas.ChunkStore.open(booted.store / "cas", create=True)
    try:
        frozen = booted.ctl.snapshot(booted.session, booted.domain)
        try:
            (disk,) = frozen.disks
            with store.ingest() as ingest:
                mem = ingest.add_file(str(frozen.memory_path), chunking="cdc")
                dsk = ingest.add_file(disk.source, chunking="fixed")
                ingest.seal()
                with store.env.begin(write=True) as txn:
                    ingest.commit(txn)
            ref = booted.store / "cas.ref"
            subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", disk.top, str(ref)],
                           check=True)
            reader = store.open_file(dsk.manifest)
            assert reader.read(0, reader.size) == ref.read_bytes()
            ref.unlink()
        except BaseException:
            booted.ctl.abort(frozen)
            raise
        booted.ctl.finish(frozen, "cas-1")
        copy = booted.store / "cas.disk"
        reader = store.open_file(dsk.manifest)
        with open(copy, "wb") as f:
            f.write(reader.read(0, reader.size))
        last = transcript(copy)[-1]["seq"]
        child = unique_domain("ksfs-test-casfork")
        booted.made.append(child)
        booted.ctl.fork("casfork", child, store.open_file(mem.manifest),
                        {"vda": store.open_file(dsk.manifest)}, checkpoint="cas-1")
        booted.ctl.resume(child)
        seen = wait_for_counter(booted.ctl.console_log("casfork"), at_least=last + 2)
        assert last <= seen[0] <= last + 1
        booted.ctl.destroy_and_undefine(child)
    finally:
        store.close()


CRASHER = """
import sys
from ksfs.vm import DomainController
ctl = DomainController(workdir=sys.argv[1])
frozen = ctl.snapshot(sys.argv[2], sys.argv[3])
ctl.finish(frozen, "crasher")
print("survived")
"""


@pytest.mark.parametrize("point", ["vm.snapshot", "vm.flatten"])
def test_kill_at_a_crash_point_keeps_the_guest_running_and_next_save_works(
        booted: Booted, c1: tuple[Checkpoint, dict], point: str) -> None:
    import os
    import sys

    before = booted.ctl.load_state(booted.session).disks["vda"].base_checkpoint
    env = dict(os.environ, KSFS_CRASH_AT=point)
    res = subprocess.run([sys.executable, "-c", CRASHER, str(booted.ctl.workdir),
                          booted.session, booted.domain], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == -9, res.stderr
    assert "survived" not in res.stdout
    assert booted.ctl.state(booted.domain) == "running"
    start = counters(booted.log)[-1]
    wait_for_counter(booted.log, at_least=start + 2)
    # the label is still the last finished checkpoint, so the next save is incremental against
    # it and covers both intervals; it reads equal to qemu-img and its finish shortens the chain
    assert booted.ctl.load_state(booted.session).disks["vda"].base_checkpoint == before
    frozen = booted.ctl.snapshot(booted.session, booted.domain)
    try:
        (disk,) = frozen.disks
        assert frozen.base_checkpoint == before and disk.changed is not None
        assert len(disk.layers) == 2, "the crashed save's frozen layer is still in the chain"
        ref = booted.store / "crash.ref"
        subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", disk.top, str(ref)],
                       check=True)
        assert disk.source.pread(0, disk.size) == ref.read_bytes()
        ref.unlink()
        staging = booted.ctl.session_dir(booted.session) / "staging"
        assert [p.name for p in staging.iterdir()] == [frozen.memory_path.name]
    except BaseException:
        booted.ctl.abort(frozen)
        raise
    booted.ctl.finish(frozen, f"after-{point}")
    files = booted.ctl.disk_files(booted.domain)
    chain = subprocess.run(["qemu-img", "info", "-U", "--backing-chain", files["vda"]],
                           capture_output=True, text=True, check=True).stdout
    assert chain.count("image:") == 2
