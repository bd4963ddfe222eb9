"""The ``events`` file and ``resume`` answer are kept per lineage and caught up with the ledger:
always equal to a fresh rendering of the whole log, while reading only the events added since."""

from __future__ import annotations

import json
import threading

import pytest

from ksfs.keeper import Keeper


def fresh_events(k: Keeper, session: str) -> bytes:
    return b"".join((json.dumps(e.to_dict(), sort_keys=True) + "\n").encode()
                    for e in k.ledger.events(session))


def fresh_resume(k: Keeper, session: str) -> bytes:
    for e in reversed(list(k.ledger.events(session))):
        if e.type in ("restore.done", "restore.failed"):
            return f"{'ok' if e.type == 'restore.done' else 'failed'} ".encode()
        if e.type == "input.rejected" and e.body.get("file") == "resume":
            return b"rejected: "
    return b"none\n"


@pytest.fixture
def keeper(tmp_path):
    (tmp_path / "a").write_bytes(b"alpha")
    with Keeper(tmp_path / "store", create=True) as k:
        k.import_files("s", "c1", [tmp_path / "a"])
        yield k


def test_events_follow_the_log_reading_only_new_events(keeper, monkeypatch):
    asked = []
    real = keeper.ledger.lineage_events

    def spy(lineage, since=0, until=None):
        asked.append(since)
        return real(lineage, since, until)

    monkeypatch.setattr(keeper.ledger, "lineage_events", spy)

    def served() -> tuple[bytes, list[int]]:
        asked.clear()
        data = keeper.events_bytes("s")
        return data, list(asked)

    data, reads = served()
    assert (data, reads) == (fresh_events(keeper, "s"), [0])
    last = keeper.ledger.last_seq("s")
    data, reads = served()  # nothing new: nothing re-read
    assert (data, reads) == (fresh_events(keeper, "s"), [last + 1])
    keeper.ledger.record("s", "restore.done", {"checkpoint": "c1"})
    keeper.ledger.record("s", "input.rejected", {"file": "status", "why": "read-only"})
    data, reads = served()
    assert (data, reads) == (fresh_events(keeper, "s"), [last + 1])
    assert json.loads(data.splitlines()[-1])["seq"] == last + 2
    assert keeper.events_bytes("s", since=last + 2).count(b"\n") == 1


def test_resume_tells_the_last_restore_or_rejected_resume_write(keeper):
    assert keeper.resume_result("s") == b"none\n"
    keeper.ledger.record("s", "restore.failed", {"checkpoint": "c1", "reason": "gone"})
    seq = keeper.ledger.last_seq("s")
    assert keeper.resume_result("s") == f"failed c1 seq={seq}: gone\n".encode()
    keeper.ledger.record("s", "input.rejected", {"file": "status", "why": "read-only"})
    assert keeper.resume_result("s").startswith(fresh_resume(keeper, "s"))  # not about resume
    keeper.ledger.record("s", "input.rejected", {"file": "resume", "why": "no such checkpoint"})
    assert keeper.resume_result("s") == b"rejected: no such checkpoint\n"
    keeper.ledger.record("s", "restore.done", {"checkpoint": "c1"})
    seq = keeper.ledger.last_seq("s")
    assert keeper.resume_result("s") == f"ok c1 seq={seq}\n".encode()


def test_a_name_used_again_starts_from_its_new_lineage(keeper, tmp_path):
    keeper.ledger.record("s", "restore.done", {"checkpoint": "c1"})
    old = keeper.events_bytes("s")
    keeper.remove_session("s")
    keeper.import_files("s", "c9", [tmp_path / "a"])
    now = keeper.events_bytes("s")
    assert now == fresh_events(keeper, "s")
    assert now != old and b"c9" in now and b"restore.done" not in now
    assert keeper.resume_result("s") == b"none\n"


def test_readers_in_threads_while_events_are_added(keeper):
    stop = threading.Event()
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def reader():
        try:
            while not stop.is_set():
                seen.append(keeper.events_bytes("s"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for i in range(200):
        keeper.ledger.record("s", "input.rejected", {"file": "status", "why": f"try {i}"})
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    final = keeper.events_bytes("s")
    assert final == fresh_events(keeper, "s")
    seqs = [json.loads(line)["seq"] for line in final.splitlines()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gapless, nothing twice
    assert all(final.startswith(s) for s in seen)  # every snapshot a prefix of the log


def test_a_log_dropped_from_the_cache_is_read_again_whole(keeper, tmp_path, monkeypatch):
    from ksfs.keeper import views

    monkeypatch.setattr(views, "EVENT_LOGS_KEPT", 1)
    keeper.import_files("t", "c1", [tmp_path / "a"])
    first = keeper.events_bytes("s")
    assert keeper.events_bytes("t") == fresh_events(keeper, "t")  # pushes "s" out
    assert len(keeper._event_logs) == 1
    keeper.ledger.record("s", "restore.done", {"checkpoint": "c1"})
    again = keeper.events_bytes("s")
    assert again.startswith(first) and again == fresh_events(keeper, "s")
    assert keeper.resume_result("s").startswith(b"ok c1 ")


def test_a_failed_read_leaves_no_hole(keeper, monkeypatch):
    keeper.events_bytes("s")
    for i in range(3):
        keeper.ledger.record("s", "input.rejected", {"file": "status", "why": f"try {i}"})
    real = keeper.ledger.lineage_events

    def breaks_midway(lineage, since=0, until=None):
        events = real(lineage, since, until)
        yield next(events)
        raise OSError(5, "injected read failure")

    monkeypatch.setattr(keeper.ledger, "lineage_events", breaks_midway)
    with pytest.raises(OSError):
        keeper.events_bytes("s")
    monkeypatch.setattr(keeper.ledger, "lineage_events", real)
    assert keeper.events_bytes("s") == fresh_events(keeper, "s")


def test_status_of_a_session_removed_with_its_checkpoints_kept(keeper):
    assert keeper.status("s")["state"] == "offline"
    keeper.remove_session("s", keep_checkpoints=True)
    status = keeper.status("s")
    assert status["state"] == "removed" and status["last_checkpoint"] == "c1"


def test_resume_is_one_line_whatever_the_reason_holds(keeper):
    """A restore's failure reason comes from libvirt and QEMU, whose messages carry newlines
    (QEMU's stderr); reading ``resume`` is one line all the same, and the events file one
    line per event."""
    keeper.ledger.record("s", "restore.failed", {
        "checkpoint": "c1", "reason": "qemu unexpectedly closed the monitor:\r\nline two\n\n"})
    seq = keeper.ledger.last_seq("s")
    assert keeper.resume_result("s") == (
        f"failed c1 seq={seq}: qemu unexpectedly closed the monitor: line two\n".encode())
    keeper.ledger.record("s", "input.rejected", {"file": "resume", "why": "bad\nname\x00"})
    assert keeper.resume_result("s") == b"rejected: bad name\\x00\n"
    # a file name the OS gave back undecodable (surrogate escapes) made the whole view fail
    keeper.ledger.record("s", "restore.failed", {"checkpoint": "c1", "reason": "no /v/\udcff"})
    seq = keeper.ledger.last_seq("s")
    assert keeper.resume_result("s") == f"failed c1 seq={seq}: no /v/\\udcff\n".encode()
    assert keeper.events_bytes("s").count(b"\n") == keeper.ledger.last_seq("s") + 1
