#!/usr/bin/env python3
"""The ksfs demo, end to end, through the mount alone (run by tools/demo after set-up).

Mounts a fresh store, creates a session running the agent-like guest with `mkdir`, takes
checkpoints with `mkdir`, forks one with `mkdir forks/`, restores one with `echo > resume`, shows
the tree with `ls` and a `cmp` between two checkpoints, prints the store figures and the dedup
ratio, then cleans up (sessions removed, domains gone, unmounted, its directory under /var/tmp
removed; `--keep` stops the machines but keeps the store and its checkpoints there to look at).
Prints where time goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KSFS = [str(ROOT / ".venv/bin/ksfs")]
WORK = Path(os.environ.get("KSFS_DEMO_DIR", "/var/tmp/ksfs-demo"))
GUEST = Path(os.environ.get("KSFS_GUEST", "/var/cache/ksfs/guest"))
T0 = time.monotonic()


def step(text: str) -> None:
    print(f"\n[{time.monotonic() - T0:6.1f}s] == {text}", flush=True)


def sh(cmd: str) -> str:
    """Run a shell command as a user would type it, echo it and its output."""
    print(f"$ {cmd}", flush=True)
    res = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=WORK)
    out = (res.stdout + res.stderr).rstrip()
    if out:
        print(out, flush=True)
    if res.returncode not in (0, 1) or (res.returncode == 1 and not cmd.startswith("cmp")):
        raise SystemExit(f"demo: `{cmd}` failed with exit code {res.returncode}")
    return res.stdout


def ksfs(*args: str) -> str:
    env = dict(os.environ, KSFS_STORE=str(WORK / "store"))
    res = subprocess.run(KSFS + list(args), capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"demo: ksfs {' '.join(args)} failed: {res.stderr.strip()}")
    return res.stdout


def main() -> int:
    if WORK.exists():
        if not cleanup(WORK / "mnt"):
            raise SystemExit(f"demo: {WORK} holds a demo that cannot be cleaned up (above); "
                             "remove its sessions, then run again")
        shutil.rmtree(WORK)
    mnt = WORK / "mnt"
    mnt.mkdir(parents=True)
    os.environ["KSFS_STORE"] = str(WORK / "store")
    os.environ["KSFS_GUEST"] = str(GUEST)
    try:
        step("mount a fresh store")
        print(ksfs("mount", str(mnt)).strip())

        step("mkdir sessions/agent: a new session running the agent-like guest")
        sh("mkdir mnt/sessions/agent")
        sh("cat mnt/sessions/agent/status")
        # The guest boots (TCG) and its agent starts writing its transcript: waited for, not
        # slept on (QA: on a loaded machine a fixed 10 s gave checkpoints of an agent that
        # had not started, and cmp found nothing to compare).
        at = wait_for_agent("agent", 3)

        step("mkdir checkpoints/first, let the agent work, mkdir checkpoints/second")
        t = time.monotonic()
        sh("mkdir mnt/sessions/agent/checkpoints/first")
        print(f"(checkpoint published in {time.monotonic() - t:.2f}s)")
        wait_for_agent("agent", at + 10)
        t = time.monotonic()
        sh("mkdir mnt/sessions/agent/checkpoints/second")
        print(f"(checkpoint published in {time.monotonic() - t:.2f}s)")

        step("the tree, and cmp between two checkpoints")
        sh("ls -l mnt/sessions/agent/checkpoints/first mnt/sessions/agent/checkpoints/second")
        sh("cat mnt/sessions/agent/checkpoints/second/meta.json")
        sh("cmp mnt/sessions/agent/checkpoints/first/disk.raw "
           "mnt/sessions/agent/checkpoints/second/disk.raw")
        sh("tail -n 3 mnt/sessions/agent/checkpoints/second/transcript")

        step("mkdir forks/branch under checkpoint first: a new session from that moment")
        t = time.monotonic()
        sh("mkdir mnt/sessions/agent/checkpoints/first/forks/branch")
        print(f"(fork running in {time.monotonic() - t:.2f}s)")
        sh("ls mnt/sessions")
        sh("cat mnt/sessions/branch/status")

        step("echo first > resume: restore the agent to checkpoint first")
        t = time.monotonic()
        sh("echo first > mnt/sessions/agent/resume")
        print(f"(restored in {time.monotonic() - t:.2f}s)")
        sh("cat mnt/sessions/agent/resume")
        sh("grep -E '\"(restore|reconcile)' mnt/sessions/agent/events | tail -n 3")

        step("the store figures and the dedup ratio")
        sh("cat mnt/store")
        figures = json.loads((mnt / "store").read_text())
        print(f"dedup ratio: {figures['logical_bytes']} logical bytes stored in "
              f"{figures['stored_bytes']} bytes = {figures['dedup_ratio']}x")
    finally:
        keep = "--keep" in sys.argv[1:]
        step("clean up: " + ("stop the machines, keep the checkpoints, unmount" if keep else
                             f"remove the sessions, unmount, remove {WORK}"))
        clean = cleanup(mnt, keep_checkpoints=keep)
        if keep or not clean:
            # Never removed under sessions still there: their machines would run on deleted
            # disks, and the next run's clean-up could not find them.
            print(f"(the store is kept at {WORK / 'store'}: ksfs --store {WORK / 'store'} "
                  f"checkpoints agent, ksfs --store {WORK / 'store'} mount DIR, ...)")
        else:
            shutil.rmtree(WORK, ignore_errors=True)
    print(f"\ndemo finished in {time.monotonic() - T0:.1f}s")
    return 0


def wait_for_agent(session: str, lines: int, timeout: float = 180) -> int:
    """Wait until the session's agent has written ``lines`` transcript lines, as the test
    guest says on its serial console ("ksfs-counter N"); returns the count then. A guest
    that says nothing there is given ``timeout`` seconds and the demo goes on."""
    console = WORK / "store" / "vm" / session / "console.log"
    deadline = time.monotonic() + timeout
    count = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            found = re.findall(rb"ksfs-counter (\d+)", console.read_bytes())
            count = int(found[-1]) if found else 0  # seq of its last line, from 1
        if count >= lines:
            print(f"(the agent has written {count} transcript lines)")
            return count
        time.sleep(0.5)
    print(f"(the agent wrote {count} transcript lines in {timeout:.0f}s; going on)")
    return count


def cleanup(mnt: Path, keep_checkpoints: bool = False) -> bool:
    """Remove the demo's sessions (and so their machines; with ``keep_checkpoints`` their
    checkpoints stay, to look at) and unmount; True when all went."""
    env = dict(os.environ, KSFS_STORE=str(WORK / "store"))
    clean = True
    if (WORK / "store").exists():
        listing = subprocess.run(KSFS + ["session", "list", "--json"], capture_output=True,
                                 text=True, env=env)
        if listing.returncode != 0:
            print(f"demo: cannot list the sessions: {listing.stderr.strip()}", file=sys.stderr)
            clean = False
        for sess in json.loads(listing.stdout or "[]") if listing.returncode == 0 else []:
            rm = subprocess.run(KSFS + ["session", "rm", sess["session"],
                                        *(["--keep-checkpoints"] if keep_checkpoints else [])],
                                env=env, capture_output=True, text=True)
            if rm.returncode != 0:
                print(f"demo: {rm.stderr.strip()}", file=sys.stderr)
                clean = False
    if os.path.ismount(mnt):
        subprocess.run(KSFS + ["umount", str(mnt)], env=env)
    return clean and not os.path.ismount(mnt)


if __name__ == "__main__":
    sys.exit(main())
