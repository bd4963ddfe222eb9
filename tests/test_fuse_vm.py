"""The whole lifecycle through the mount alone, against a real guest under libvirt: mkdir a session,
mkdir checkpoints, echo a checkpoint name to resume, mkdir a fork; the guest's transcript, read
through the mount too, then shows what the CLI verbs show (tests/test_keeper_vm.py).

Every domain made here is destroyed and undefined at the end, even on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ksfs.keeper import Keeper
from tests.cli_helpers import virsh
from tests.guest import guest_writes
from tests.mount_helpers import mounted

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def guest() -> Path:
    if shutil.which("virsh") is None or shutil.which("qemu-system-x86_64") is None:
        pytest.skip("libvirt or QEMU is not installed")
    subprocess.run([str(ROOT / "tools/start-libvirt")], check=True)
    out = subprocess.run([str(ROOT / "tools/build-guest")], check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]
    return Path(out)


def transcript(cp: Path) -> list[dict]:
    out = []
    for line in (cp / "transcript").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a torn last line
    return out


def save(mnt: Path, session: str, name: str) -> Path:
    cp = mnt / "sessions" / session / "checkpoints" / name
    os.mkdir(cp)  # returns once the checkpoint is published
    return cp


def test_lifecycle_through_the_mount(guest: Path, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    agent, fork = f"magent-{tag}", f"mfork-{tag}"
    store = tmp_path / "store"
    Keeper(store, create=True).close()
    try:
        with mounted(store, env={"KSFS_GUEST": str(guest)}) as mnt:
            sessions = mnt / "sessions"
            os.mkdir(sessions / agent)
            assert agent in os.listdir(sessions)
            status = json.loads((sessions / agent / "status").read_text())
            assert status["state"] == "running" and status["domain"] == f"ksfs-{agent}"

            # Save once the guest has made a few transcript lines durable.
            guest_writes(store, agent, 3, start=0)
            cp = save(mnt, agent, "warm")
            assert len(transcript(cp)) >= 3
            files = set(os.listdir(cp))
            assert {"disk.raw", "memory", "meta.json", "domain.xml", "transcript", "forks"} <= files
            assert (cp / "disk.raw").stat().st_size > 0 and (cp / "memory").stat().st_size > 0

            before = save(mnt, agent, "before")
            at_cp = transcript(before)
            last = at_cp[-1]
            guest_writes(store, agent, 5)
            later = save(mnt, agent, "later")
            assert transcript(later)[-1]["seq"] > last["seq"] + 3

            # echo before > resume
            with open(sessions / agent / "resume", "w") as f:
                f.write("before\n")
            assert (sessions / agent / "resume").read_text().startswith("ok before")
            guest_writes(store, agent, 2)
            lines = transcript(save(mnt, agent, "after"))
            assert lines[: len(at_cp)] == at_cp
            assert lines[len(at_cp)]["seq"] == last["seq"] + 1
            kinds = [json.loads(x)["type"] for x in
                     (sessions / agent / "events").read_text().splitlines()]
            i = len(kinds) - 1 - kinds[::-1].index("restore.begin")
            assert kinds[i : i + 3] == ["restore.begin", "reconcile", "restore.done"]

            # mkdir checkpoints/before/forks/NEW
            os.mkdir(before / "forks" / fork)
            assert fork in os.listdir(sessions)
            assert os.listdir(before / "forks") == [fork]
            fstatus = json.loads((sessions / fork / "status").read_text())
            assert fstatus["state"] == "running"
            assert fstatus["parent"]["checkpoint"] == "before"
            guest_writes(store, fork, 2)
            t = transcript(save(mnt, fork, "f1"))
            assert t[: len(at_cp)] == at_cp and len(t) > len(at_cp)

            # rmdir of a checkpoint of a live session
            os.rmdir(later)
            assert "later" not in os.listdir(sessions / agent / "checkpoints")
    finally:
        for s in (fork, agent):
            subprocess.run([sys.executable, "-m", "ksfs.cli", "--store", str(store), "session",
                            "rm", s], capture_output=True, cwd=ROOT)
            virsh("destroy", f"ksfs-{s}")
            virsh("undefine", f"ksfs-{s}")
    for s in (fork, agent):
        assert virsh("domstate", f"ksfs-{s}").returncode != 0
