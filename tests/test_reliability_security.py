"""Security promises of issue 8 as tests.

- No name a user writes escapes the store or the mount: names are checked in one place
  (``ksfs.model.validate_name``); '../', absolute paths, NUL and over-long names are refused
  through the Python API, the CLI, the control socket and the mount, and nothing appears outside
  the store.
- The gateway listens on 127.0.0.1 only (its listening sockets, read from /proc).
- The upstream API key never reaches the store's files, the events or daemon.log.
- Files on the mount belong to the mounting user and the mount has default_permissions.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fake_provider import FakeProvider
from test_gateway_helpers import CHAT, MARKER_KEY, chat_body

from ksfs.errors import BadName, KsfsError
from ksfs.keeper import Keeper
from ksfs.model import NAME_MAX, validate_name

KSFS = [sys.executable, "-m", "ksfs.cli"]
BAD_NAMES = ["..", ".", "../x", "../../etc", "/etc", "/tmp/evil", "a/b", "x\0y", "",
             "x" * (NAME_MAX + 1), "é" * 128, "nl\nname"]


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "memory").write_bytes(os.urandom(100_000))
    with Keeper(tmp_path / "store", create=True) as k:
        k.import_files("s", "c1", [src / "memory"])
    return tmp_path / "store"


def test_validate_name_is_the_one_check(store: Path, tmp_path: Path) -> None:
    for bad in BAD_NAMES:
        with pytest.raises(BadName):
            validate_name(bad)
    assert validate_name("x" * NAME_MAX) == "x" * NAME_MAX
    before = tree(tmp_path)
    src = tmp_path / "src" / "memory"
    with Keeper(store) as k:
        for bad in BAD_NAMES:
            for fn, args in ((k.import_files, (bad, "c9", [src])),
                             (k.import_files, ("s", bad, [src])),
                             (k.delete_checkpoint, (bad, "c1")),
                             (k.delete_checkpoint, ("s", bad)),
                             (k.save, (bad,)),
                             (k.restore, ("s", bad)),
                             (k.fork, ("s", "c1", bad))):
                with pytest.raises(KsfsError) as exc:
                    fn(*args)
                assert exc.value.exit_code in (2, 3), (bad, exc.value)
        assert sorted(k.ledger.checkpoint_names("s")) == ["c1"]
        assert [s.name for s in k.ledger.sessions()] == ["s"]
    assert tree(tmp_path) == before


def test_cli_refuses_escaping_and_long_names(store: Path, tmp_path: Path) -> None:
    before = tree(tmp_path)
    src = str(tmp_path / "src" / "memory")
    for bad in ("../../escape", "/tmp/abs", "a/b", "x" * 300, ".."):
        for args in (["import", bad, "c2", src], ["import", "s", bad, src],
                     ["rm", "s", bad], ["cat", bad, "c1", "memory"], ["fork", "s", "c1", bad]):
            res = subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True,
                                 text=True)
            assert res.returncode in (2, 3), (args, res.returncode, res.stderr)
            assert len(res.stderr.splitlines()) == 1 and "ksfs: error:" in res.stderr
    assert tree(tmp_path) == before


def test_mount_and_control_socket(store: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, KSFS_UPSTREAM_API_KEY=MARKER_KEY)
    res = subprocess.run(KSFS + ["--store", str(store), "mount", str(mnt)], capture_output=True,
                         text=True, env=env, timeout=120)
    if res.returncode != 0 and "fuse" in res.stderr.lower():
        pytest.skip(res.stderr)
    assert res.returncode == 0, res.stderr
    try:
        before = tree(tmp_path / "src") | tree(store / "vm") if (store / "vm").exists() \
            else tree(tmp_path / "src")
        # The mount: default_permissions, owned by the mounting user.
        opts = next(line.split()[3] for line in open("/proc/mounts")
                    if line.split()[1] == str(mnt))
        assert "default_permissions" in opts.split(","), opts
        for p in [mnt, mnt / "sessions", mnt / "sessions" / "s",
                  mnt / "sessions" / "s" / "checkpoints" / "c1" / "memory"]:
            st = p.stat()
            assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), p
        # Names that try to climb out, through the mount.
        for bad in ("..", "x" * 256, "a\\b/../c"):
            for target in (mnt / "sessions", mnt / "sessions" / "s" / "checkpoints"):
                with pytest.raises(OSError) as exc:
                    os.mkdir(os.path.join(target, bad))
                assert exc.value.errno in (errno.EINVAL, errno.ENAMETOOLONG, errno.EEXIST,
                                           errno.ENOENT, errno.EPERM), (bad, exc.value)
        # ... and through the control socket, as any local client could send them.
        sock_path = store / "daemon.sock"
        assert sock_path.exists()
        for verb, args in (("import", {"session": "../../x", "checkpoint": "c",
                                       "files": ["/etc/hostname"]}),
                           ("import", {"session": "s", "checkpoint": "/abs",
                                       "files": ["/etc/hostname"]}),
                           ("rm", {"session": "s", "checkpoint": "../c1"}),
                           ("save", {"session": "x" * 300}),
                           ("fork", {"session": "s", "checkpoint": "c1", "new": "../y"}),
                           ("session_new", {"name": "a\0b"})):
            reply = raw_call(sock_path, {"verb": verb, "args": args})
            assert reply["ok"] is False and reply.get("exit_code") == 2, (verb, reply)
        assert tree(tmp_path / "src") | (tree(store / "vm") if (store / "vm").exists()
                                         else set()) == before
        with Keeper(store) as k:
            assert [s.name for s in k.ledger.sessions()] == ["s"]
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        for _ in range(100):
            if not os.path.ismount(mnt):
                break
            time.sleep(0.1)
    assert not os.path.ismount(mnt)
    # The key was in the daemon's environment: it must not be in its log or the store.
    assert_no_marker(store)


def raw_call(path: Path, request: dict) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    try:
        s.connect(str(path))
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            part = s.recv(65536)
            if not part:
                break
            buf += part
    finally:
        s.close()
    return json.loads(buf)


def assert_no_marker(store: Path) -> None:
    marker = MARKER_KEY.encode()
    for p in store.rglob("*"):
        if p.is_file() and not p.is_socket():
            assert marker not in p.read_bytes(), f"the API key is in {p}"
    with Keeper(store) as k:
        for s in k.ledger.sessions(include_removed=True):
            for ev in k.ledger.events(s.name):
                assert MARKER_KEY not in json.dumps(ev.to_dict()), ev


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    out.append(cols[1])
    return out


def test_gateway_binds_loopback_and_keeps_the_key_secret(tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = dict(os.environ, KSFS_UPSTREAM_API_KEY=MARKER_KEY)
    env.pop("OPENAI_API_KEY", None)
    with FakeProvider() as provider:
        proc = subprocess.Popen(
            KSFS + ["--store", str(store), "gateway", "serve", "--upstream", provider.url,
                    "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 30
            line = ""
            while not line and time.monotonic() < deadline:
                if select.select([proc.stdout], [], [], 0.2)[0]:
                    line = proc.stdout.readline()
                assert proc.poll() is None, proc.stderr.read()
            port = int(line.split("127.0.0.1:")[1].split()[0])
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False,
                              timeout=30) as c:
                r = c.post(CHAT, json=chat_body("secret test"),
                           headers={"authorization": "Bearer guest"})
                assert r.status_code == 200, r.text
            addrs = listening_addresses(proc.pid)
            assert addrs, "the gateway listens on nothing"
            # 0100007F:PORT is 127.0.0.1 in /proc/net/tcp; tcp6 loopback is ::1.
            loopback = ("0100007F:", "00000000000000000000000001000000:")
            assert all(a.startswith(loopback) for a in addrs), addrs
            assert any(a.endswith(f":{port:04X}") for a in addrs), (addrs, port)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
        assert MARKER_KEY not in out + err
        assert provider.requests, "the call never reached the upstream"
    assert_no_marker(store)
