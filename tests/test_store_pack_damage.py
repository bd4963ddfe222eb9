"""Damage around pack files that check and gc met with a traceback (exit 1), a wrong finding or,
worse, by deleting live records: files by odd names in packs/, a pack whose entry in the packs
database is lost or whose size figure is too small, a pack that gc empties replaced by a
directory, a checkpoint record naming no manifest id, a pack that cannot be read (EIO). Each
is now a line with its exit code, and no live record is removed."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from ksfs.cas import ChunkStore
from ksfs.cas import format as fmt
from tests.cas_helpers import put

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=text,
                          timeout=300)


def no_traceback(res: subprocess.CompletedProcess, code: int) -> str:
    err = res.stderr if isinstance(res.stderr, str) else res.stderr.decode()
    assert res.returncode == code and "Traceback" not in err, (res.returncode, res.stdout, err)
    return res.stdout


@pytest.fixture
def made(tmp_path: Path) -> Iterator[tuple[Path, dict[str, bytes]]]:
    """(store holding s/a with file a in pack 1, {name: bytes} of files a and b); removed
    afterwards."""
    store = tmp_path / "store"
    files = {n: random.Random(n).randbytes(600_000) for n in "ab"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert ksfs(store, "import", "s", "a", str(tmp_path / "a")).returncode == 0
    yield store, files
    shutil.rmtree(tmp_path)


def edit(store: Path, db: str, fn) -> None:
    env = lmdb.open(str(store / "index"), max_dbs=32, map_size=1 << 30)
    try:
        with env.begin(write=True, db=env.open_db(db.encode(), create=False)) as txn:
            fn(txn)
    finally:
        env.close()


def set_pack_size(store: Path, no: int, size: int) -> None:
    def change(txn) -> None:
        live = fmt.decode_pack_value(fmt.pack_key(no), txn.get(fmt.pack_key(no)))[1]
        txn.put(fmt.pack_key(no), fmt.PACK_VALUE.pack(size, live))
    edit(store, "packs", change)


def reads_back(store: Path, files: dict[str, bytes], ckpt: str = "a", name: str = "a") -> None:
    assert ksfs(store, "cat", "s", ckpt, name, text=False).stdout == files[name]


def test_files_by_names_no_pack_has_are_not_packs(made) -> None:
    """'².pack' passes isdigit but not int (check and gc died of ValueError); '1.pack' beside
    '00000001.pack' was taken for pack 1's file (every chunk of the pack 'cut short')."""
    store, files = made
    odd = {"\u00b2.pack": b"x", "1.pack": b"y" * 10, "4294967296.pack": b"z"}
    for name, data in odd.items():
        (store / "packs" / name).write_bytes(data)
    assert "store clean" in no_traceback(ksfs(store, "check"), 0)
    no_traceback(ksfs(store, "gc"), 0)
    no_traceback(ksfs(store, "import", "s", "b", str(store.parent / "b")), 0)
    assert "store clean" in no_traceback(ksfs(store, "check", "--read-data"), 0)
    assert {n: (store / "packs" / n).read_bytes() for n in odd} == odd
    reads_back(store, files)


def test_a_pack_the_store_no_longer_lists_is_kept_by_gc(made) -> None:
    """Its entry in the packs database lost, check called the pack's bytes an unfinished
    ingest's ('`ksfs gc` gives them back') and gc deleted it with every record of s/a."""
    store, files = made
    edit(store, "packs", lambda txn: txn.delete(fmt.pack_key(1)))
    out = no_traceback(ksfs(store, "check"), 6)
    assert "pack 1: index entries point at a pack the store does not list" in out, out
    assert "gives them back" not in out and "unreadable" not in out, out
    out = no_traceback(ksfs(store, "gc"), 0)
    assert "gc: pack 1 left as it was: the store does not list it, but index entries place " \
        "records in it" in out, out
    assert (store / "packs" / fmt.pack_name(1)).exists()
    reads_back(store, files)


def test_a_size_figure_too_small_loses_no_record_and_gc_mends_it(made) -> None:
    """A figure damage made too small: check called the records past it damaged and the bytes
    past it an unfinished ingest's; gc cut them off, and so did the next import reopening
    the pack."""
    store, files = made
    pack = store / "packs" / fmt.pack_name(1)
    whole = pack.stat().st_size
    set_pack_size(store, 1, 1000)
    out = no_traceback(ksfs(store, "check", "--read-data"), 6)
    assert f"pack 1: its index entry gives it 1000 bytes, but the index places records in it " \
        f"up to byte {whole}" in out, out
    assert "gives them back" not in out and "unreadable" not in out, out
    no_traceback(ksfs(store, "import", "s", "b", str(store.parent / "b")), 0)
    assert pack.stat().st_size == whole  # not reopened: 1000 falls inside a record
    out = no_traceback(ksfs(store, "gc"), 0)
    assert f"gc: pack 1's size was 1000 bytes where its file and the records the index places " \
        f"in it say {whole}: it is now {whole}" in out, out
    assert "store clean" in no_traceback(ksfs(store, "check", "--read-data"), 0)
    reads_back(store, files)
    reads_back(store, files, "b", "b")


def test_a_figure_too_small_at_a_record_boundary_is_read_past_by_a_reopen(
        tmp_path: Path) -> None:
    """The figure at a record's start: the reopen finds the records the index places past it
    and appends after them, instead of cutting them off as a crashed ingest's tail."""
    with ChunkStore.open(tmp_path / "store", create=True) as s:
        data = random.Random(7).randbytes(400_000)
        f = put(s, data, chunking="cdc")
        with s.env.begin(db=s.db["chunks"]) as txn:
            third = sorted(fmt.Location.decode(v).offset for _, v in txn.cursor())[2]
            live = fmt.decode_pack_value(fmt.pack_key(1), txn.get(fmt.pack_key(1),
                                                                   db=s.db["packs"]))[1]
        with s.env.begin(write=True, db=s.db["packs"]) as txn:
            txn.put(fmt.pack_key(1), fmt.PACK_VALUE.pack(third, live))
        put(s, random.Random(8).randbytes(200_000), chunking="cdc")
        assert s.open_file(f.manifest).read(0, len(data)) == data
        assert s.check(read_data=True).ok
    shutil.rmtree(tmp_path)


def test_an_empty_pack_replaced_by_a_directory_is_left_by_gc(made) -> None:
    """gc dropped the pack from the index and then failed to unlink it: 'remove repacked pack
    failed: Is a directory', exit 1."""
    store, _ = made
    assert ksfs(store, "rm", "s", "a").returncode == 0
    pack = store / "packs" / fmt.pack_name(1)
    pack.unlink()
    pack.mkdir()
    out = no_traceback(ksfs(store, "gc"), 0)
    assert "gc: pack 1 left as it was: its file is not a regular file" in out, out
    assert pack.is_dir()
    out = no_traceback(ksfs(store, "check"), 6)
    assert "pack 1: its file is not a regular file" in out, out


@pytest.mark.parametrize("manifest", ["q" + "0" * 63, 5])
def test_a_checkpoint_record_naming_no_manifest_id_stops_gc_with_one_line(
        made, manifest: object) -> None:
    """gc died of bytes.fromhex (ValueError, or TypeError for an int); check of the int too."""
    store, files = made

    def damage(txn) -> None:
        for key, value in txn.cursor():
            try:
                rec = json.loads(bytes(value))
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("files"), list):
                rec["files"][0]["manifest"] = manifest
                txn.put(key, json.dumps(rec).encode())
                return
        raise AssertionError("no checkpoint record")

    edit(store, "checkpoints", damage)
    before = {p.name: p.stat().st_size for p in (store / "packs").iterdir()}
    res = ksfs(store, "gc")
    no_traceback(res, 6)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"names {str(manifest)!r} as a manifest, which is no manifest id, so gc frees " \
        "nothing" in res.stderr, res.stderr
    assert {p.name: p.stat().st_size for p in (store / "packs").iterdir()} == before
    out = no_traceback(ksfs(store, "check"), 6)
    assert f"s/a/a: unreadable (manifest {manifest} is missing)" in out, out


def test_a_pack_that_cannot_be_read_is_its_chunks_damage(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error reading a pack escaped check as an OSError traceback."""
    with ChunkStore.open(tmp_path / "store", create=True) as s:
        f = put(s, random.Random(9).randbytes(400_000), chunking="cdc")
        with s.env.begin(db=s.db["chunks"]) as txn:
            locs = sorted((fmt.Location.decode(v).offset, bytes(k)) for k, v in txn.cursor())
        bad_at, bad = locs[len(locs) // 2]
        real_pread = os.pread

        def pread(fd: int, n: int, offset: int) -> bytes:
            """EIO for any read of pack 1 that covers the bad record's first byte."""
            if os.readlink(f"/proc/self/fd/{fd}").endswith(fmt.pack_name(1)) and \
                    offset <= bad_at < offset + n:
                raise OSError(errno.EIO, "Input/output error")
            return real_pread(fd, n, offset)

        monkeypatch.setattr(os, "pread", pread)
        refs = {f.manifest: ["s/a/memory"]}
        for read_data in (False, True):
            rep = s.check(read_data=read_data, references=refs)
            assert rep.damaged_chunks == {
                bad.hex(): "pack 1 cannot be read: Input/output error"}, rep.damaged_chunks
            assert list(rep.affected_references) == ["s/a/memory"]
        monkeypatch.undo()
    shutil.rmtree(tmp_path)
