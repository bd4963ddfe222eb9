"""Crash safety of the chunk store: kill -9 an importing process anywhere, lose nothing committed.

A small driver script ingests and commits in a loop in a subprocess (incremental disk images and
CDC files, as checkpoints do) and logs each committed manifest. The test kills it at random
moments and at each named crash point; afterwards the store must check clean with data, and every
file logged as committed must read back byte-identical. GC is killed at its crash points too.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

from ksfs.cas import ChunkStore

K64 = 64 * 1024

DRIVER = r'''
import os, random, sys
from ksfs.cas import ChunkStore

K64 = 64 * 1024

class Src:
    def __init__(self, data):
        self.data, self.size = data, len(data)
    def pread(self, off, n):
        return self.data[off:off + n]

def mods(seed, i):
    rng = random.Random(f"{seed}/mods/{i}")
    return sorted(rng.sample(range(32), 3))

def disk(seed, i):
    rng = random.Random(f"{seed}/disk")
    kinds = [bytes(K64), b"log line\n" * 7282]
    img = bytearray(b"".join((rng.choice(kinds) if rng.random() < .6 else rng.randbytes(K64))[:K64]
                             for _ in range(32)) + rng.randbytes(1234))
    for c in mods(seed, i):
        img[c * K64:(c + 1) * K64] = random.Random(f"{seed}/{i}/{c}").randbytes(K64)
    return bytes(img)

def other(seed, i):
    rng = random.Random(f"{seed}/other/{i}")
    return rng.randbytes(rng.randrange(1, 400000)) + bytes(rng.randrange(0, 300000))

def data_for(name):
    kind, seed, i = name.split(":")
    return (disk if kind == "disk" else other)(seed, int(i))

if __name__ == "__main__":
    store_dir, log_path, seed, mode, rounds = sys.argv[1:6]
    s = ChunkStore.open(store_dir, create=True)
    log = open(log_path, "a")
    if mode == "gc":
        live = [line.split()[0] for line in open(log_path) if int(line.split()[1][-1]) % 2 == 0]
        s.gc(live, threshold=1.0)
        print("gc done", flush=True)
        sys.exit(0)
    prev = None
    for i in range(int(rounds)):
        names = [f"disk:{seed}:{i}", f"other:{seed}:{i}"]
        with s.ingest() as ing:
            if prev is None:
                d = ing.add_file(Src(data_for(names[0])), chunking="fixed")
            else:
                changed = [(c * K64, K64) for c in set(mods(seed, i)) | set(mods(seed, i - 1))]
                d = ing.add_file(Src(data_for(names[0])), chunking="fixed", base=prev,
                                 changed=changed)
            o = ing.add_file(Src(data_for(names[1])), chunking="cdc")
            ing.seal()
            with s.env.begin(write=True) as txn:
                ing.commit(txn)
        prev = d.manifest
        for f, name in ((d, names[0]), (o, names[1])):
            log.write(f"{f.manifest} {name}\n")
        log.flush()
        os.fsync(log.fileno())
    print("done", flush=True)
'''


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    sys.path.insert(0, str(root))
    import driver as drv  # the same data generator the subprocess uses

    yield root, driver, drv
    sys.path.remove(str(root))
    sys.modules.pop("driver", None)
    shutil.rmtree(root)  # hundreds of MiB of packs: do not leave them to pytest's retention


def run_driver(root, driver, seed, mode="ingest", rounds=400, crash_at=None, kill_after=None):
    env = dict(os.environ)
    env.pop("KSFS_CRASH_AT", None)
    if crash_at:
        env["KSFS_CRASH_AT"] = crash_at
    proc = subprocess.Popen([sys.executable, str(driver), str(root / "store"), str(root / "log"),
                             str(seed), mode, str(rounds)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def verify_store(root, drv, only=None, seed=None):
    """The store checks clean with data and every logged committed file reads back."""
    logged = [line.split() for line in (root / "log").read_text().splitlines()]
    if seed is not None:
        logged = [item for item in logged if f":{seed}:" in item[1]]
    if only is not None:
        logged = [item for item in logged if only(item[1])]
    with ChunkStore.open(root / "store") as s:
        rep = s.check(read_data=True)
        assert rep.ok, rep.lines()
        for manifest, name in logged:
            data = drv.data_for(name)
            r = s.open_file(manifest)
            assert r.size == len(data)
            assert r.read(0, len(data)) == data, name
    return len(logged)


def test_kill_minus_9_at_random_moments(rig):
    root, driver, drv = rig
    rng = random.Random(1234)
    killed = 0
    for trial in range(16):
        rc, _, err = run_driver(root, driver, f"r{trial}", kill_after=rng.uniform(0.3, 1.2))
        assert rc in (0, -signal.SIGKILL), err
        killed += rc == -signal.SIGKILL
        verify_store(root, drv, seed=f"r{trial}")
    assert killed >= 12
    assert verify_store(root, drv) > 0


@pytest.mark.parametrize("point,hits", [("pack.write", (1, 60)), ("pack.fsync", (1, 4)),
                                        ("index.commit", (1, 4))])
def test_kill_at_each_ingest_crash_point(rig, point, hits):
    root, driver, drv = rig
    nth = random.Random(point).randint(*hits)
    rc, _, err = run_driver(root, driver, f"p-{point}", crash_at=f"{point}:{nth}")
    assert rc == -signal.SIGKILL, (rc, err)
    verify_store(root, drv)


@pytest.mark.parametrize("point", ["gc.sweep", "gc.repack"])
def test_kill_at_each_gc_crash_point(rig, point):
    root, driver, drv = rig
    rc, _, err = run_driver(root, driver, f"g-{point}", rounds=3)
    assert rc == 0, err
    rc, _, err = run_driver(root, driver, "-", mode="gc", crash_at=point)
    assert rc == -signal.SIGKILL, (rc, err)

    def live(name):
        return int(name[-1]) % 2 == 0

    verify_store(root, drv, only=live)
    rc, out, err = run_driver(root, driver, "-", mode="gc")
    assert rc == 0 and "gc done" in out, err
    verify_store(root, drv, only=live)
    with ChunkStore.open(root / "store") as s:
        rep = s.check()
        assert rep.ok and rep.orphan_bytes == 0 and not rep.orphan_packs


def test_gc_reclaims_what_killed_imports_left(rig):
    root, driver, drv = rig
    run_driver(root, driver, "last", kill_after=0.6)

    def live(name):  # the earlier GCs kept only the even rounds
        return ":last:" in name or int(name[-1]) % 2 == 0

    logged = [line.split() for line in (root / "log").read_text().splitlines()]
    with ChunkStore.open(root / "store") as s:
        s.gc([m for m, name in logged if live(name)])
        rep = s.check(read_data=True)
        assert rep.ok and rep.orphan_bytes == 0 and not rep.orphan_packs
    verify_store(root, drv, only=live)
