"""The ledger on a real store: sessions, gapless events, checkpoint records, forks, verify."""

from __future__ import annotations

import threading

import pytest
from test_ledger_helpers import open_store, take_checkpoint

from ksfs.errors import (
    AlreadyExists,
    BadInput,
    BadName,
    IntegrityError,
    ManifestCorrupt,
    NoSuchCheckpoint,
    NoSuchSession,
    ReadOnly,
)
from ksfs.ledger import BODY_MAX, Ledger
from ksfs.ledger import keys as K
from ksfs.model import CheckpointRecord, FileRecord, ForkPoint


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def ledger(store):
    led = Ledger(store)
    yield led
    assert led.verify() == []  # every test ends with a clean ledger, as S3QL ends with fsck


def new_session(ledger, name, **kw):
    with ledger.env.begin(write=True) as txn:
        return ledger.create_session(txn, name, **kw)


def test_create_session_writes_event_zero(ledger):
    rec = new_session(ledger, "s1", domain="dom1", config={"budget": 3})
    assert rec.name == "s1" and rec.domain == "dom1" and rec.parent is None
    assert len(rec.lineage) == 32
    (ev,) = list(ledger.events("s1"))
    assert (ev.seq, ev.type) == (0, "session.created")
    assert ev.body == {"session": "s1", "domain": "dom1", "config": {"budget": 3}}
    assert ledger.session("s1") == rec
    assert ledger.last_seq("s1") == 0


def test_adopted_session_and_duplicates_and_bad_names(ledger):
    new_session(ledger, "adopt", domain="vm", adopted=True)
    assert next(ledger.events("adopt")).type == "session.adopted"
    with pytest.raises(AlreadyExists):
        new_session(ledger, "adopt")
    for bad in ("", "a/b", "..", "x\0y"):
        with pytest.raises(BadName):
            new_session(ledger, bad)
    with pytest.raises(NoSuchSession):
        ledger.session("nope")
    assert [s.name for s in ledger.sessions()] == ["adopt"]


def test_session_names_are_not_lineages(ledger):
    a = new_session(ledger, "reused")
    with ledger.env.begin(write=True) as txn:
        ledger.remove_session(txn, "reused")
    b = new_session(ledger, "reused")
    assert a.lineage != b.lineage
    assert [e.type for e in ledger.events("reused")] == ["session.created"]


def test_append_rules(ledger):
    new_session(ledger, "s")
    with pytest.raises(BadInput, match="unknown event type"):
        ledger.record("s", "made.up", {})
    with pytest.raises(BadInput, match="JSON object"):
        ledger.record("s", "pause", ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="limit"):
        ledger.record("s", "pause", {"x": "y" * BODY_MAX})
    with pytest.raises(BadInput, match="plain JSON"):
        ledger.record("s", "pause", {"x": object()})
    with pytest.raises(NoSuchSession):
        ledger.record("ghost", "pause", {})
    ev = ledger.record("s", "pause", {"reason": "user"})
    assert (ev.seq, ev.type, ev.body) == (1, "pause", {"reason": "user"})
    assert ledger.event("s", 1) == ev
    assert ledger.last_seq("s") == 1


def test_failed_transaction_leaves_no_seq_used(ledger):
    new_session(ledger, "s")
    with pytest.raises(RuntimeError), ledger.env.begin(write=True) as txn:
        ledger.append(txn, "s", "pause", {})
        ledger.append(txn, "s", "resume", {})
        raise RuntimeError("caller failed before commit")
    assert ledger.record("s", "pause", {}).seq == 1


def test_events_since_and_batches(ledger):
    new_session(ledger, "s")
    with ledger.env.begin(write=True) as txn:
        for i in range(1200):  # more than one read batch
            ledger.append(txn, "s", "gateway.call", {"key": f"k{i}"})
    seqs = [e.seq for e in ledger.events("s")]
    assert seqs == list(range(1201))
    assert [e.seq for e in ledger.events("s", since=1190)] == list(range(1190, 1201))
    assert list(ledger.events("s", since=5000)) == []
    with pytest.raises(BadInput):
        list(ledger.events("s", since=-1))


def test_gapless_under_eight_threads(ledger):
    new_session(ledger, "busy")
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(n):
        try:
            for i in range(60):
                ev = ledger.record("busy", "gateway.call", {"key": f"t{n}-{i}"})
                with lock:
                    seen.append(ev.seq)
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(seen) == list(range(1, 481))
    events = list(ledger.events("busy"))
    assert [e.seq for e in events] == list(range(481))
    assert len({e.body["key"] for e in events[1:]}) == 480


def test_checkpoint_records(ledger, store, tmp_path):
    new_session(ledger, "s")
    a = take_checkpoint(ledger, store, "s", {"disk.raw": b"a" * 5000, "memory": b"m" * 300},
                        name="first")
    ledger.record("s", "gateway.call", {"key": "k"})
    b = take_checkpoint(ledger, store, "s", {"disk.raw": b"b" * 7000})
    assert b.name == f"c_{b.seq:04d}"
    assert ledger.checkpoint_names("s") == ["first", b.name]
    assert ledger.checkpoint("s", "first") == a
    assert ledger.checkpoints("s") == [a, b]
    assert ledger.latest_checkpoint("s") == b
    (sa, sb) = ledger.checkpoint_summaries("s")
    assert (sa.name, sa.seq, sa.size, sa.files) == ("first", a.seq, 5300, 2)
    assert sa.stored == a.stored_bytes and sb.size == 7000
    assert ledger.live_manifests() == {f.manifest for c in (a, b) for f in c.files}
    with pytest.raises(NoSuchCheckpoint):
        ledger.checkpoint("s", "missing")
    with pytest.raises(AlreadyExists), ledger.env.begin(write=True) as txn:
        ledger.put_checkpoint(txn, a)


def test_put_checkpoint_refuses_bad_records(ledger, store):
    new_session(ledger, "s")
    good = take_checkpoint(ledger, store, "s", {"f": b"xyz" * 100}, name="good")
    begin = ledger.record("s", "checkpoint.begin", {})
    pause = ledger.record("s", "pause", {})
    missing = FileRecord("f", "ab" * 32, 10)
    cases = [
        (CheckpointRecord("s", "x1", pause.seq, 0.0, good.files), BadInput),  # not a begin
        (CheckpointRecord("s", "x2", 999, 0.0, good.files), BadInput),  # no such event
        (CheckpointRecord("s", "x3", begin.seq, 0.0, (missing,)), ManifestCorrupt),
        (CheckpointRecord("s", "x4", begin.seq, 0.0, good.files * 2), BadInput),
        (CheckpointRecord("s", "a/b", begin.seq, 0.0, good.files), BadName),
        (CheckpointRecord("nobody", "x5", begin.seq, 0.0, good.files), NoSuchSession),
    ]
    for record, exc in cases:
        with pytest.raises(exc), ledger.env.begin(write=True) as txn:
            ledger.put_checkpoint(txn, record)
    assert ledger.checkpoint_names("s") == ["good"]


def test_delete_checkpoint(ledger, store):
    new_session(ledger, "s")
    cp = take_checkpoint(ledger, store, "s", {"f": b"1" * 1000}, name="one")
    with ledger.env.begin(write=True) as txn:
        ev = ledger.delete_checkpoint(txn, "s", "one")
    assert ev.type == "checkpoint.deleted"
    assert ev.body["name"] == "one" and ev.body["seq"] == cp.seq
    assert ledger.checkpoint_names("s") == [] and ledger.live_manifests() == set()
    with pytest.raises(NoSuchCheckpoint), ledger.env.begin(write=True) as txn:
        ledger.delete_checkpoint(txn, "s", "one")


def _fork(ledger, parent, checkpoint, child):
    cp = ledger.checkpoint(parent, checkpoint)
    with ledger.env.begin(write=True) as txn:
        return ledger.create_session(txn, child, parent=ForkPoint(parent, checkpoint, cp.seq))


def test_fork_chain_four_levels_rebuilds_to_root(ledger, store):
    new_session(ledger, "root")
    names = ["root", "gen1", "gen2", "gen3", "gen4"]
    expected = []
    for parent, child in zip(names, names[1:], strict=False):
        ledger.record(parent, "gateway.call", {"key": parent})
        cp = take_checkpoint(ledger, store, parent, {"disk.raw": parent.encode() * 500})
        rec = _fork(ledger, parent, cp.name, child)
        prec = ledger.session(parent)
        assert rec.parent == ForkPoint(parent, cp.name, cp.seq, prec.lineage)
        expected.insert(0, rec.parent)
        first = next(ledger.events(child))
        assert first.type == "lineage.forked"
        assert first.body["parent_session"] == parent
        assert first.body["checkpoint"] == cp.name
        assert first.body["parent_seq"] == cp.seq
        assert first.body["parent_lineage"] == prec.lineage
        fc = [e for e in ledger.events(parent) if e.type == "fork.created"]
        assert fc[-1].body["session"] == child and fc[-1].body["lineage"] == rec.lineage
    assert ledger.lineage("gen4") == expected
    assert [fp.session for fp in ledger.lineage("gen4")] == ["gen3", "gen2", "gen1", "root"]
    assert ledger.lineage("root") == []


def test_fork_needs_the_checkpoint(ledger, store):
    new_session(ledger, "p")
    with pytest.raises(NoSuchCheckpoint), ledger.env.begin(write=True) as txn:
        ledger.create_session(txn, "c", parent=ForkPoint("p", "nope", 0))
    with pytest.raises(NoSuchSession), ledger.env.begin(write=True) as txn:
        ledger.create_session(txn, "c", parent=ForkPoint("ghost", "nope", 0))
    with pytest.raises(NoSuchSession):
        ledger.session("c")


def test_child_survives_parent_checkpoint_delete_and_parent_removal(ledger, store):
    new_session(ledger, "a")
    cpa = take_checkpoint(ledger, store, "a", {"disk.raw": b"A" * 4000}, name="base")
    _fork(ledger, "a", "base", "b")
    cpb = take_checkpoint(ledger, store, "b", {"disk.raw": b"B" * 4000}, name="mid")
    _fork(ledger, "b", "mid", "c")
    before = ledger.lineage("c")
    with ledger.env.begin(write=True) as txn:
        ledger.delete_checkpoint(txn, "b", "mid")
    assert ledger.lineage("c") == before
    assert ledger.verify() == []
    with ledger.env.begin(write=True) as txn:
        ledger.remove_session(txn, "b")
        ledger.remove_session(txn, "a")
    assert ledger.lineage("c") == before
    assert [(fp.session, fp.checkpoint, fp.seq) for fp in before] == [
        ("b", "mid", cpb.seq), ("a", "base", cpa.seq)]
    infos = {i.session: i for i in ledger.lineages()}
    assert infos["a"].removed is not None and infos["b"].removed is not None
    assert next(ledger.events("c")).body["checkpoint"] == "mid"
    assert [s.name for s in ledger.sessions()] == ["c"]
    assert ledger.live_manifests() == set()
    assert ledger.verify() == []


def test_remove_session_keeping_checkpoints(ledger, store):
    new_session(ledger, "k")
    cp = take_checkpoint(ledger, store, "k", {"f": b"keep" * 100}, name="kept")
    with ledger.env.begin(write=True) as txn:
        ledger.remove_session(txn, "k", keep_checkpoints=True)
    rec = ledger.session("k")
    assert rec.removed is not None
    assert ledger.checkpoint("k", "kept") == cp
    assert list(ledger.events("k"))[-1].type == "session.removed"
    assert ledger.sessions() == []
    assert [s.name for s in ledger.sessions(include_removed=True)] == ["k"]
    assert ledger.live_manifests() == {cp.files[0].manifest}
    with pytest.raises(ReadOnly):
        ledger.record("k", "pause", {})
    with pytest.raises(AlreadyExists):
        new_session(ledger, "k")
    # a kept checkpoint can still be forked; the fork's record lands in the removed log
    child = _fork(ledger, "k", "kept", "kid")
    assert child.parent.lineage == rec.lineage
    assert ledger.verify() == []
    with ledger.env.begin(write=True) as txn:
        ledger.remove_session(txn, "k")
    with pytest.raises(NoSuchSession):
        ledger.session("k")
    assert ledger.lineage("kid")[0].session == "k"


def test_update_session(ledger):
    new_session(ledger, "u")
    with ledger.env.begin(write=True) as txn:
        rec = ledger.update_session(txn, "u", domain="ksfs-u", config={"budget_usd": 1.5})
    assert ledger.session("u") == rec and rec.domain == "ksfs-u"
    assert rec.config == {"budget_usd": 1.5}


def test_verify_names_each_problem(ledger, store):
    new_session(ledger, "p")
    cp = take_checkpoint(ledger, store, "p", {"f": b"p" * 2000}, name="c")
    _fork(ledger, "p", "c", "q")
    for _ in range(3):
        ledger.record("p", "pause", {})
    assert ledger.verify() == []
    p = ledger.session("p")
    q = ledger.session("q")
    lin = K.lineage_bytes(p.lineage)
    with ledger.env.begin(write=True) as txn:
        saved = txn.get(K.lineage_meta_key(lin), db=ledger._meta)
        txn.delete(K.event_key_raw(lin, 4), db=ledger._events)  # a gap
        txn.put(K.event_key_raw(lin, 5), b"{torn", db=ledger._events)  # an undecodable event
        # the fork's parent lineage record vanishes
        txn.delete(K.lineage_meta_key(lin), db=ledger._meta)
        # the checkpoint's manifest vanishes from the store
        txn.delete(bytes.fromhex(cp.files[0].manifest), db=store.db["manifests"])
    problems = ledger.verify()
    text = "\n".join(problems)
    assert f"lineage {p.lineage}: seq 4 is missing" in text
    assert f"lineage {p.lineage}: event 5 does not decode" in text
    assert f"parent lineage {p.lineage} of 'p' has no record" in text
    assert f"manifest {cp.files[0].manifest} of f is not in the store" in text
    assert f"lineage {q.lineage}" in text
    # put things back so the fixture's final verify is clean
    with ledger.env.begin(write=True) as txn:
        txn.put(K.lineage_meta_key(lin), saved, db=ledger._meta)
        ledger.remove_session(txn, "q")
        ledger.remove_session(txn, "p")
    assert ledger.verify() == []


def test_stats_count_everything(ledger, store):
    new_session(ledger, "a")
    new_session(ledger, "b")
    take_checkpoint(ledger, store, "a", {"f": b"f" * 100})
    st = ledger.stats()
    assert st == {"sessions": 2, "lineages": 2, "removed_lineages": 0, "events": 4,
                  "checkpoints": 1}


def test_listing_thousands_reads_only_the_index(ledger, store):
    """2000 checkpoints of 20 files each list in seq order from the index alone: with every
    record's value damaged, names and summaries still come back (and verify names the damage)."""
    new_session(ledger, "many")
    base = take_checkpoint(ledger, store, "many", {"f": b"shared" * 100}, name="base")
    files = tuple(
        FileRecord(f"file{i}", base.files[0].manifest, 600, 0) for i in range(20)
    )
    names = ["base"]
    with ledger.env.begin(write=True) as txn:
        for i in range(2000):
            ev = ledger.append(txn, "many", "checkpoint.begin", {})
            name = f"n{1999 - i:04d}"  # names sort against seq order on purpose
            ledger.put_checkpoint(txn, CheckpointRecord("many", name, ev.seq, 0.0, files))
            names.append(name)
    assert ledger.checkpoint_names("many") == names
    lin = K.lineage_bytes(ledger.session("many").lineage)
    saved = {}
    with ledger.env.begin(write=True) as txn:
        for name in names:
            key = K.ckpt_name_key(lin, name)
            saved[key] = txn.get(key, db=ledger._ckpts)
            txn.put(key, b"not json", db=ledger._ckpts)
    summaries = ledger.checkpoint_summaries("many")
    assert [s.name for s in summaries] == names
    assert all(s.size == 12000 and s.files == 20 for s in summaries[1:])
    assert len(ledger.verify()) == len(names) * 2  # undecodable + then unindexed, per record
    with ledger.env.begin(write=True) as txn:
        for key, value in saved.items():
            txn.put(key, value, db=ledger._ckpts)
    assert ledger.latest_checkpoint("many").name == "n0000"


def test_automatic_names_skip_to_the_next_free_number(ledger, store):
    """QA: a user's checkpoint named ``c_0007`` made the automatic name of begin seq 7
    ``c_0007-2``; it is the next free ``c_NNNN`` instead, whatever names users chose."""
    from ksfs.ledger import auto_checkpoint_name

    assert auto_checkpoint_name(7) == "c_0007"
    assert auto_checkpoint_name(12345) == "c_12345"
    assert auto_checkpoint_name(7, {"c_0007"}) == "c_0008"
    assert auto_checkpoint_name(7, {"c_0007", "c_0007-2", "c_0008", "c_7", "c_0010"}) == "c_0009"
    assert auto_checkpoint_name(9999, {"c_9999"}) == "c_10000"
    with pytest.raises(BadInput):
        auto_checkpoint_name(-1)
    # through the checkpoint flow: the user takes the name the next begin's seq would give
    new_session(ledger, "n")
    taken = f"c_{ledger.last_seq('n') + 3:04d}"
    user = take_checkpoint(ledger, store, "n", {"f": b"u"}, name=taken)
    auto = take_checkpoint(ledger, store, "n", {"f": b"a"})
    assert auto.seq == user.seq + 2 and user.name == f"c_{auto.seq:04d}"
    assert auto.name == f"c_{auto.seq + 1:04d}"
    nxt = take_checkpoint(ledger, store, "n", {"f": b"b"})
    assert nxt.name == f"c_{nxt.seq:04d}" and nxt.seq > auto.seq + 1
    assert ledger.checkpoint_names("n") == [user.name, auto.name, nxt.name]


def test_odd_bodies_are_refused_or_kept_exactly(ledger):
    """Bodies a JSON reader elsewhere could not take are refused with BadInput and use no seq
    (NaN and Infinity were stored, and `events --json` then printed lines that are not JSON; a
    body nested thousands deep raised RecursionError, one nested 900 deep was stored and broke
    `events --json`); odd but valid strings come back exactly."""
    new_session(ledger, "s")
    deep: dict = {}
    cur = deep
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    nested = json_nested(200)
    for bad in ({"x": float("nan")}, {"x": float("-inf")}, {"a": [1, float("inf")]}, deep,
                {"x": nested}):
        with pytest.raises(BadInput):
            ledger.record("s", "pause", bad)
    with pytest.raises(BadInput):
        with ledger.env.begin(write=True) as txn:
            ledger.create_session(txn, "c", config={"x": float("nan")})
    assert ledger.last_seq("s") == 0
    odd = {"nul": "a\x00b", "k\x00": 1, "lone": "x\ud800y", "nl": "a\r\nb\n", "wide": "é漢🙂",
           "shallow": json_nested(20)}
    ev = ledger.record("s", "pause", odd)
    assert ev.seq == 1 and ledger.event("s", 1).body == odd
    assert ledger.verify() == []


def json_nested(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


def test_a_stored_value_nested_too_deep_is_damage_not_a_crash(ledger):
    """A value no JSON reader can take back (written by hand or by an older ksfs) is reported
    as a damaged record (IntegrityError, and one line of verify), not a RecursionError."""
    new_session(ledger, "s")
    lin = K.lineage_bytes(ledger.session("s").lineage)
    raw = b'{"body":{"x":' + b"[" * 100000 + b"]" * 100000 + b'},"time":1.0,"type":"pause"}'
    with ledger.env.begin(write=True) as txn:
        txn.put(K.event_key_raw(lin, 1), raw, db=ledger._events)
    with pytest.raises(IntegrityError):
        ledger.event("s", 1)
    problems = ledger.verify()
    assert len(problems) == 1 and "event 1 does not decode" in problems[0], problems
    with ledger.env.begin(write=True) as txn:  # mended, so the fixture's verify is clean
        txn.put(K.event_key_raw(lin, 1), b'{"body":{},"time":1.0,"type":"pause"}',
                db=ledger._events)


def test_seq_arguments_out_of_range_are_bad_input(ledger):
    """A seq is an unsigned 64-bit number: anything else given to a reader is BadInput (one
    sentence), never struct.error; the top seq itself reads as nothing there."""
    new_session(ledger, "s")
    for bad in (-1, 2**64, 10**30, True, 1.0, "3", None):
        with pytest.raises(BadInput, match="seq"):
            list(ledger.events("s", since=bad))
        with pytest.raises(BadInput, match="seq"):
            ledger.event("s", bad)
    assert list(ledger.events("s", since=2**64 - 1)) == [] and ledger.event("s", 2**64 - 1) is None
    assert ledger.event("s", 0).type == "session.created"


def test_an_event_whose_body_is_no_object_is_damage(ledger):
    """A stored body that is not a JSON object (``[]``, ``[["a", 1]]``) was silently made a dict
    by decoding, so verify called a damaged event clean."""
    new_session(ledger, "s")
    lin = K.lineage_bytes(ledger.session("s").lineage)
    for raw in (b'{"body":[],"time":1.0,"type":"pause"}',
                b'{"body":[["a",1]],"time":1.0,"type":"pause"}'):
        with ledger.env.begin(write=True) as txn:
            txn.put(K.event_key_raw(lin, 1), raw, db=ledger._events)
        with pytest.raises(IntegrityError):
            ledger.event("s", 1)
        problems = ledger.verify()
        assert len(problems) == 1 and "event 1 does not decode" in problems[0], problems
    with ledger.env.begin(write=True) as txn:  # mended, so the fixture's verify is clean
        txn.put(K.event_key_raw(lin, 1), b'{"body":{},"time":1.0,"type":"pause"}',
                db=ledger._events)


def test_events_backward_and_events_of_types(ledger):
    """Readers that look for the last event of a kind read the log from its end, and those
    that want a few types decode only those (recover on a log of 300,000 model calls)."""
    for name in ("a", "b", "c"):
        new_session(ledger, name)
    for i in range(1200):  # more than one batch
        ledger.record("b", "gateway.call", {"key": f"k{i}", "type": "pause"})
        if i % 500 == 7:
            ledger.record("b", "pause", {"i": i})
    ledger.record("a", "resume", {})
    seqs = [e.seq for e in ledger.events_backward("b")]
    assert seqs == list(range(ledger.last_seq("b"), -1, -1))
    assert [e.seq for e in ledger.events_backward("b", 700)] == list(range(699, -1, -1))
    assert [e.seq for e in ledger.events_backward("a")] == [1, 0]
    assert [e.seq for e in ledger.events_backward("c")] == [0]
    assert list(ledger.events_backward("a", 0)) == []
    pauses = [e for e in ledger.events("b") if e.type == "pause"]
    assert len(pauses) == 3  # (a body's own "type" key is no event type)
    assert list(ledger.events_of("b", {"pause"})) == pauses
    assert list(ledger.events_backward("b", types={"pause"})) == pauses[::-1]
    assert list(ledger.events_of("b", {"pause"}, since=pauses[1].seq)) == pauses[1:]


def test_scans_by_type_read_a_value_not_written_as_ksfs_writes_it_by_decoding_it(ledger):
    """Review: a value with a key after its type ('..."type":"pause","v":"1"}', a foreign
    writer's or damage) was passed over by a scan for pauses, while `events` read it as one;
    a value decoded to be sure is yielded only when it is of a type asked for."""
    from ksfs.ledger import keys as K

    new_session(ledger, "s")
    ledger.record("s", "resume", {})
    ledger.record("s", "pause", {})
    lin = K.lineage_bytes(ledger.session("s").lineage)
    with ledger.env.begin(write=True) as txn:
        txn.put(K.event_key_raw(lin, 3), b'{"body":{},"time":1.0,"type":"pause","v":"1"}',
                db=ledger._events)
        txn.put(K.event_key_raw(lin, 4), b'{"body":{},"time":1.0,"type":"resume","v":"1"}',
                db=ledger._events)
    pauses = [e.seq for e in ledger.events("s") if e.type == "pause"]
    assert pauses == [2, 3]
    assert [e.seq for e in ledger.events_of("s", {"pause"})] == pauses
    assert [e.seq for e in ledger.events_backward("s", types={"pause"})] == pauses[::-1]
    assert [e.seq for e in ledger.events_of("s", {"resume"})] == [1, 4]
