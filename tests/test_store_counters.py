"""The index's counters (cas_meta: next_pack, ingest_commits, gc_generation) set wrong in a real
store on disk: ``ksfs check`` names each one that breaks something (exit 6, a line and a
``damaged_counter`` finding), and the verbs a damaged counter stops are one line and exit 6, never
a traceback."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from ksfs.cas import format as fmt

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                          timeout=300)


def one_line(res: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = res.stderr.strip()
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def set_meta(store: Path, db: str = "cas_meta", **values: bytes | None) -> None:
    """Write (or, for None, delete) keys of one of the index's databases with lmdb itself."""
    env = lmdb.open(str(store / "index"), max_dbs=32, map_size=1 << 30)
    try:
        with env.begin(write=True, db=env.open_db(db.encode(), create=False)) as txn:
            for key, value in values.items():
                if value is None:
                    txn.delete(key.encode())
                else:
                    txn.put(key.encode(), value)
    finally:
        env.close()


def check(store: Path) -> tuple[int, str, list[dict]]:
    """(exit code, text output, json findings) of ``ksfs check``."""
    text = ksfs(store, "check")
    as_json = ksfs(store, "check", "--json")
    assert "Traceback" not in text.stderr + as_json.stderr, text.stderr + as_json.stderr
    assert text.returncode == as_json.returncode, (text.returncode, as_json.returncode)
    return text.returncode, text.stdout, json.loads(as_json.stdout)["findings"]


def counter_findings(findings: list[dict]) -> dict[str, str]:
    return {f["counter"]: f["why"] for f in findings if f["kind"] == "damaged_counter"}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Path]:
    """A store holding checkpoint s/a (one file in pack 1); removed afterwards."""
    where = tmp_path / "store"
    src = tmp_path / "memory"
    src.write_bytes(random.Random(1).randbytes(600_000))
    res = ksfs(where, "import", "s", "a", str(src))
    assert res.returncode == 0, res.stderr
    yield where
    shutil.rmtree(tmp_path)


def new_file(store: Path, seed: int) -> str:
    path = store.parent / f"file{seed}"
    path.write_bytes(random.Random(seed).randbytes(300_000))
    return str(path)


def test_a_healthy_store_has_no_counter_finding_even_with_a_killed_ingests_pack(
        store: Path) -> None:
    """An ingest killed before its commit leaves a pack file numbered at or past next_pack:
    no damage (gc gives it back)."""
    (store / "packs" / fmt.pack_name(2)).write_bytes(b"leftover" * 100)
    code, out, findings = check(store)
    assert code == 0 and not counter_findings(findings), out


@pytest.mark.parametrize("value", [b"1", None, b"0", b"-3"])
def test_next_pack_not_above_a_listed_pack_is_damage(store: Path, value: bytes | None) -> None:
    set_meta(store, next_pack=value)
    code, out, findings = check(store)
    shown = "missing (read as 1)" if value is None else value.decode()
    assert code == 6, out
    assert f"index counter next_pack: {shown} is not above pack 1, which the index lists" in \
        out, out
    assert "not above pack 1" in counter_findings(findings)["next_pack"]
    # what the line says: the next ingest that stores a chunk moves it past the listed packs
    assert ksfs(store, "import", "s", "b", new_file(store, 2)).returncode == 0
    code, out, _ = check(store)
    assert code == 0, out


def test_next_pack_that_lets_a_new_pack_take_a_lost_packs_number(store: Path) -> None:
    """Pack 1 is gone with its entry in the packs database, while chunk entries still point
    into it: with next_pack at 1 the next new pack is pack 1, and those entries would read its
    records (check then calls them damaged headers, not missing chunks)."""
    (store / "packs" / fmt.pack_name(1)).unlink()
    env = lmdb.open(str(store / "index"), max_dbs=32, map_size=1 << 30)
    with env.begin(write=True, db=env.open_db(b"packs", create=False)) as txn:
        assert txn.delete(fmt.pack_key(1))
    env.close()
    code, out, _ = check(store)
    assert code == 6 and "index counter" not in out, out  # next_pack is 2: no reuse
    set_meta(store, next_pack=b"1")
    code, out, findings = check(store)
    assert code == 6, out
    why = counter_findings(findings)["next_pack"]
    assert why.startswith("1 is not above pack 1, which index entries name while neither the "
                          "index lists it nor packs/ holds it: the next new pack can take its "
                          "number"), why
    assert f"index counter next_pack: {why}" in out


@pytest.mark.parametrize("name", ["next_pack", "ingest_commits", "gc_generation"])
def test_a_counter_that_is_no_number_is_named_by_check(store: Path, name: str) -> None:
    set_meta(store, **{name: b"7\x00x"})
    code, out, findings = check(store)
    assert code == 6, out
    assert counter_findings(findings) == {name: counter_findings(findings)[name]}
    assert f"index counter {name}: b'7\\x00x' is no number" in out, out
    verbs = {"next_pack": ("import", "gc"), "ingest_commits": ("import",),
             "gc_generation": ("gc",)}[name]
    for verb in verbs:
        args = ["import", "s", "b", new_file(store, 3)] if verb == "import" else ["gc"]
        one_line(ksfs(store, *args), 6, name, "no number")


def test_next_pack_past_the_last_pack_number_is_one_line_not_a_traceback(store: Path) -> None:
    """A pack numbered 2**32 cannot be indexed: the commit of a gc's repack (or of an ingest
    that starts a pack) died with struct.error. check names the counter; gc and import stop
    before they write anything."""
    assert ksfs(store, "import", "s", "b", new_file(store, 4)).returncode == 0
    assert ksfs(store, "rm", "s", "a").returncode == 0  # pack 1 is now thin: gc repacks it
    set_meta(store, next_pack=str(2**32).encode())
    before = sorted(p.name for p in (store / "packs").iterdir())
    one_line(ksfs(store, "gc"), 6, "next_pack", "past the last pack number")
    one_line(ksfs(store, "import", "s", "c", new_file(store, 5)), 6, "next_pack")
    assert sorted(p.name for p in (store / "packs").iterdir()) == before
    code, out, findings = check(store)
    assert code == 6, out
    assert counter_findings(findings) == {
        "next_pack": "4294967296 is past the last pack number (4294967295): every ingest and "
                     "gc fails (restore the index from a backup)"}
