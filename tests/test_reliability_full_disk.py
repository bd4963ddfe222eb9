"""A full disk: the store on a small tmpfs. Import (and save of a real guest whose store, and so
whose overlays and staging files, live on the small filesystem) fail with one clear line and exit
9 (NoSpace) and a ``checkpoint.failed`` event; the guest keeps running; the store checks clean;
after deleting and ``ksfs gc`` the space comes back and a later import or save works.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def small_fs(size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on a fresh directory, unmounted and removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="ksfs-full-", dir="/var/tmp"))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                          str(d)], capture_output=True, text=True)
    if res.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def events(store: Path, session: str, env: dict | None = None) -> list[dict]:
    res = ksfs(store, "events", session, "--json", env=env)
    assert res.returncode == 0, res.stderr
    return [json.loads(x) for x in res.stdout.splitlines()]


def assert_clean(store: Path, env: dict | None = None) -> None:
    res = ksfs(store, "check", "--read-data", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    res = ksfs(store, "ledger", "verify", env=env)
    assert res.returncode == 0, res.stdout + res.stderr


def test_import_on_a_full_disk(tmp_path: Path) -> None:
    rnd = random.Random(9)
    small = tmp_path / "small"
    small.write_bytes(rnd.randbytes(4 << 20))
    big = tmp_path / "big"
    big.write_bytes(rnd.randbytes(48 << 20))  # random: compresses to nothing less
    with small_fs("40m") as fs:
        store = fs / "store"
        res = ksfs(store, "import", "s", "ok1", str(small))
        assert res.returncode == 0, res.stderr
        res = ksfs(store, "import", "s", "too-big", str(big))
        assert res.returncode == 9, (res.returncode, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "no space left" in lines[0], res.stderr
        evs = events(store, "s")
        assert evs[-1]["type"] == "checkpoint.failed", evs[-1]
        assert evs[-1]["body"]["name"] == "too-big"
        assert "no space" in evs[-1]["body"]["reason"]
        listed = json.loads(ksfs(store, "checkpoints", "s", "--json").stdout)
        assert [c["name"] for c in listed] == ["ok1"]
        assert_clean(store)
        # The failed import gave back what it wrote at once; deleting + GC frees the rest.
        before = free_bytes(fs)
        assert before > 30 << 20, before
        assert ksfs(store, "rm", "s", "ok1").returncode == 0
        res = ksfs(store, "gc", "--json")
        assert res.returncode == 0, res.stderr
        assert free_bytes(fs) > before + (3 << 20), (before, free_bytes(fs))
        half = tmp_path / "half"
        half.write_bytes(big.read_bytes()[: 20 << 20])
        res = ksfs(store, "import", "s", "later", str(half))
        assert res.returncode == 0, res.stderr
        out = subprocess.run(KSFS + ["--store", str(store), "cat", "s", "later", "half"],
                             capture_output=True)
        assert out.stdout == half.read_bytes()
        assert_clean(store)



def fill(fs: Path) -> Path:
    """Take every free byte of fs with one file; returns it (delete it to give them back)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):  # down to the last byte
            with contextlib.suppress(OSError):
                while f.write(b"\1" * size):
                    pass
    return filler


def test_an_import_the_full_disk_cuts_off_in_its_first_record_leaves_no_tail(
        tmp_path: Path) -> None:
    """QA (thirty-fourth session): on a disk with no byte free, an import appending to the
    store's open pack had its first record cut short; that part stayed in the pack (4,028
    bytes, "uncommitted_pack_bytes") until a gc. A failed import gives back everything it
    wrote at once."""
    rnd = random.Random(11)
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(rnd.randbytes(1 << 20))
    second.write_bytes(rnd.randbytes(2 << 20))
    with small_fs("20m") as fs:
        store = fs / "store"
        assert ksfs(store, "import", "s", "c1", str(first)).returncode == 0
        packs = sorted((store / "packs").iterdir())
        sizes = {p.name: p.stat().st_size for p in packs}
        with open(fs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # every byte: the next record's write is cut short, not refused
                f.write(bytes(4096))
        res = ksfs(store, "import", "s", "c2", str(second))
        assert res.returncode == 9 and "no space left" in res.stderr, res.stderr
        assert {p.name: p.stat().st_size for p in (store / "packs").iterdir()} == sizes
        stats = json.loads(ksfs(store, "stats", "--json").stdout)
        assert stats["uncommitted_pack_bytes"] == 0, stats
        (fs / "filler").unlink()
        assert_clean(store)


def test_gc_on_a_full_disk_is_no_space_and_changes_nothing(tmp_path: Path) -> None:
    rnd = random.Random(11)
    shared = rnd.randbytes(2 << 20)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(shared + rnd.randbytes(2 << 20))
    b.write_bytes(shared + rnd.randbytes(2 << 20))
    with small_fs("24m") as fs:
        store = fs / "store"
        for name, src in (("c1", a), ("c2", b)):
            res = ksfs(store, "import", "s", name, str(src))
            assert res.returncode == 0, res.stderr
        assert ksfs(store, "rm", "s", "c1").returncode == 0
        filler = fill(fs)
        res = ksfs(store, "gc")
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 9, (res.returncode, res.stderr)
        assert len(lines) == 1 and "no space left" in lines[0], res.stderr
        filler.unlink()
        assert_clean(store)
        out = subprocess.run(KSFS + ["--store", str(store), "cat", "s", "c2", "b"],
                             capture_output=True)
        assert out.returncode == 0 and out.stdout == b.read_bytes()
        res = ksfs(store, "gc", "--json")  # with room again it frees what c1 alone held
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["bytes_freed"] > 1 << 20, res.stdout
        assert_clean(store)


def test_a_repack_the_disk_cuts_short_removes_its_pack_and_says_what_it_needs(
        tmp_path: Path) -> None:
    """QA: the sweep committed, the repack's new pack hit ENOSPC and stayed behind, and check
    then called it the leftover of an ingest; the message did not say what gc needed."""
    rnd = random.Random(12)
    keep, drop = tmp_path / "keep", tmp_path / "drop"
    keep.write_bytes(rnd.randbytes(1 << 20))
    drop.write_bytes(rnd.randbytes(3 << 20))
    with small_fs("24m") as fs:
        store = fs / "store"
        for args in (["c1", str(keep), str(drop)], ["c2", str(keep)], ["--rm", "c1"]):
            res = ksfs(store, "rm", "s", "c1") if args[0] == "--rm" else \
                ksfs(store, "import", "s", *args)
            assert res.returncode == 0, res.stderr
        packs = sorted(p.name for p in (store / "packs").iterdir())
        filler = fill(fs)
        os.truncate(filler, filler.stat().st_size - (256 << 10))  # room for the sweep only
        res = ksfs(store, "gc")
        err = res.stderr.strip()
        assert res.returncode == 9 and len(err.splitlines()) == 1, (res.returncode, err)
        assert "1.0 MiB of live chunks" in err and "deleting more checkpoints" in err, err
        assert sorted(p.name for p in (store / "packs").iterdir()) == packs
        filler.unlink()
        res = ksfs(store, "check", "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["unfinished_bytes"] == 0, \
            res.stdout
        res = ksfs(store, "gc", "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["packs_repacked"], res.stdout
        assert_clean(store)
        out = subprocess.run(KSFS + ["--store", str(store), "cat", "s", "c2", "keep"],
                             capture_output=True)
        assert out.returncode == 0 and out.stdout == keep.read_bytes()


@pytest.mark.vm
def test_save_on_a_full_disk_keeps_the_guest_running() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from guest import ensure_guest, guest_writes, require_libvirt

    require_libvirt()
    guest = ensure_guest()
    env = dict(os.environ, KSFS_GUEST=str(guest))
    name = f"full-{os.getpid()}"
    domain = f"ksfs-{name}"
    with small_fs("600m") as fs:
        store = fs / "store"
        try:
            res = ksfs(store, "session", "new", name, env=env)
            assert res.returncode == 0, res.stderr
            guest_writes(store, name, 3)  # (booted and working, not a fixed sleep)
            res = ksfs(store, "save", name, "first", env=env)
            assert res.returncode == 0, res.stderr
            # Fill the filesystem, leaving less than the next memory image needs.
            filler = fs / "filler"
            with open(filler, "wb") as f:
                left = free_bytes(fs) - (8 << 20)
                while left > 0:
                    n = min(left, 16 << 20)
                    f.write(os.urandom(n))
                    left -= n
            layers = sorted(p.name for p in (store / "vm" / name).glob("*.qcow2"))
            res = ksfs(store, "save", name, "second", env=env)
            assert res.returncode == 9, (res.returncode, res.stderr)
            # (QA: each failed save left its new overlay behind until a recover)
            assert sorted(p.name for p in (store / "vm" / name).glob("*.qcow2")) == layers
            assert len(res.stderr.strip().splitlines()) == 1, res.stderr
            assert "no space" in res.stderr
            state = subprocess.run(["virsh", "-c", "qemu:///system", "domstate", domain],
                                   capture_output=True, text=True).stdout.strip()
            assert state == "running"
            evs = events(store, name, env=env)
            assert evs[-1]["type"] == "checkpoint.failed" and evs[-1]["body"]["name"] == "second"
            listed = json.loads(ksfs(store, "checkpoints", name, "--json", env=env).stdout)
            assert [c["name"] for c in listed] == ["first"]
            assert_clean(store, env)
            # A fork writes its machine's files out of the store first: no room is NoSpace
            # too, as a save's is (QA: exit 10, a VM error, and EIO through the mount)
            res = ksfs(store, "fork", name, "first", f"{name}-f", env=env)
            assert res.returncode == 9, (res.returncode, res.stderr)
            assert res.stderr.startswith("ksfs: error: no space left") and \
                len(res.stderr.strip().splitlines()) == 1, res.stderr
            assert subprocess.run(["virsh", "-c", "qemu:///system", "domstate",
                                   f"{domain}-f"], capture_output=True).returncode != 0
            assert f"{name}-f" not in ksfs(store, "session", "list", env=env).stdout
            # A restore's save-first finds no room either: said in the log (and so by reading
            # `resume` through a mount) as the restore's failure, the machine untouched
            res = ksfs(store, "restore", name, "first", env=env)
            assert res.returncode == 9 and "no space" in res.stderr, res.stderr
            last = events(store, name, env=env)[-1]
            assert last["type"] == "restore.failed" and last["body"]["checkpoint"] == "first"
            assert "no space" in last["body"]["reason"]
            # and the machine the restore paused for its save-first runs again (CI, once,
            # thirty-fourth session: recover later found it "left paused by an interrupted
            # verb", not reproduced in 9 runs since; said with the restore's words if again)
            reason = subprocess.run(["virsh", "-c", "qemu:///system", "domstate", "--reason",
                                     domain], capture_output=True, text=True).stdout.strip()
            assert reason.startswith("running") or reason == "paused (I/O error)", \
                (reason, res.stderr)
            # No room at all: QEMU pauses the guest at its next write. recover leaves it so
            # (resumed, it paused again at once: QA) and says why; `ksfs resume` once mended.
            more = fs / "filler2"
            with open(more, "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(bytes(1 << 20))
                    f.flush()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and subprocess.run(
                    ["virsh", "-c", "qemu:///system", "domstate", "--reason", domain],
                    capture_output=True, text=True).stdout.strip() != "paused (I/O error)":
                time.sleep(0.5)
            reason = subprocess.run(["virsh", "-c", "qemu:///system", "domstate", "--reason",
                                     domain], capture_output=True, text=True).stdout.strip()
            assert reason == "paused (I/O error)", reason
            res = ksfs(store, "recover", "--json", env=env)
            report = json.loads(res.stdout)
            said = [a for r in report if r["session"] == name for a in r["actions"]]
            assert any("paused on a disk I/O error" in a for a in said), (said, res.stderr)
            state = subprocess.run(["virsh", "-c", "qemu:///system", "domstate", domain],
                                   capture_output=True, text=True).stdout.strip()
            assert state == "paused"
            # Room for the guest's write but not for a save: a restore fails in its
            # save-first, and its snapshot ran the guest again to re-activate its disks, so
            # the write went through. The machine must not stay paused as if a user had
            # paused it (CI, fresh49: recover found it "left paused by an interrupted verb").
            os.truncate(more, max(0, more.stat().st_size - (2 << 20)))
            res = ksfs(store, "restore", name, "first", env=env)
            assert res.returncode == 9 and "no space" in res.stderr, res.stderr
            reason = subprocess.run(["virsh", "-c", "qemu:///system", "domstate", "--reason",
                                     domain], capture_output=True, text=True).stdout.strip()
            assert reason.startswith("running") or reason == "paused (I/O error)", \
                (reason, res.stderr)
            more.unlink()
            filler.unlink()
            res = ksfs(store, "resume", name, env=env)
            assert res.returncode == 0, res.stderr
            state = subprocess.run(["virsh", "-c", "qemu:///system", "domstate", domain],
                                   capture_output=True, text=True).stdout.strip()
            assert state == "running"
            filler.touch()  # (unlinked below, as before)
            # Space back (the filler stands for whatever filled the disk), then a GC: saves work.
            filler.unlink()
            assert ksfs(store, "gc", env=env).returncode == 0
            res = ksfs(store, "save", name, "third", env=env)
            assert res.returncode == 0, res.stderr
            assert_clean(store, env)
        finally:
            for s, d in ((f"{name}-f", f"{domain}-f"), (name, domain)):
                ksfs(store, "session", "rm", s, env=env)
                subprocess.run(["virsh", "-c", "qemu:///system", "destroy", d],
                               capture_output=True)
                subprocess.run(["virsh", "-c", "qemu:///system", "undefine", d],
                               capture_output=True)
