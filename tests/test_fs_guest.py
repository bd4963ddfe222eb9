"""fs/ and `ksfs diff` against a real guest: the guest logs every file it writes or deletes in
its transcript, so the changes between two checkpoints are known; `diff -r` of the two fs/
directories through the mount reports exactly those, `ksfs diff` agrees, and every file read
through fs/ equals the same file from a read-only loop mount of the checkpoint's disk image."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.cli_helpers import daemon_mount, guest_dir, ksfs, transcript
from tests.guest import guest_writes

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def guest_mount(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsguest")
    env = dict(os.environ, KSFS_GUEST=str(guest_dir()))
    with daemon_mount(base, env) as (store, mnt):
        s = f"fs-{uuid.uuid4().hex[:6]}"
        os.mkdir(mnt / "sessions" / s)
        yield store, mnt, env, s, base


def expected_changes(lines_a: list[dict], lines_b: list[dict], fs_a: Path) -> set:
    """What the guest did to /data/work between A and B, as (kind, path relative to the fs)."""
    touched: dict[str, str] = {}
    for x in lines_b[len(lines_a):]:
        if x.get("op") in ("write", "delete"):
            touched[x["file"].removeprefix("/data/")] = x["op"]
    out = set()
    for rel, last in touched.items():
        before = os.path.lexists(fs_a / rel)
        if last == "write":
            out.add(("changed", rel) if before else ("added", rel))
        elif before:
            out.add(("removed", rel))
    return out


def late_writebacks(lines_a: list[dict], fs_a: Path) -> set:
    """Work files written before A (and still there at A) whose data the guest's page cache
    may write back only after A (writeback expires dirty pages after 30 s and the work files
    are not fsynced): they can differ between A and B although untouched in between."""
    out = set()
    for x in lines_a:
        if x.get("op") == "write":
            rel = x["file"].removeprefix("/data/")
            if os.path.lexists(fs_a / rel):
                out.add(("changed", rel))
    return out


def test_guest_changes_seen_by_diff_r_and_ksfs_diff(guest_mount) -> None:
    store, mnt, env, s, base = guest_mount
    cps = mnt / "sessions" / s / "checkpoints"
    guest_writes(store, s, 3, start=0)  # a first checkpoint once the agent has started its work
    a = f"a{int(time.monotonic() * 1000)}"
    os.mkdir(cps / a)
    assert len(transcript(cps / a / "transcript")) >= 3
    guest_writes(store, s, 8)
    os.mkdir(cps / "b")
    la, lb = transcript(cps / a / "transcript"), transcript(cps / "b" / "transcript")
    assert lb[: len(la)] == la and len(lb) > len(la)
    want = expected_changes(la, lb, cps / a / "fs")
    want.add(("changed", "agent/transcript.jsonl"))
    assert any(k != "changed" or p.startswith("work/") for k, p in want)

    res = subprocess.run(["diff", "-rq", "--no-dereference", str(cps / a / "fs"),
                          str(cps / "b" / "fs")], capture_output=True, text=True)
    seen = set()
    for line in res.stdout.splitlines():
        if line.startswith("Files "):
            rel = line.split(" and ")[0][len("Files "):]
            seen.add(("changed", str(Path(rel).relative_to(cps / a / "fs"))))
        elif line.startswith("Only in "):
            where, _, fname = line[len("Only in "):].partition(": ")
            side = "removed" if where.startswith(str(cps / a / "fs")) else "added"
            root = cps / a / "fs" if side == "removed" else cps / "b" / "fs"
            seen.add((side, str((Path(where) / fname).relative_to(root))))
    seen.discard(("changed", "agent/calls"))  # the gateway call counter, when it moved
    late = late_writebacks(la, cps / a / "fs")
    assert want <= seen <= want | late, (seen, want)

    d = json.loads(ksfs(store, env, "diff", s, a, "b", "--json").stdout)
    from_ksfs = {(c["kind"], c["path"]) for c in d["files"]} - {("changed", "agent/calls")}
    assert from_ksfs == seen
    assert d["disk"]["changed_clusters"] > 0
    assert 0 < d["memory"]["share_differing"] < 1
    assert {e["type"] for e in d["events"]} >= {"checkpoint.begin", "checkpoint.published"}

    # Every file through fs/ equals the same file in a read-only loop mount of a copy of the
    # checkpoint's disk (a copy: the kernel replays the guest's journal into it).
    copy = base / "b-disk.raw"
    shutil.copyfile(cps / "b" / "disk.raw", copy)
    loop = base / "loop"
    loop.mkdir()
    # A writable loop device under a read-only mount: the kernel may replay the journal.
    dev = subprocess.run(["losetup", "-f", "--show", str(copy)], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        subprocess.run(["mount", "-o", "ro", dev, str(loop)], check=True)
    except BaseException:
        subprocess.run(["losetup", "-d", dev])
        raise
    try:
        compared = 0
        for p in loop.rglob("*"):
            rel = p.relative_to(loop)
            if "lost+found" in rel.parts:
                continue
            q = cps / "b" / "fs" / rel
            st_p, st_q = os.lstat(p), os.lstat(q)
            assert (st_p.st_mode, st_p.st_size, st_p.st_uid) == (
                st_q.st_mode, st_q.st_size, st_q.st_uid), rel
            if p.is_file() and not p.is_symlink():
                assert p.read_bytes() == q.read_bytes(), rel
                compared += 1
        assert compared >= 3
    finally:
        subprocess.run(["umount", str(loop)], check=True)
        subprocess.run(["losetup", "-d", dev])
