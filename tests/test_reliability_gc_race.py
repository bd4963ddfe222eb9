"""GC never deletes what a running ingest or a reader needs, proven by racing them.

Each round imports a checkpoint X (session ``old``) and deletes it, then at once imports Y
(session ``new``), whose disk is mostly X's (so its ingest finds X's chunks still indexed and
reuses them instead of writing them again) plus a 12 MiB file that keeps the ingest busy, and runs
``ksfs gc``. Meanwhile a reader thread reads a checkpoint that is never deleted, each read in a
fresh ``ksfs cat`` process. Import and GC are separate processes, as they are in use (CLI vs
daemon). Afterwards every Y reads back byte-identical and the store checks clean. Without GC
listing live manifests under its exclusive lock, the first round already loses Y's chunks.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

from ksfs.keeper import Keeper

KSFS = [sys.executable, "-m", "ksfs.cli"]
ROUNDS = 6


def ksfs(store: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(KSFS + ["--store", str(store), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{proc.args[3:]} exited {proc.returncode}: {err}"


def read_all(store: Path, session: str, name: str, files: list[str]) -> dict[str, str]:
    """sha256 of each file of a checkpoint, read in a fresh process (as `ksfs cat` reads)."""
    out = {}
    for f in files:
        res = subprocess.run(KSFS + ["--store", str(store), "cat", session, name, f],
                             capture_output=True, timeout=120)
        assert res.returncode == 0, res.stderr.decode()
        out[f] = hashlib.sha256(res.stdout).hexdigest()
    return out


def test_import_gc_and_readers_race(tmp_path: Path) -> None:
    rnd = random.Random(8)
    store = tmp_path / "store"
    src = tmp_path / "src"
    src.mkdir()
    stable = src / "stable"
    stable.mkdir()
    (stable / "disk.raw").write_bytes(rnd.randbytes(2 << 20))
    (stable / "notes").write_bytes(rnd.randbytes(300_000))
    with Keeper(store, create=True) as k:
        k.import_files("keep", "k1", [stable / "notes"], disks=[stable / "disk.raw"])
    want_stable = {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                   for f in stable.iterdir()}

    errors: list[str] = []
    stop = threading.Event()
    reads = [0]

    def reader() -> None:
        # Readers open the store themselves, in their own process, over and over.
        while not stop.is_set():
            try:
                got = read_all(store, "keep", "k1", sorted(want_stable))
            except AssertionError as exc:
                errors.append(str(exc))
                return
            if got != want_stable:
                errors.append(f"keep/k1 read back differently: {got}")
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(1)]
    for t in threads:
        t.start()
    expected: dict[str, str] = {}
    try:
        data = bytearray(rnd.randbytes(3 << 20))
        for r in range(ROUNDS):
            xdir, ydir = src / f"x{r}", src / f"y{r}"
            xdir.mkdir()
            ydir.mkdir()
            data[:65536] = rnd.randbytes(65536)  # each round's X has some chunks of its own
            (xdir / "disk.raw").write_bytes(data)
            finish(ksfs(store, "import", "old", f"x{r}", str(xdir / "disk.raw")))
            ydata = bytearray(data)
            off = rnd.randrange(1, len(ydata) // 65536) * 65536
            ydata[off:off + 65536] = rnd.randbytes(65536)
            (ydir / "disk.raw").write_bytes(ydata)
            (ydir / "memory").write_bytes(rnd.randbytes(12 << 20))  # keeps the ingest busy
            expected[f"y{r}"] = hashlib.sha256(ydata).hexdigest()
            finish(ksfs(store, "rm", "old", f"x{r}"))
            # The race: Y's ingest finds X's chunks stored (X is deleted, not yet collected) and
            # reuses them, while GC starts, lists what is live and sweeps.
            imp = ksfs(store, "import", "new", f"y{r}", str(ydir / "memory"),
                       str(ydir / "disk.raw"))
            time.sleep(0.15 * (r % 3))
            rm_gc = ksfs(store, "gc")
            finish(imp)
            finish(rm_gc)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert reads[0] > 0
    with Keeper(store) as k:
        assert set(k.ledger.checkpoint_names("old")) == set()
        assert set(k.ledger.checkpoint_names("new")) == set(expected)
        report = k.check(read_data=True)
        assert report.ok, report.lines()
        assert k.ledger.verify(k.store) == []
    for name, digest in expected.items():
        assert read_all(store, "new", name, ["disk.raw"])["disk.raw"] == digest, name
    # One last GC with nothing racing frees every chunk only the deleted Xs held.
    res = subprocess.run(KSFS + ["--store", str(store), "gc", "--json"], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    with Keeper(store) as k:
        assert k.check(read_data=True).ok
