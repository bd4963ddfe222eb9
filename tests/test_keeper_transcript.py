"""The transcript a save records (its last seq, what reconcile compares) is read from the
frozen disk and partition that hold it, as fs/ and diff choose theirs: QA (tenth session)
found every checkpoint of a guest whose root was not the first disk (an adopted domain with a
data disk first) or not the first ext partition recorded no transcript seq, so every restore
reconciled "unrecorded"."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from ksfs.guestfs.mkimage import build_ext4, build_partitioned, have_tools
from ksfs.keeper import Keeper
from ksfs.vm.chain import ChainSource

pytestmark = pytest.mark.skipif(not have_tools() or shutil.which("qemu-img") is None,
                                reason="needs mkfs.ext4, sfdisk and qemu-img")


def test_the_frozen_transcript_is_found_on_a_later_disk_and_partition(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "etc").mkdir(parents=True)  # looks like a root, holds no transcript
    (data / "etc" / "hostname").write_text("decoy\n")
    root = tmp_path / "root"
    (root / "agent").mkdir(parents=True)
    (root / "agent" / "transcript.jsonl").write_text(
        "".join(json.dumps({"seq": i}) + "\n" for i in range(1, 8)))
    build_ext4(data, tmp_path / "data.img", 16)
    build_ext4(root, tmp_path / "root.img", 16)
    build_partitioned(tmp_path / "root.img", tmp_path / "vdb.raw", table="gpt")
    sources = [ChainSource(tmp_path / "data.img", "data disk"),
               ChainSource(tmp_path / "vdb.raw", "root disk")]
    try:
        with Keeper(tmp_path / "store", create=True) as k:
            k.ensure_session("s")
            frozen = SimpleNamespace(disks=[SimpleNamespace(source=s) for s in sources])
            info = k._frozen_transcript(k.ledger.session("s"), frozen)
            assert info is not None and info.last_seq == 7, info
            # no disk holding it: nothing recorded, not an error
            lone = SimpleNamespace(disks=[SimpleNamespace(source=sources[0])])
            assert k._frozen_transcript(k.ledger.session("s"), lone) is None
    finally:
        for s in sources:
            s.close()


def test_a_damaged_transcript_line_is_said_not_swallowed(tmp_path: Path) -> None:
    """QA: a damaged line was swallowed like a disk without the transcript (transcript_seq
    null, no event, exit 0). The save now gets the reason (and records fs.unreadable, warns and
    says it in --json: tests/test_keeper_vm_qa.py)."""
    root = tmp_path / "root"
    (root / "agent").mkdir(parents=True)
    (root / "agent" / "transcript.jsonl").write_text(
        json.dumps({"seq": 1}) + "\n{not json\n" + json.dumps({"seq": 3}) + "\n")
    build_ext4(root, tmp_path / "root.img", 16)
    source = ChainSource(tmp_path / "root.img", "root disk")
    try:
        with Keeper(tmp_path / "store", create=True) as k:
            k.ensure_session("s")
            frozen = SimpleNamespace(disks=[SimpleNamespace(source=source)])
            info, why = k._read_frozen_transcript(k.ledger.session("s"), frozen)
            assert info is None and "line 2 is not JSON" in why, why
            assert "agent/transcript.jsonl" in why
    finally:
        source.close()


def test_a_damaged_disk_gives_an_integrity_error_not_an_empty_transcript(
        tmp_path: Path) -> None:
    """QA: with the disk's chunks damaged, `ksfs cat S C transcript` printed nothing, exit 0:
    wrong bytes that say the guest did no work. It fails as every damaged read does."""
    import subprocess
    import sys

    root = tmp_path / "root"
    (root / "agent").mkdir(parents=True)
    (root / "agent" / "transcript.jsonl").write_text(
        "".join(json.dumps({"seq": i, "text": "x" * 80}) + "\n" for i in range(1, 3000)))
    build_ext4(root, tmp_path / "disk.raw", 8)
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        k.import_files("s", "c1", [tmp_path / "disk.raw"])
        assert json.loads(k.transcript_bytes(k.ledger.checkpoint("s", "c1"))
                          .splitlines()[-1])["seq"] == 2999
    for pack in (store / "packs").glob("*.pack"):  # a flipped byte in every 64 KiB
        data = bytearray(pack.read_bytes())
        for at in range(512, len(data), 65536):
            data[at] ^= 0xFF
        pack.write_bytes(bytes(data))
    res = subprocess.run([sys.executable, "-m", "ksfs.cli", "--store", str(store), "cat", "s",
                          "c1", "transcript"], capture_output=True, text=True)
    assert res.returncode == 6 and res.stdout == "", (res.returncode, res.stderr)
    assert "damaged" in res.stderr, res.stderr


def test_ksfs_cat_streams_a_large_transcript(tmp_path: Path) -> None:
    """QA: `ksfs cat S C transcript` held the whole transcript three times over (285 MB of
    memory for an 80 MB one). It reads the guest's file a piece at a time: its peak memory
    stays near that of cat-ing meta.json, and its bytes are the file's."""
    import subprocess
    import sys

    root = tmp_path / "root"
    (root / "agent").mkdir(parents=True)
    line = {"seq": 0, "text": "y" * 400}
    lines = "".join(json.dumps(dict(line, seq=i)) + "\n" for i in range(1, 120_001))
    (root / "agent" / "transcript.jsonl").write_text(lines)  # about 49 MB
    build_ext4(root, tmp_path / "disk.raw", 96)
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        k.import_files("s", "c1", [tmp_path / "disk.raw"])

    # The child says its own peak (VmHWM: ru_maxrss would count this process's, inherited
    # across fork and exec).
    said = ("import atexit, runpy, sys\n"
            "def hwm():\n"
            "    for x in open('/proc/self/status'):\n"
            "        if x.startswith('VmHWM:'):\n"
            "            sys.stderr.write('HWM ' + x.split()[1] + '\\n')\n"
            "atexit.register(hwm)\n"
            "sys.argv = ['ksfs'] + sys.argv[1:]\n"
            "runpy.run_module('ksfs.cli', run_name='__main__')\n")

    def cat(name: str) -> tuple[bytes, int]:
        out = tmp_path / f"out-{name}"
        with out.open("wb") as f:
            res = subprocess.run([sys.executable, "-c", said, "--store", str(store), "cat",
                                  "s", "c1", name], stdout=f, stderr=subprocess.PIPE,
                                 text=True)
        assert res.returncode == 0, (name, res.stderr)
        return out.read_bytes(), int(res.stderr.split("HWM ")[-1]) * 1024

    got, peak = cat("transcript")
    assert got == lines.encode()
    _, baseline = cat("meta.json")
    assert peak < baseline + 24 * 2**20, (peak, baseline, len(got))


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_the_mount_reads_a_large_transcript_a_piece_at_a_time(tmp_path: Path) -> None:
    """The mount's transcript file was built whole at every open (a 49 MB one held once per
    open handle, and built again at each open, being past the record files' 32 MiB cache). It
    reads the guest's file a piece at a time: two handles at once read the file's bytes, and
    the mount server's peak memory grows by far less than the file."""
    from tests.mount_helpers import mounted

    root = tmp_path / "root"
    (root / "agent").mkdir(parents=True)
    line = {"seq": 0, "text": "z" * 400}
    lines = "".join(json.dumps(dict(line, seq=i)) + "\n" for i in range(1, 120_001)).encode()
    (root / "agent" / "transcript.jsonl").write_bytes(lines)  # about 49 MB
    build_ext4(root, tmp_path / "disk.raw", 96)
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        k.import_files("s", "c1", [tmp_path / "disk.raw"])
    with mounted(store) as mnt:
        pid = mounted.last_pid
        assert os.listdir(mnt / "sessions" / "s" / "checkpoints") == ["c1"]
        before = _peak_rss(pid)
        path = mnt / "sessions" / "s" / "checkpoints" / "c1" / "transcript"
        assert path.stat().st_size == len(lines)
        middle = len(lines) // 2 + 5
        with open(path, "rb") as whole, open(path, "rb") as piece:
            piece.seek(middle)
            assert piece.read(5000) == lines[middle:middle + 5000]
            got = whole.read()
        grew = _peak_rss(pid) - before
    assert got == lines
    assert grew < 24 * 2**20, (grew, len(lines))


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_transcript_path_that_is_no_file_cats_empty_as_the_mount_shows_it(
        tmp_path: Path, kind: str) -> None:
    """Review of the streamed cat: a transcript path that is a directory was 'guest inode 13
    is not a regular file', exit 2, where the mount's record file (and cat before) is empty."""
    import os
    import subprocess
    import sys

    root = tmp_path / "root"
    (root / "agent").mkdir(parents=True)
    if kind == "directory":
        (root / "agent" / "transcript.jsonl").mkdir()
    else:
        os.symlink("elsewhere.jsonl", root / "agent" / "transcript.jsonl")
    build_ext4(root, tmp_path / "disk.raw", 8)
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        k.import_files("s", "c1", [tmp_path / "disk.raw"])
        assert k.transcript_bytes(k.ledger.checkpoint("s", "c1")) == b""
    res = subprocess.run([sys.executable, "-m", "ksfs.cli", "--store", str(store), "cat", "s",
                          "c1", "transcript"], capture_output=True)
    assert (res.returncode, res.stdout, res.stderr) == (0, b"", b"")
