"""The mount's notifies to forget names, and the control socket waiting for them.

A verb asked for through the daemon's control socket (`ksfs rm`) answers only once the kernel
has dropped the names it changed: pyfuse3's async notify gave no way to wait, and an `ls` right
after the answer could still show the deleted name (a CI run of the thirty-first session). The
mount itself is exercised by tests/test_mount_daemon_names.py; here the pieces, with the kernel's
notify replaced by a recorder that can be held back.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ksfs.fuse import forgetting
from ksfs.fuse.forgetting import NameForgetter
from ksfs.keeper.views import Views
from tests.test_progress import StepsKeeper, serve_while


class HeldNotifies:
    """Stands for pyfuse3.invalidate_entry: records each call once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.made: list[tuple[int, bytes]] = []

    def __call__(self, parent: int, name: bytes) -> None:
        self.release.wait(10)
        if name == b"gone":
            raise FileNotFoundError(2, "not cached")
        self.made.append((parent, name))


@pytest.fixture
def notifies(monkeypatch) -> HeldNotifies:
    held = HeldNotifies()
    monkeypatch.setattr(forgetting.pyfuse3, "invalidate_entry", held)
    return held


def test_forget_returns_at_once_and_settle_waits_for_the_notifies(notifies) -> None:
    forgetter = NameForgetter()
    try:
        t = time.monotonic()
        forgetter.forget(5, b"c1")
        forgetter.forget(5, b"gone")  # not cached: the kernel says ENOENT, nothing to drop
        forgetter.forget(7, b"s")
        assert time.monotonic() - t < 0.5
        assert not forgetter.settle(timeout=0.2)  # held back: not done, and says so
        assert notifies.made == []
        threading.Timer(0.2, notifies.release.set).start()
        assert forgetter.settle(timeout=5)
        assert notifies.made == [(5, b"c1"), (7, b"s")]  # in the order asked
    finally:
        notifies.release.set()
        forgetter.close()
    assert not forgetter._thread.is_alive()


def test_a_keeper_settles_its_listeners_and_stops_them(notifies) -> None:
    views = Views.__new__(Views)  # only the listener lists: no store behind it
    views._checkpoint_listeners, views._checkpoint_settlers = [], []
    forgetter = NameForgetter()
    told: list[tuple[str, str | None]] = []
    stop = views.on_checkpoint_change(
        lambda s, c: (told.append((s, c)), forgetter.forget(1, c.encode())),
        settle=forgetter.settle)
    try:
        views.checkpoint_changed("s", "c1")
        threading.Timer(0.2, notifies.release.set).start()
        views.settle_checkpoint_changes()
        assert told == [("s", "c1")] and notifies.made == [(1, b"c1")]
        stop()
        views.checkpoint_changed("s", "c2")
        views.settle_checkpoint_changes()
        assert told == [("s", "c1")]
    finally:
        notifies.release.set()
        forgetter.close()


def test_the_control_socket_answers_after_the_keeper_settles(tmp_path: Path) -> None:
    order: list[str] = []

    class SettlingKeeper(StepsKeeper):
        def save(self, session: str, name: str | None = None) -> dict:
            order.append("verb")
            return {"session": session, "name": name or "c_0001"}

        def settle_checkpoint_changes(self) -> None:
            time.sleep(0.3)  # a notify the kernel holds a moment
            order.append("settled")

    replies: list[object] = []

    def client() -> None:
        from ksfs.daemon.client import call_daemon

        replies.append(call_daemon(tmp_path, "save", session="s"))
        order.append("answered")

    sock = tmp_path / "daemon.sock"
    serve_while(SettlingKeeper(), sock, client)
    assert replies == [{"session": "s", "name": "c_0001"}]
    assert order == ["verb", "settled", "answered"]
