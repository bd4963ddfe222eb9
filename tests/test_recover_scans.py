"""Recover's reading of long logs (no machine needed): what it looks for in a session's log is
found without decoding the log, and a removal cut short is finished or abandoned by what came
after it (the rule tests/test_recover_intents.py checks against a real guest)."""

from __future__ import annotations

from pathlib import Path

import pytest

import ksfs.ledger.ledger as ledger_module
from ksfs.keeper import Keeper

CALLS = 3000


@pytest.fixture
def keeper(tmp_path: Path):
    with Keeper(tmp_path / "store", create=True) as k:
        yield k


def model_calls(k: Keeper, session: str, n: int = CALLS) -> None:
    with k.store.env.begin(write=True) as txn:
        for i in range(n):
            k.ledger.append(txn, session, "gateway.call",
                            {"key": f"k{i}", "model": "m", "status": 200, "type": "pause"})


@pytest.fixture
def decodes(monkeypatch):
    """How many events the ledger decodes (its one decoder, counted)."""
    count = [0]
    real = ledger_module.decode_event

    def counting(seq, raw):
        count[0] += 1
        return real(seq, raw)

    monkeypatch.setattr(ledger_module, "decode_event", counting)
    return count


def test_recover_finds_what_it_needs_in_a_long_log_without_decoding_it(keeper: Keeper,
                                                                        decodes) -> None:
    """QA 12: with 300k events recover took 4.5 s for one session: four scans of the whole
    log (_removal_begun, _unfinished, _paused_by_user, _unreconciled_fork), each decoding every
    event. Now each decodes only the events of the types it looks for."""
    k = keeper
    with k.store.env.begin(write=True) as txn:
        k.ledger.create_session(txn, "long")
    k.ledger.record("long", "pause", {})
    k.ledger.record("long", "checkpoint.begin", {"name": None})
    model_calls(k, "long")
    decodes[0] = 0
    assert k._removal_begun("long") is None
    assert [ev.type for ev in k._unfinished("long")] == ["checkpoint.begin"]
    assert k._paused_by_user("long") is True
    assert decodes[0] < 10, decodes[0]
    decodes[0] = 0
    report = k.recover()
    assert report == [{"session": "long", "failed": False,
                       "actions": ["checkpoint c_0002 begun at seq 2 marked failed"]}]
    assert decodes[0] < 20, decodes[0]


def test_a_removal_cut_short_is_finished_only_with_nothing_of_the_user_after_it(
        keeper: Keeper) -> None:
    k = keeper
    with k.store.env.begin(write=True) as txn:
        for name in ("a", "b", "c"):
            k.ledger.create_session(txn, name)
    # a: removing, then a model call the guest made: still to be finished
    k.ledger.record("a", "session.removing", {"keep_checkpoints": False})
    model_calls(k, "a", 600)
    begun = k._removal_begun("a")
    assert begun is not None and begun.seq == 1 and k._removal_abandoned("a") is None
    # b: removing, then a save: abandoned, and once said so, neither
    k.ledger.record("b", "session.removing", {"keep_checkpoints": False})
    model_calls(k, "b", 600)
    save = k.ledger.record("b", "checkpoint.begin", {"name": "work"})
    model_calls(k, "b", 600)
    assert k._removal_begun("b") is None
    removing, used = k._removal_abandoned("b")
    assert (removing.seq, used.seq) == (1, save.seq)
    # c: a release cut short is finished whatever came after
    k.ledger.record("c", "session.removing", {"keep_checkpoints": False, "release": {}})
    k.ledger.record("c", "resume", {})
    assert k._removal_begun("c").seq == 1 and k._removal_abandoned("c") is None
    report = {r["session"]: r for r in k.recover()}
    # (offline sessions: a and c have no machine to destroy; their removal is finished)
    assert report["a"]["actions"] == ["removal begun at seq 1 finished"]
    assert report["c"]["actions"] == ["removal begun at seq 1 finished (machine released)"]
    assert report["b"]["actions"][0] == (
        f"removal begun at seq 1 not finished: the session was used after it "
        f"(checkpoint.begin at seq {save.seq}); removal abandoned")
    assert {s.name for s in k.ledger.sessions()} == {"b"}
    last = list(k.ledger.events_backward("b", types={"session.remove_failed"}))[0]
    assert last.body["reason"].startswith("abandoned:") and last.body["removing_seq"] == 1
    assert k._removal_begun("b") is None and k._removal_abandoned("b") is None
    # a restore's own resume of a machine the user had paused is no going on
    k.ledger.record("b", "session.removing", {"keep_checkpoints": False})
    k.ledger.record("b", "resume", {"domain": "x", "reason": "restore to c1"})
    assert k._removal_begun("b") is not None


def test_a_session_removed_while_recover_waits_for_its_lock_is_passed_over(
        keeper: Keeper, monkeypatch) -> None:
    """Review: recover listed the sessions once and mended each by that record once it held
    its lock: a session rm that finished meanwhile made it 'could not recover: no session
    named b' (failed, exit 10), and a session made again under the name would have been
    mended by the old one's record."""
    import contextlib

    import ksfs.keeper.recovery as recovery

    k = keeper
    with k.store.env.begin(write=True) as txn:
        for name in ("a", "b"):
            k.ledger.create_session(txn, name)
    for name in ("a", "b"):
        k.ledger.record(name, "checkpoint.begin", {"name": None})  # something to mend
    real = recovery.session_lock

    @contextlib.contextmanager
    def rm_first(store_path, name):
        if name == "b":  # another process's session rm, done while recover waited
            k.remove_session("b")
        with real(store_path, name) as held:
            yield held

    monkeypatch.setattr(recovery, "session_lock", rm_first)
    report = k.recover()
    assert [(r["session"], r["failed"]) for r in report] == [("a", False)], report
