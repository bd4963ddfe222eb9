"""Root running a verb on a store a user can write into, with whatever the user put at
STORE/daemon.sock (security QA F13): a server there that answers garbage, a list or a result of
another shape is a daemon error in one line (exit 13), never a traceback; a link there, or
anything but a socket, is damage (exit 6) and is not connected to. The store is left as it was.
A leftover socket nothing listens on is still no daemon: the verb runs here."""

from __future__ import annotations

import json
import os
import select
import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ksfs.daemon.protocol import unix_address
from tests.cli_helpers import KSFS

ENV = dict(os.environ, KSFS_GUEST="")


def ksfs(store: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True,
                          text=True, env=ENV, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    src = tmp_path / "notes.txt"
    src.write_text("notes\n")
    res = ksfs(store, "import", "s", "c1", str(src))
    assert res.returncode == 0, res.stderr
    return store


def checkpoints(store: Path) -> list:
    res = ksfs(store, "checkpoints", "s", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def one_line(res: subprocess.CompletedProcess, code: int, *said: str) -> None:
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ksfs: error: "), res.stderr
    for words in said:
        assert words in lines[0], res.stderr


class FakeDaemon:
    """A unix socket server at ``path`` (a thread) that reads one request line and writes
    ``answer`` back; ``None``: it hangs up without reading. ``requests`` holds what it got."""

    def __init__(self, path: Path, answer: bytes | None) -> None:
        self.path = path
        self.requests: list[bytes] = []
        fake = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                if answer is None:
                    # closed once the request came, unread: the caller's read is reset
                    select.select([self.request], [], [], 30)
                    self.request.close()
                    return
                fake.requests.append(self.rfile.readline())
                self.wfile.write(answer)

        with unix_address(path) as address:
            self.server = socketserver.UnixStreamServer(address, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def fake_daemon(store: Path) -> Iterator:
    made: list[FakeDaemon] = []

    def start(answer: bytes | None) -> FakeDaemon:
        made.append(FakeDaemon(store / "daemon.sock", answer))
        return made[-1]

    yield start
    for fake in made:
        fake.close()


SAVE = ("save", "s", "c2")


@pytest.mark.parametrize("answer, said", [
    (b"this is not json\n", "a line that is not JSON"),
    (b"\xff\xfe\n", "a line that is not JSON"),
    (b"[1,2]\n", "not an object"),
    (b'"ok"\n', "not an object"),
    (b'{"result": {}}\n', '"ok"'),
    (b'{"ok": "yes", "result": {}}\n', '"ok"'),
    (b'{"progress": 5}\n{"ok": true, "result": {}}\n', "progress"),
    (b'{"progress": {"step": "x", "done": "a lot", "total": 10}}\n{"ok": true, "result": {}}\n',
     "progress"),
    (b'{"ok": true, "result": {}, "warnings": 7}\n', "warnings"),
    (b'{"ok": false, "message": "fine", "exit_code": 0}\n', "exit code is 0"),
    (b'{"ok": false, "message": "x", "exit_code": "13"}\n', "exit code"),
    (b'{"ok": false, "message": "x", "exit_code": 130}\n', "exit code is 130"),
    (b'{"ok": false, "message": ["x"], "exit_code": 3}\n', "message"),
    (b'{"ok": false, "message": "x", "exit_code": 3, "errno": "ENOENT"}\n', "errno"),
])
def test_an_answer_not_in_the_protocol_is_a_daemon_error(store: Path, fake_daemon,
                                                          answer: bytes, said: str) -> None:
    before = checkpoints(store)
    fake = fake_daemon(answer)
    res = ksfs(store, *SAVE)
    one_line(res, 13, "daemon.sock", "no reply of a ksfs daemon", said)
    assert [json.loads(r)["verb"] for r in fake.requests] == ["save"]
    assert checkpoints(store) == before


def test_an_answer_that_never_ends_its_line_is_not_buffered_without_end(store: Path,
                                                                        fake_daemon) -> None:
    """A server that sends bytes and never a newline: the client gives up at MAX_LINE."""
    from ksfs.daemon.client import MAX_LINE

    before = checkpoints(store)
    fake_daemon(b"x" * (MAX_LINE + (1 << 20)))
    res = ksfs(store, *SAVE)
    one_line(res, 13, "no reply of a ksfs daemon", f"a line longer than {MAX_LINE >> 20} MiB")
    assert checkpoints(store) == before


NOT_A_DICT = ['"c1"', "[1, 2]", "null"]
WITHOUT_ITS_FIELDS = ["{}", '{"files": 3}']


@pytest.mark.parametrize("args, result", [
    *((SAVE, r) for r in NOT_A_DICT + WITHOUT_ITS_FIELDS),
    *((("status", "s"), r) for r in NOT_A_DICT + WITHOUT_ITS_FIELDS),
    *((args, r) for r in NOT_A_DICT
      for args in (("resume", "s"), ("restore", "s", "c1"), ("session", "rm", "s"))),
])
def test_a_result_of_another_shape_is_a_daemon_error(store: Path, fake_daemon,
                                                      args: tuple, result: str) -> None:
    """The QA's case: {"ok": true, "result": "c1"} to a save was a TypeError traceback; any
    result a command cannot read is said the same way (a command that reads no field of it,
    as rm, has nothing to misread)."""
    before = checkpoints(store)
    fake_daemon(f'{{"ok": true, "result": {result}}}\n'.encode())
    res = ksfs(store, *args)
    one_line(res, 13, "answered", "cannot read")
    assert checkpoints(store) == before


def test_a_daemon_that_hangs_up_is_a_daemon_error(store: Path, fake_daemon) -> None:
    """Hung up on with the request unread (as libvirtd did, sent JSON): ECONNRESET or EPIPE."""
    before = checkpoints(store)
    fake_daemon(None)
    res = ksfs(store, *SAVE)
    assert "Traceback" not in res.stderr and res.returncode == 13, res
    assert len(res.stderr.splitlines()) == 1 and "daemon" in res.stderr, res.stderr
    assert checkpoints(store) == before


def test_a_daemon_that_closes_without_answering_may_have_done_the_verb(store: Path,
                                                                        fake_daemon) -> None:
    """QA (thirty-fourth session): a daemon killed (-9) during a save had published the
    checkpoint, and the command said only that the daemon "closed the control socket without
    answering" (exit 13), as if nothing were done. A verb that changes something now says it
    may have been done; one that only reads does not."""
    fake_daemon(b"")  # the request read, then the connection closed with no reply
    res = ksfs(store, *SAVE)
    one_line(res, 13, "closed the control socket without answering when asked to save",
             "may have been done", "ksfs events")
    res = ksfs(store, "status", "s")
    one_line(res, 13, "closed the control socket without answering when asked to status")
    assert "may have been done" not in res.stderr


@pytest.fixture
def decoy(tmp_path: Path) -> Iterator[socket.socket]:
    """Another listening socket (libvirtd's, in the QA's case), outside the store."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(tmp_path / "decoy.sock") as address:
        sock.bind(address)
    sock.listen(8)
    yield sock
    sock.close()


def no_connection(decoy: socket.socket) -> None:
    # a connection made, even one closed since, waits in the backlog to be accepted
    decoy.setblocking(False)
    with pytest.raises(BlockingIOError):
        conn, _ = decoy.accept()
        conn.close()


@pytest.mark.parametrize("args", [SAVE, ("status", "s"), ("rm", "s", "c1")])
def test_a_link_to_another_socket_is_damage_and_not_connected_to(store: Path, tmp_path: Path,
                                                                 decoy: socket.socket,
                                                                 args: tuple) -> None:
    before = checkpoints(store)
    (store / "daemon.sock").symlink_to(tmp_path / "decoy.sock")
    res = ksfs(store, *args)
    one_line(res, 6, "daemon.sock is a symbolic link", "remove it")
    no_connection(decoy)
    assert checkpoints(store) == before


def plant(where: Path, kind: str) -> None:
    if kind == "dangling link":
        where.symlink_to(where.parent / "nothing-here")
    elif kind == "directory":
        where.mkdir()
    elif kind == "regular file":
        where.write_text("{}\n")
    else:
        os.mkfifo(where)


@pytest.mark.parametrize("kind, said", [("dangling link", "a symbolic link"),
                                        ("directory", "a directory"),
                                        ("regular file", "a regular file"),
                                        ("FIFO", "a FIFO")])
def test_anything_but_a_socket_is_damage(store: Path, kind: str, said: str) -> None:
    """A directory there said "[Errno 21] Is a directory" (exit 13); a dangling link went
    unsaid until the next mount failed on it."""
    before = checkpoints(store)
    plant(store / "daemon.sock", kind)
    res = ksfs(store, "status", "s")
    one_line(res, 6, f"daemon.sock is {said}", "remove it (ksfs makes it again)")
    assert checkpoints(store) == before


def test_a_leftover_socket_nothing_listens_on_is_no_daemon(store: Path) -> None:
    """Kept as it was (this passes on the old code too): a socket a daemon that died left
    behind is ignored, and the verb runs here."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(store / "daemon.sock") as address:
        sock.bind(address)
    sock.close()
    try:
        res = ksfs(store, "status", "s")
        assert res.returncode == 0 and res.stderr == "", res
        assert "last checkpoint  c1" in res.stdout, res.stdout
    finally:
        (store / "daemon.sock").unlink()


@pytest.mark.parametrize("shape", ["dangling link", "directory"])
def test_a_mount_clears_a_left_link_and_says_a_directory_is_damage(store: Path, tmp_path: Path,
                                                                   shape: str) -> None:
    """Security QA F19 (twenty-second session): `ksfs mount` with a dangling daemon.sock link
    failed "Address already in use", exit 13, with a traceback in daemon.log; with a
    directory there, "[Errno 21] Is a directory". A link (or a socket) a daemon before left
    is removed, only it and never what it names; anything else is damage, exit 6."""
    sock, mnt = store / "daemon.sock", tmp_path / "mnt"
    mnt.mkdir()
    if shape == "directory":
        sock.mkdir()
    else:
        sock.symlink_to(tmp_path / "nowhere")
    res = ksfs(store, "mount", str(mnt))
    try:
        if shape == "directory":
            one_line(res, 6, f"its control socket {sock} is a directory")
            assert not os.path.ismount(mnt) and sock.is_dir()
        else:
            assert res.returncode == 0, res
            assert not (tmp_path / "nowhere").exists() and sock.is_socket()
            from ksfs.daemon import client

            assert client.call_daemon(store, "ping") == "pong"  # it listens there
            assert [c["name"] for c in checkpoints(store)] == ["c1"]
    finally:
        if os.path.ismount(mnt):
            assert ksfs(store, "umount", str(mnt)).returncode == 0
