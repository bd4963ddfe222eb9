"""Damage is evident, and contained: flipped bytes in a pack, a damaged chunk entry in the LMDB
index and a damaged manifest each make exactly the files that depend on them unreadable (EIO
through a real mount) while every other file reads back intact, and ``ksfs check`` names every
affected checkpoint and file (exit 6), not just the first.

Every file holds random bytes of its own, so no chunk is shared and "exactly" is well defined.
"""

from __future__ import annotations

import errno
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from mount_helpers import mounted

from ksfs.cas import format as fmt
from ksfs.keeper import Keeper

KSFS = [sys.executable, "-m", "ksfs.cli"]
FILES = ("disk.raw", "memory", "notes")


def chunk_ids(k: Keeper, session: str, checkpoint: str, name: str) -> list[bytes]:
    f = k.ledger.checkpoint(session, checkpoint).file(name)
    return [cid for cid, _ in k.store.load_manifest(f.manifest).entries if cid is not None]


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, dict, set[str]]:
    """A store of 2 sessions x 2 checkpoints x 3 files; three of the files damaged three ways."""
    rnd = random.Random(6)
    store = tmp_path / "store"
    sources: dict[str, bytes] = {}
    with Keeper(store, create=True) as k:
        for s in ("s1", "s2"):
            for c in ("c1", "c2"):
                d = tmp_path / "src" / s / c
                d.mkdir(parents=True)
                for name, size in zip(FILES, (1 << 20, 700_000, 90_000), strict=True):
                    data = rnd.randbytes(size)
                    (d / name).write_bytes(data)
                    sources[f"{s}/{c}/{name}"] = data
                k.import_files(s, c, [d / n for n in FILES])
        db = k.store.db
        # 1. pack: flip one byte in the middle of a stored chunk of s1/c1/disk.raw
        cid = chunk_ids(k, "s1", "c1", "disk.raw")[3]
        loc = k.store.lookup(cid)
        pack = store / "packs" / fmt.pack_name(loc.pack)
        with open(pack, "r+b") as f:
            at = loc.offset + fmt.HEADER_SIZE + loc.stored_len // 2
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x5A]))
        with k.store.env.begin(write=True) as txn:
            # 2. index: one chunk entry of s1/c2/memory points 16 bytes off its record
            cid = chunk_ids(k, "s1", "c2", "memory")[1]
            loc = fmt.Location.decode(txn.get(cid, db=db["chunks"]))
            moved = fmt.Location(loc.pack, loc.offset + 16, loc.stored_len, loc.plain_len,
                                 loc.codec)
            txn.put(cid, moved.encode(), db=db["chunks"])
            # 3. manifest: flip a byte of the stored manifest of s2/c1/notes
            mid = bytes.fromhex(k.ledger.checkpoint("s2", "c1").file("notes").manifest)
            raw = bytearray(txn.get(mid, db=db["manifests"]))
            raw[len(raw) // 2] ^= 0x01
            txn.put(mid, bytes(raw), db=db["manifests"])
    return store, sources, {"s1/c1/disk.raw", "s1/c2/memory", "s2/c1/notes"}


def test_check_names_every_affected_checkpoint_and_file(damaged) -> None:
    store, _, affected = damaged
    res = subprocess.run(KSFS + ["--store", str(store), "check", "--read-data"],
                         capture_output=True, text=True)
    assert res.returncode == 6, res.stdout + res.stderr
    named = {line.split(":")[0] for line in res.stdout.splitlines() if ": unreadable" in line}
    assert named == affected, res.stdout
    # --json: the same findings as records a script can use without parsing sentences
    res = subprocess.run(KSFS + ["--store", str(store), "check", "--read-data", "--json"],
                         capture_output=True, text=True)
    assert res.returncode == 6, res.stderr
    report = json.loads(res.stdout)
    assert not report["ok"] and report["data_read"] and report["chunks_checked"] > 0
    assert len(report["findings"]) == len(report["problems"])
    kinds = {f["kind"] for f in report["findings"]}
    assert {"damaged_chunk", "damaged_manifest", "unreadable_file"} <= kinds, kinds
    assert {f["file"] for f in report["findings"] if f["kind"] == "unreadable_file"} == affected
    assert all(f["why"] for f in report["findings"] if "why" in f)
    # Without --read-data the moved index entry and the damaged manifest are still found.
    res = subprocess.run(KSFS + ["--store", str(store), "check"], capture_output=True, text=True)
    assert res.returncode == 6
    named = {line.split(":")[0] for line in res.stdout.splitlines() if ": unreadable" in line}
    assert named >= {"s1/c2/memory", "s2/c1/notes"}, res.stdout


def test_mount_gives_eio_on_exactly_the_affected_files(damaged) -> None:
    store, sources, affected = damaged
    with mounted(store) as mnt:
        for ref, data in sorted(sources.items()):
            s, c, name = ref.split("/")
            path = mnt / "sessions" / s / "checkpoints" / c / name
            if ref in affected:
                with pytest.raises(OSError) as exc:
                    with open(path, "rb") as f:
                        while f.read(1 << 20):
                            pass
                assert exc.value.errno == errno.EIO, (ref, exc.value)
            else:
                assert path.read_bytes() == data, ref
    # `ksfs cat` of an affected file fails with one line and exit 6, others are intact.
    res = subprocess.run(KSFS + ["--store", str(store), "cat", "s2", "c1", "notes"],
                         capture_output=True, text=True)
    assert res.returncode == 6 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = subprocess.run(KSFS + ["--store", str(store), "cat", "s2", "c2", "notes"],
                         capture_output=True)
    assert res.returncode == 0 and res.stdout == sources["s2/c2/notes"]
