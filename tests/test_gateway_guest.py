"""End to end with a real guest: the guest calls the gateway through QEMU user networking; the
upstream answers slowly; a save is taken while the call is open; the session is restored to that
checkpoint; the guest's retry is served from the store; upstream was asked once for that call;
`usage` shows one paid call and one replay. Also: a fork's guest talks to its own session."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from tests.cli_helpers import alive, daemon_mount, guest_dir, ksfs
from tests.fake_provider import FakeProvider

pytestmark = pytest.mark.vm


def wait(pred, what: str, timeout: float = 120.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def calls_asked(up: FakeProvider, n: int) -> int:
    """How many times upstream was asked for the guest's call number n."""
    return sum(1 for r in up.requests
               if r.path.endswith("/chat/completions") and f"call {n}\"".encode() in r.body)


def calling_guest(base: Path) -> Path:
    """The test guest, calling the gateway every 4 steps: its guest directory under base."""
    spec = json.loads((guest_dir() / "guest.json").read_text())
    spec["cmdline"] += " ksfs.call_every=4"
    gdir = base / "guest"
    gdir.mkdir()
    (gdir / "guest.json").write_text(json.dumps(spec))
    return gdir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("gwguest")
    env = dict(os.environ, KSFS_GUEST=str(calling_guest(base)),
               KSFS_UPSTREAM_API_KEY="sk-test-SECRET-MARKER")
    up = FakeProvider(delay=5.0).start()
    try:
        with daemon_mount(base, env, "--upstream", up.url) as (store, mnt):
            yield {"store": store, "mnt": mnt, "env": env, "up": up, "tag": uuid.uuid4().hex[:6]}
    finally:
        up.stop()


def usage(mnt: Path, s: str) -> dict:
    return json.loads((mnt / "sessions" / s / "usage").read_text())


def test_call_open_during_save_is_replayed_after_restore(setup) -> None:
    mnt, up, store, env = setup["mnt"], setup["up"], setup["store"], setup["env"]
    s = f"gw-{setup['tag']}"
    sess = mnt / "sessions" / s
    # 8 s: the save below freezes the guest up to 3 s of live copy after the mkdir, and 4.5 s
    # after it under load; at 5 s the answer could come first, and nothing would be replayed.
    # (Under the 12 s the guest's wget waits, so its own retry never joins the purchase.)
    up.delay = 8.0
    os.mkdir(sess)
    # The guest's first call arrives upstream and stays open (the upstream is slow)...
    wait(lambda: calls_asked(up, 0) == 1, "the guest's first model call")
    # ...and a checkpoint is taken while it is open.
    os.mkdir(sess / "checkpoints" / "during-call")
    assert calls_asked(up, 0) == 1
    wait(lambda: usage(mnt, s)["paid_calls"] >= 1, "the first call to complete", timeout=60)
    # Back to the moment the call was open: the guest's retry must come from the store.
    (sess / "resume").write_text("during-call\n")
    wait(lambda: usage(mnt, s)["replays"] >= 1, "the guest's retry to be replayed", timeout=90)
    ksfs(store, env, "pause", s)
    u = usage(mnt, s)
    assert calls_asked(up, 0) == 1, "upstream was asked twice for one call"
    assert u["paid_calls"] == 1 and u["replays"] == 1, u
    events = [json.loads(x) for x in (sess / "events").read_text().splitlines()]
    paid = [e for e in events if e["type"] == "gateway.call"]
    replayed = [e for e in events if e["type"] == "gateway.replay"]
    assert paid[0]["body"]["key"] == replayed[0]["body"]["key"]
    # The API key went upstream only: never into events, the daemon log or the store's files.
    assert all(r.headers.get("authorization") == "Bearer sk-test-SECRET-MARKER"
               for r in up.requests)
    marker = b"SECRET-MARKER"
    assert marker not in (sess / "events").read_bytes()
    for p in Path(store).rglob("*"):
        if p.is_file() and p.stat().st_size < 256 << 20 and p.suffix != ".save":
            assert marker not in p.read_bytes(), p
    ksfs(store, env, "resume", s)
    up.delay = 5.0


def test_fork_guest_talks_to_its_own_session(setup) -> None:
    mnt = setup["mnt"]
    s = f"gp-{setup['tag']}"
    f = f"gf-{setup['tag']}"
    os.mkdir(mnt / "sessions" / s)
    wait(lambda: usage(mnt, s)["paid_calls"] >= 1, "the parent's first paid call", timeout=240)
    os.mkdir(mnt / "sessions" / s / "checkpoints" / "cp")
    os.mkdir(mnt / "sessions" / s / "checkpoints" / "cp" / "forks" / f)
    # The fork's guest goes on calling: its calls are counted in its own session.
    wait(lambda: usage(mnt, f)["paid_calls"] + usage(mnt, f)["replays"] >= 1,
         "a call from the fork's guest", timeout=240)
    # QA (fifteenth session): the tokens were on QEMU's command line (every local user reads
    # /proc/PID/cmdline) and in each checkpoint's domain.xml. Now QEMU reads them from files
    # only root can read, one per lineage; the calls above prove the guests got them.
    tokens_dir = Path(setup["store"]) / "guest-tokens"
    assert tokens_dir.stat().st_mode & 0o777 == 0o700
    files = {p.name: p for p in tokens_dir.iterdir()}
    lineages = {json.loads((mnt / "sessions" / x / "status").read_text())["lineage"]
                for x in (s, f)}
    assert lineages <= set(files), (lineages, files)
    tokens = {files[lin].read_bytes() for lin in lineages}
    assert all(len(t) == 32 for t in tokens) and len(tokens) == 2, tokens
    assert all(files[lin].stat().st_mode & 0o777 == 0o600 for lin in lineages)
    for x in (s, f):
        domain = json.loads((mnt / "sessions" / x / "status").read_text())["domain"]
        pids = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                and f"guest={domain},".encode() in _cmdline(p)]
        assert len(pids) == 1, (domain, pids)
        assert not any(t in _cmdline(pids[0]) for t in tokens)
    xml = (mnt / "sessions" / s / "checkpoints" / "cp" / "domain.xml").read_bytes()
    assert b"opt/ksfs/token" in xml and not any(t in xml for t in tokens)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_umount_stores_the_calls_in_flight_first(tmp_path_factory) -> None:
    """QA: `ksfs umount` cancelled the daemon's gateway with a purchase in flight: the provider
    answered (and billed) it, the guest's connection was dropped, the call recorded as
    gateway_stopped, and the guest's retry bought it again. Now the daemon stores it first."""
    base = tmp_path_factory.mktemp("gwdrain")
    env = dict(os.environ, KSFS_GUEST=str(calling_guest(base)))
    up = FakeProvider(delay=4.0).start()
    s = f"gd-{uuid.uuid4().hex[:6]}"
    try:
        with daemon_mount(base, env, "--upstream", up.url) as (store, mnt):
            os.mkdir(mnt / "sessions" / s)
            wait(lambda: calls_asked(up, 0) == 1, "the guest's first model call")
            res = ksfs(store, env, "umount", str(mnt))  # with the call still open upstream
            assert res.returncode == 0, res.stderr
            assert not os.path.ismount(mnt)
            events = [json.loads(x) for x in ksfs(store, env, "events", s, "--json")
                      .stdout.splitlines() if x]
            calls = [e["body"] for e in events if e["type"] == "gateway.call"]
            assert calls and calls[0]["stored"] is True and "error" not in calls[0], calls
    finally:
        up.stop()


def test_a_second_signal_stops_the_daemon_at_once_and_its_calls_are_recorded(
        tmp_path_factory) -> None:
    """QA F12, in the daemon: the first SIGTERM unmounts and waits for the purchases in flight;
    a second one found the default handler back and killed the daemon, its guests' answers cut
    off and the purchase left unrecorded until the next start. Now the second signal ends the
    waiting answers with the gateway's error and the daemon stops at once, recording the call
    it stopped under (gateway_stopped)."""
    import signal
    import subprocess

    from ksfs.daemon.client import daemon_pid

    base = tmp_path_factory.mktemp("gwsig")
    env = dict(os.environ, KSFS_GUEST=str(calling_guest(base)))
    up = FakeProvider(delay=120.0).start()  # the purchase outlives the drain's wait
    s = f"gs-{uuid.uuid4().hex[:6]}"
    mnt = base / "mnt"
    try:
        with daemon_mount(base, env, "--upstream", up.url) as (store, mnt):
            os.mkdir(mnt / "sessions" / s)
            wait(lambda: calls_asked(up, 0) == 1, "the guest's first model call")
            pid = daemon_pid(store)
            assert pid is not None
            os.kill(pid, signal.SIGTERM)
            log = store / "daemon.log"
            wait(lambda: b"waiting up to" in log.read_bytes(), "the daemon's drain", 30)
            begun = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            wait(lambda: not alive(pid), "the daemon's end", 20)
            assert time.monotonic() - begun < 10
            events = [json.loads(x) for x in ksfs(store, env, "events", s, "--json")
                      .stdout.splitlines() if x]
            calls = [e["body"] for e in events if e["type"] == "gateway.call"]
            assert calls and calls[0].get("error") == "gateway_stopped", calls
            assert b"again: stopping at once" in log.read_bytes()
    finally:
        up.stop()
        if os.path.ismount(mnt):  # the old code's daemon died with its mount in place
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
