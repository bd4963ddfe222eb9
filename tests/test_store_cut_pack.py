"""A pack cut short (a truncation, a file system that lost its end) stays what check says it is:
no later ingest appends to it (it starts a pack of its own), so the records the cut took stay
"cut short" and are never padded into zeros; importing a good copy again repairs them, and gc
then settles the pack's figure to its file's length, after which the store checks clean."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ksfs.cas import format as fmt
from ksfs.cas.packs import PackWriter

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=text,
                          timeout=300)


def check_json(store: Path) -> dict:
    res = ksfs(store, "check", "--json")
    assert "Traceback" not in res.stderr, res.stderr
    report = json.loads(res.stdout)
    assert res.returncode == (0 if report["ok"] else 6), res
    return report


def chunk_findings(report: dict) -> dict[str, str]:
    return {f["chunk"]: f["why"] for f in report["findings"]
            if f["kind"] in ("damaged_chunk", "missing_chunk")}


def pack_findings(report: dict) -> dict[int, str]:
    return {f["pack"]: f["why"] for f in report["findings"] if f["kind"] == "damaged_pack"}


@pytest.fixture
def cut(tmp_path: Path) -> Iterator[tuple[Path, dict[str, bytes], int]]:
    """A store whose pack 1, holding checkpoint s/a (file ``a``), is cut to 80% of its length;
    (store, {name: bytes} of files a, b, c, the pack's length before the cut). Removed after."""
    store = tmp_path / "store"
    files = {n: random.Random(n).randbytes(700_000) for n in "abc"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    res = ksfs(store, "import", "s", "a", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    pack = store / "packs" / fmt.pack_name(1)
    whole = pack.stat().st_size
    os.truncate(pack, whole * 4 // 5)
    yield store, files, whole
    shutil.rmtree(tmp_path)


def test_check_calls_a_cut_pack_cut_short_after_a_later_import_too(cut) -> None:
    store, files, whole = cut
    pack = store / "packs" / fmt.pack_name(1)
    before = check_json(store)
    lost = chunk_findings(before)
    assert lost and all("pack 1 is cut short" in why for why in lost.values()), lost
    assert pack_findings(before) == {1: f"its file has {whole * 4 // 5} bytes, the index "
                                        f"expects {whole}"}
    res = ksfs(store, "import", "s", "b", str(store.parent / "b"))  # other data: no repair
    assert res.returncode == 0, res.stderr
    assert pack.stat().st_size == whole * 4 // 5  # not appended to, not padded with zeros
    after = check_json(store)
    assert chunk_findings(after) == lost
    assert pack_findings(after) == pack_findings(before)
    assert {f["file"] for f in after["findings"] if f["kind"] == "unreadable_file"} == {"s/a/a"}
    assert ksfs(store, "cat", "s", "b", "b", text=False).stdout == files["b"]


def test_a_good_copy_imported_after_another_import_repairs_and_gc_settles_the_pack(cut) -> None:
    """With the cut pack padded by the import of b, importing a again took the zeros for the
    lost records (0 new bytes for them) and s/a2 could not be read."""
    store, files, whole = cut
    pack = store / "packs" / fmt.pack_name(1)
    for name, ckpt in (("b", "b"), ("a", "a2")):
        res = ksfs(store, "import", "s", ckpt, str(store.parent / name))
        assert res.returncode == 0, res.stderr
    for ckpt in ("a", "a2"):  # one manifest: its lost chunks are stored anew
        assert ksfs(store, "cat", "s", ckpt, "a", text=False).stdout == files["a"]
    report = check_json(store)
    assert not chunk_findings(report) and not report["ok"], report
    assert pack_findings(report) == {
        1: f"its file has {whole * 4 // 5} bytes, the index expects {whole}: cut short, but no "
           "record the index places in it was lost (`ksfs gc` takes its file's length as its "
           "size)"}
    res = ksfs(store, "gc", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["settled_packs"] == {"1": [whole, whole * 4 // 5]}
    assert check_json(store)["ok"]
    assert pack.stat().st_size == whole * 4 // 5
    res = ksfs(store, "import", "s", "c", str(store.parent / "c"))
    assert res.returncode == 0, res.stderr
    assert ksfs(store, "check", "--read-data").returncode == 0
    for ckpt, name in (("a", "a"), ("b", "b"), ("c", "c")):
        assert ksfs(store, "cat", "s", ckpt, name, text=False).stdout == files[name]


def test_try_reopen_leaves_a_short_pack_and_cuts_a_long_ones_tail(tmp_path: Path) -> None:
    packs = tmp_path / "packs"
    packs.mkdir()
    try:
        for no, size in ((1, 100), (2, 300)):
            (packs / fmt.pack_name(no)).write_bytes(b"r" * size)
        assert PackWriter.try_reopen(str(packs), 1, lambda: 200) is None
        assert (packs / fmt.pack_name(1)).read_bytes() == b"r" * 100
        w = PackWriter.try_reopen(str(packs), 2, lambda: 200)
        assert w is not None
        try:
            assert w.start == 200 and (packs / fmt.pack_name(2)).stat().st_size == 200
        finally:
            w.close()
        # the short pack's flock was let go: another writer could take it
        w = PackWriter.try_reopen(str(packs), 1, lambda: 100)
        assert w is not None
        w.close()
    finally:
        shutil.rmtree(packs)
