"""kill -9 at random moments of processes appending events and publishing checkpoints.

Two writer processes share one session (LMDB serialises their write transactions); one of them
also takes checkpoints through the real flow (ingest, then record + manifests + events in one
transaction). After each kill the ledger must verify clean: no torn event, no gap, no
checkpoint record without its manifests, and everything a writer reported committed is there.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_ledger_helpers import cas_available, open_store

from ksfs.ledger import Ledger

TESTS = Path(__file__).resolve().parent

WRITER = r"""
import random, sys
from test_ledger_helpers import open_store, take_checkpoint
from ksfs.errors import AlreadyExists
from ksfs.ledger import Ledger

path, session, seed, checkpoints = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
rnd = random.Random(seed)
store = open_store(path)
led = Ledger(store)
try:
    with store.env.begin(write=True) as t:
        led.create_session(t, session)
except AlreadyExists:
    pass
print("ready", flush=True)
i = 0
while True:
    r = rnd.random()
    if checkpoints and r < 0.25:
        files = {"disk.raw": rnd.randbytes(rnd.randint(1, 150_000)), "memory": rnd.randbytes(3000)}
        cp = take_checkpoint(led, store, session, files, transcript_seq=i)
        print("cp", cp.name, cp.seq, flush=True)
    elif r < 0.4:
        with store.env.begin(write=True) as t:
            for _ in range(rnd.randint(2, 20)):
                ev = led.append(t, session, "gateway.call",
                                {"key": f"{seed}-{i}", "pad": "x" * rnd.randint(0, 3000)})
        print("ev", ev.seq, ev.type, flush=True)
    else:
        ev = led.record(session, rnd.choice(["pause", "resume", "recover"]), {"i": i})
        print("ev", ev.seq, ev.type, flush=True)
    i += 1
"""


def _spawn(store_path, seed, checkpoints, out, crash_at=None):
    env = dict(os.environ, PYTHONPATH=str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KSFS_CRASH_AT", None)
    if crash_at:
        env["KSFS_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store_path), "crashy", str(seed),
         "1" if checkpoints else "0"],
        stdout=out, stderr=subprocess.PIPE, env=env,
    )


def _wait_ready(path: Path, procs, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.startswith("ready") or any(p.poll() is not None for p in procs):
            return
        time.sleep(0.01)
    raise AssertionError("writer never became ready")


def _reported(path: Path) -> tuple[dict[int, str], dict[str, int]]:
    events: dict[int, str] = {}
    cps: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        # a line cut by the kill has no newline yet and may be partial: only whole lines count
        if parts[:1] == ["ev"] and len(parts) == 3:
            events[int(parts[1])] = parts[2]
        elif parts[:1] == ["cp"] and len(parts) == 3:
            cps[parts[1]] = int(parts[2])
    return events, cps


def _check(store_path: Path, logs: list[Path]) -> tuple[int, int]:
    store = open_store(store_path)
    try:
        led = Ledger(store)
        assert led.verify() == []
        if "crashy" not in {s.name for s in led.sessions()}:
            return 0, 0  # killed inside the very first transaction: nothing was committed
        events = list(led.events("crashy"))
        assert [e.seq for e in events] == list(range(len(events)))
        by_seq = {e.seq: e.type for e in events}
        for log in logs:
            reported_events, reported_cps = _reported(log)
            for seq, type_ in reported_events.items():
                assert by_seq.get(seq) == type_, f"committed event {seq} lost or changed"
            for name, seq in reported_cps.items():
                cp = led.checkpoint("crashy", name)
                assert cp.seq == seq
        cps = led.checkpoints("crashy")
        for cp in cps:
            for f in cp.files:
                assert store.has_manifest(f.manifest)
            if cas_available():  # the bytes behind a surviving record read back whole
                for f in cp.files:
                    assert store.open_file(f.manifest).size == f.size
        return len(events), len(cps)
    finally:
        store.close()


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
        p.stderr.close()


def test_kill9_at_random_moments_leaves_a_clean_ledger(tmp_path):
    rnd = random.Random(int(os.environ.get("KSFS_TEST_SEED", "0")) or None)
    store_path = tmp_path / "store"
    open_store(store_path).close()
    total_events = total_cps = 0
    for trial in range(12):
        logs = [tmp_path / f"t{trial}-{w}.out" for w in range(2)]
        outs = [log.open("w") for log in logs]
        procs = [_spawn(store_path, trial * 10 + w, w == 0, outs[w]) for w in range(2)]
        try:
            _wait_ready(logs[0], procs)
            time.sleep(rnd.uniform(0.02, 0.6))
        finally:
            _kill(procs)
            for o in outs:
                o.close()
        for p in procs:
            assert p.returncode == -signal.SIGKILL, "a writer died before the kill"
        total_events, total_cps = _check(store_path, logs)
    print(f"kill -9 trials: 12, surviving log {total_events} events, {total_cps} checkpoints")
    assert total_events > 50 and total_cps > 3  # the trials did real work


@pytest.mark.parametrize("nth", [1, 3, 7, 15, 30])
def test_crash_inside_append_loses_only_the_open_transaction(tmp_path, nth):
    store_path = tmp_path / "store"
    open_store(store_path).close()
    log = tmp_path / "w.out"
    with log.open("w") as out:
        proc = _spawn(store_path, nth, True, out, crash_at=f"event.append:{nth}")
        try:
            proc.wait(timeout=60)
        finally:
            _kill([proc])
    assert proc.returncode == -signal.SIGKILL
    events, _ = _check(store_path, [log])
    reported, _ = _reported(log)
    # the append that hit the crash point never committed: the log ends before it
    assert events <= nth - 1
    assert max(reported, default=-1) < events
