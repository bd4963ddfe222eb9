"""Progress of long verbs: the terminal line, the reporting context, and the control socket's
progress lines (served by the real trio server over a real Unix socket; the verbs here are a
small keeper class whose save reports steps, so the wire is tested without a machine: the
machine verbs' own steps are tested in test_keeper_vm.py and test_mount_vm.py)."""

from __future__ import annotations

import io
import os
import random
import threading
import time
from pathlib import Path

import pytest
import trio

from ksfs import progress
from ksfs.cli.stepline import StepLine
from ksfs.daemon.client import call_daemon
from ksfs.daemon.protocol import RemoteError
from ksfs.daemon.server import serve_control
from ksfs.errors import NotFound
from tests.cli_helpers import ksfs, ksfs_on_terminal


def test_the_terminal_line_redraws_in_place_and_is_erased() -> None:
    out = io.StringIO()
    line = StepLine("save agent", out)
    line("taking the snapshot")
    line("storing the memory", 5 << 20, 20 << 20)
    line("storing the memory", 6 << 20, 20 << 20)  # same step within 0.1 s: not redrawn
    line("copying the machine's memory", 300 << 20, 256 << 20)  # counted past its total
    line.close()
    text = out.getvalue()
    drawn = [p for p in text.split("\r\x1b[K") if p]
    assert [d.rsplit("  ", 1)[0] for d in drawn] == [
        "save agent: taking the snapshot",
        "save agent: storing the memory 25% (5.0 of 20 MiB)",
        "save agent: copying the machine's memory 100% (256 of 256 MiB)",
    ]
    assert all(d.rsplit("  ", 1)[1].endswith("s") for d in drawn)
    assert text.endswith("\r\x1b[K")
    line.close()  # twice: nothing more
    assert out.getvalue() == text


def test_the_terminal_line_fits_the_terminal_width() -> None:
    """A line wider than the terminal wraps, and the next redraw's carriage return erases
    only its last row: the rows would stack up. The step's middle is cut, its bytes kept."""
    out = io.StringIO()
    line = StepLine("restore agent", out)
    line.width = lambda: 60  # type: ignore[method-assign]
    line("saving the current state first; writing the checkpoint's memory and disks",
         12 << 20, 30 << 20)
    drawn = out.getvalue().removeprefix("\r\x1b[K")
    assert len(drawn) == 59, drawn
    assert drawn.startswith("restore agent: saving") and "..." in drawn
    assert " 40% (12 of 30 MiB)  " in drawn
    short = io.StringIO()
    StepLine("save a", short)("taking the snapshot")
    assert "..." not in short.getvalue()


def test_two_parts_running_at_once_report_as_one_line() -> None:
    """QA (fourteenth session): a restore's save-first and the writing of its target each
    reported on their own, so the caller's line flipped between the two."""
    got: list[tuple] = []
    beside = progress.Beside(lambda *a: got.append(a))
    beside.second("writing the checkpoint", 1, 4)
    beside.first("saving the current state first")
    beside.first("storing the memory", 5, 10)  # its bytes are not shown beside the other's
    beside.second("writing the checkpoint", 2, 4)
    beside.done()
    beside.second("late", 9, 9)  # after done: ignored
    beside.first("publishing the checkpoint")
    assert got == [
        ("writing the checkpoint", 1, 4),
        ("saving the current state first; writing the checkpoint", 1, 4),
        ("storing the memory; writing the checkpoint", 1, 4),
        ("storing the memory; writing the checkpoint", 2, 4),
        ("storing the memory", 5, 10),
        ("storing the memory", 5, 10),
        ("publishing the checkpoint", None, None),
    ]


def test_two_parts_with_nobody_listening_report_nothing(caplog) -> None:
    """Review (fifteenth session): with no sink (recover's restore at a daemon's start), the
    parts' reports went back to the Beside through this thread's sink, without end (until
    a RecursionError, which report() swallows and logs)."""
    caplog.set_level("DEBUG", logger="ksfs.progress")
    beside = progress.Beside()
    assert beside.sink is None
    with progress.reporting(beside.second):
        progress.report("writing the checkpoint", 1, 4)
    with progress.reporting(beside.first):
        progress.report("saving the current state first")
    assert "progress sink failed" not in caplog.text


def test_the_terminal_line_draws_nothing_when_nothing_was_reported(monkeypatch) -> None:
    out = io.StringIO()
    StepLine("save agent", out).close()
    assert out.getvalue() == ""
    # off a terminal there is no line at all (scripts and CI logs get the report alone)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert StepLine.for_terminal("x") is None


def test_report_reaches_the_sink_of_its_own_context_only() -> None:
    got: list[tuple] = []
    progress.report("nobody listens")  # no sink: nothing happens
    with progress.reporting(lambda *a: got.append(a)):
        progress.report("one", 1, 2)
        other: list[tuple] = []

        def elsewhere() -> None:  # a thread of its own has no sink unless handed one
            progress.report("lost")
            with progress.reporting(lambda *a: other.append(a)):
                progress.report("theirs")

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    progress.report("after")
    assert got == [("one", 1, 2)]
    assert other == [("theirs", None, None)]


def test_a_failing_sink_never_fails_the_verb() -> None:
    def broken(*_a) -> None:
        raise OSError("the terminal went away")

    with progress.reporting(broken):
        progress.report("step")  # no exception
        progress.Steps("bytes", 10).add(5)


def test_steps_add_up_bytes_from_several_threads() -> None:
    got: list[tuple] = []
    lock = threading.Lock()

    def sink(*a) -> None:
        with lock:
            got.append(a)

    with progress.reporting(sink):
        steps = progress.Steps("writing", 4000)
    threads = [threading.Thread(target=lambda: [steps.add(1) for _ in range(1000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(d for _, d, _ in got) == 4000 and len(got) == 4000
    assert {(s, t) for s, _, t in got} == {("writing", 4000)}


class StepsKeeper:
    """The keeper methods the control socket calls, as far as this test needs them."""

    store_path = "/nonexistent"

    def settle_checkpoint_changes(self) -> None:  # no mount here to wait for
        pass

    def save(self, session: str, name: str | None = None) -> dict:
        if session == "missing":
            raise NotFound(what="session", name=session)
        progress.report("taking the snapshot")
        for i in range(1, 6):
            progress.report("storing the memory", i << 20, 5 << 20)
            time.sleep(0.12)  # slower than the daemon's rate limit: every step goes out
        progress.report("publishing the checkpoint")
        return {"session": session, "name": name or "c_0001"}


def serve_while(keeper: object, sock: Path, client) -> None:
    """Serve the control socket at ``sock`` with ``keeper`` while ``client()`` runs in a thread."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control, keeper, sock)
            await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_control_socket_sends_steps_then_the_reply(tmp_path: Path) -> None:
    results: dict[str, object] = {}

    def client() -> None:
        steps: list[tuple] = []
        results["reply"] = call_daemon(tmp_path, "save", progress=lambda *a: steps.append(a),
                                       session="s", name="n")
        results["steps"] = steps
        # a caller that does not ask for steps gets the reply alone
        results["plain"] = call_daemon(tmp_path, "save", session="s")
        try:
            call_daemon(tmp_path, "save", progress=steps.append, session="missing")
        except RemoteError as exc:
            results["error"] = exc

    serve_while(StepsKeeper(), tmp_path / "daemon.sock", client)
    assert results["reply"] == {"session": "s", "name": "n"}
    assert results["plain"] == {"session": "s", "name": "c_0001"}
    steps = results["steps"]
    assert steps[0] == ("taking the snapshot", None, None)
    assert steps[-1] == ("publishing the checkpoint", None, None)
    assert [d for s, d, _ in steps if s == "storing the memory"] == [i << 20 for i in range(1, 6)]
    assert results["error"].exit_code == NotFound.exit_code


@pytest.mark.parametrize("raw", [b"not json\n", b'{"verb": "save", "progress": 1}\n'])
def test_requests_without_a_true_progress_flag_get_no_steps(tmp_path: Path, raw: bytes) -> None:
    import socket

    sock_path = tmp_path / "daemon.sock"
    got: dict[str, bytes] = {}

    def client() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(sock_path))
        s.sendall(raw)
        data = b""
        while not data.endswith(b"\n"):
            data += s.recv(65536)
        got["data"] = data
        s.close()

    serve_while(StepsKeeper(), sock_path, client)
    assert got["data"].count(b"\n") == 1 and b'"progress"' not in got["data"]


def test_check_and_gc_show_their_steps_on_a_terminal(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for name, seed in (("a", 1), ("b", 2)):
        src = tmp_path / "memory"
        src.write_bytes(random.Random(seed).randbytes(40 << 20))
        ksfs(store, None, "import", "s", name, str(src))
    rc, out, terminal = ksfs_on_terminal(store, None, "check", "--read-data")
    assert rc == 0 and out.startswith("store clean"), (out, terminal)
    drawn = [p for p in terminal.split("\r\x1b[K") if p]
    assert drawn and all(d.startswith("check: reading and hashing every chunk ") for d in drawn)
    assert terminal.endswith("\r\x1b[K")
    ksfs(store, None, "rm", "s", "a")
    rc, out, terminal = ksfs_on_terminal(store, None, "gc")
    assert rc == 0 and out.startswith("gc: freed"), (out, terminal)
    assert "gc: marking the chunks live checkpoints use" in terminal
    assert "gc: sweeping what nothing uses" in terminal
    # piped: the report alone
    res = ksfs(store, None, "check", "--read-data")
    assert res.stderr == "" and res.stdout.startswith("store clean")
    # a terminal that cannot redraw a line (TERM=dumb, an Emacs shell) gets no escapes: QA,
    # thirty-fourth session, the import's bar hid and showed its cursor there
    dumb = dict(os.environ, TERM="dumb")
    for args in (("check", "--read-data"), ("import", "s", "c", str(tmp_path / "memory"))):
        rc, out, terminal = ksfs_on_terminal(store, dumb, *args)
        assert rc == 0 and "\x1b" not in terminal, (args, terminal)
    rc, out, terminal = ksfs_on_terminal(store, None, "import", "s", "d", str(tmp_path / "memory"))
    assert rc == 0 and "\x1b[?25l" in terminal  # (the same import draws its bar elsewhere)


@pytest.mark.parametrize("with_steps", [False, True])
def test_a_verb_finished_while_the_daemon_stops_still_answers(tmp_path: Path,
                                                              with_steps: bool) -> None:
    """QA (tenth session): `ksfs umount` during a restore served by the daemon made the
    restore's caller say "the daemon closed the control socket without answering" (exit 13)
    although the restore was done: the reply was sent in the cancelled scope."""
    sock = tmp_path / "daemon.sock"
    results: dict[str, object] = {}
    started = threading.Event()

    class SlowKeeper(StepsKeeper):
        def save(self, session: str, name: str | None = None) -> dict:
            started.set()
            time.sleep(1.0)
            progress.report("publishing the checkpoint")
            return {"session": session, "name": "done-anyway"}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control, SlowKeeper(), sock)

            def client() -> None:
                try:
                    results["reply"] = call_daemon(
                        tmp_path, "save", progress=(lambda *a: None) if with_steps else None,
                        session="s")
                except Exception as exc:  # noqa: BLE001 - the assertion below says what
                    results["error"] = exc

            nursery.start_soon(trio.to_thread.run_sync, client)
            await trio.to_thread.run_sync(started.wait)
            nursery.cancel_scope.cancel()  # the daemon stops while the verb runs

    trio.run(main)
    assert results.get("reply") == {"session": "s", "name": "done-anyway"}, results


class TypeErrorKeeper(StepsKeeper):
    store_path = Path("/nonexistent")

    def save(self, session: str, name: str | None = None) -> dict:
        return len(None) if session == "bug" else {"session": session}  # type: ignore[arg-type]


def test_a_type_error_inside_a_verb_is_no_bad_argument(tmp_path: Path) -> None:
    """QA (eleventh session): any TypeError was answered "bad arguments" (exit 2), so a bug
    inside a verb read as the caller's mistake, and a daemon older than the CLI said nothing
    of being older."""
    got: dict[str, RemoteError] = {}

    def client() -> None:
        for what, args in (("bug", {"session": "bug"}),
                           ("unknown", {"session": "s", "release": True})):
            try:
                call_daemon(tmp_path, "save", **args)
            except RemoteError as exc:
                got[what] = exc

    serve_while(TypeErrorKeeper(), tmp_path / "daemon.sock", client)
    assert got["bug"].exit_code == 1 and "internal error: TypeError" in str(got["bug"])
    assert got["unknown"].exit_code == 2
    assert "running daemon" in str(got["unknown"]) and "release" in str(got["unknown"])
