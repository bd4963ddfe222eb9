"""The bytes only one checkpoint holds (keeper.exclusive_bytes, the mount's st_blocks).

Held to what GC frees: a checkpoint's files' exclusive bytes, summed, are exactly the record
bytes ``gc`` frees once that checkpoint alone is deleted. Shared chunks (another checkpoint's
copy, a delta's base, a second file of the same checkpoint) are charged once or not at all, and
the counts follow checkpoints as they come and go without reopening the keeper.
"""

from __future__ import annotations

import random
import time

import pytest

from ksfs.keeper import Keeper
from ksfs.keeper.holdings import ChunkHolders

K64 = 64 * 1024


@pytest.fixture
def keeper(tmp_path):
    with Keeper(tmp_path / "store", create=True) as k:
        yield k


def put(keeper: Keeper, tmp_path, session: str, checkpoint: str, files: dict[str, bytes]):
    d = tmp_path / f"{session}-{checkpoint}"
    d.mkdir(exist_ok=True)
    paths = []
    for name, data in files.items():
        (d / name).write_bytes(data)
        paths.append(d / name)
    return keeper.import_files(session, checkpoint, [], disks=paths)


def exclusive(keeper: Keeper, session: str, checkpoint: str) -> dict[str, int]:
    rec = keeper.ledger.checkpoint(session, checkpoint)
    return {f.name: keeper.exclusive_bytes(rec, f.name) for f in rec.files}


def test_exclusive_bytes_are_what_deleting_the_checkpoint_frees(keeper, tmp_path):
    rng = random.Random(1)
    a = rng.randbytes(5 * K64)
    b = rng.randbytes(4 * K64)
    b2 = bytearray(b)
    b2[100:110] = bytes(10)  # one chunk changes a little: stored as a delta against b's
    own = rng.randbytes(3 * K64)
    put(keeper, tmp_path, "s", "c1", {"a.img": a, "b.img": b})
    put(keeper, tmp_path, "s", "c2", {"a.img": a, "b.img": bytes(b2)})
    put(keeper, tmp_path, "t", "c3", {"x.img": own, "y.img": own + a})
    put(keeper, tmp_path, "t", "c4", {"z.img": rng.randbytes(2 * K64)})

    c1, c2, c3 = (exclusive(keeper, s, c) for s, c in (("s", "c1"), ("s", "c2"), ("t", "c3")))
    assert c1 == {"a.img": 0, "b.img": 0}  # c2 holds a, and b's chunks (one as a delta's base)
    assert c2["a.img"] == 0 and 0 < c2["b.img"] < K64  # only the delta is c2's alone
    # own's chunks are charged to x.img, the first file of c3 that has them; a's to c1 and c2
    assert c3["x.img"] >= len(own) and c3["y.img"] == 0
    assert exclusive(keeper, "s", "c1") == c1  # asked again: the same

    for session, name in (("t", "c3"), ("s", "c2"), ("s", "c1")):
        expected = sum(exclusive(keeper, session, name).values())
        # a second keeper's fresh count agrees with the one kept up to date
        fresh = ChunkHolders(keeper.store, keeper.ledger)
        rec = keeper.ledger.checkpoint(session, name)
        assert sum(fresh.exclusive_bytes(rec, f.name, wait=True) for f in rec.files) == expected
        keeper.delete_checkpoint(session, name)
        freed = keeper.gc()
        assert freed["bytes_freed"] == expected and not freed["deltas_flattened"], name
        assert keeper.exclusive_bytes(rec, rec.files[0].name) == 0  # deleted: holds nothing
        if name == "c2":  # c1 alone holds a and b now
            after = exclusive(keeper, "s", "c1")
            assert after["a.img"] >= len(a) and after["b.img"] >= len(b)
    assert exclusive(keeper, "t", "c4")["z.img"] >= 2 * K64


def test_version_moves_only_when_holdings_change(keeper, tmp_path):
    rng = random.Random(2)
    assert keeper.holdings_version() is None  # never asked: nothing to keep current
    put(keeper, tmp_path, "s", "c1", {"a.img": rng.randbytes(K64)})
    exclusive(keeper, "s", "c1")
    v1 = keeper.holdings_version()
    assert v1 is not None and keeper.holdings_version() == v1
    keeper.set_budget("s", tokens=5)  # a ledger commit that changes no checkpoint
    assert keeper.holdings_version() == v1
    put(keeper, tmp_path, "s", "c2", {"b.img": rng.randbytes(K64)})
    assert keeper.holdings_version() != v1


def test_a_file_the_checkpoint_does_not_have_holds_nothing(keeper, tmp_path):
    put(keeper, tmp_path, "s", "c1", {"a.img": random.Random(3).randbytes(K64)})
    assert keeper.exclusive_bytes(keeper.ledger.checkpoint("s", "c1"), "nope") == 0


def test_a_base_freed_by_flattening_frees_more_than_du_said(keeper, tmp_path):
    """Deleting the checkpoint that holds a base first: du said 0 (the delta of another
    checkpoint holds the base), GC stores that delta whole and frees the base, so the store
    shrinks by a little more than du said, and never by less. The counts kept current over
    that GC agree with a fresh count (a GC can change holdings without changing a record)."""
    rng = random.Random(4)
    b = rng.randbytes(4 * K64)
    b2 = bytearray(b)
    b2[100:110] = bytes(10)
    put(keeper, tmp_path, "s", "c1", {"b.img": b})
    put(keeper, tmp_path, "s", "c2", {"b.img": bytes(b2)})
    # (a checkpoint deleted beside c1, so that the base's pack is repacked: gc flattens a
    # delta only when that gives bytes back on disk, not when the base's pack stays)
    put(keeper, tmp_path, "s", "g", {"g.img": rng.randbytes(8 * K64)})
    assert exclusive(keeper, "s", "c1") == {"b.img": 0}
    keeper.delete_checkpoint("s", "c1")
    keeper.delete_checkpoint("s", "g")
    res = keeper.gc()
    assert res["deltas_flattened"] == 1
    assert res["bytes_freed"] - res["bytes_rewritten"] >= 0  # du said 0
    # c2's delta is now stored whole: c2 alone holds all of it
    kept = exclusive(keeper, "s", "c2")["b.img"]
    fresh = ChunkHolders(keeper.store, keeper.ledger)
    rec = keeper.ledger.checkpoint("s", "c2")
    assert kept == fresh.exclusive_bytes(rec, "b.img", wait=True) >= len(b)
    # and a third checkpoint of the same bytes shares it, whatever GC did before
    keeper.delete_checkpoint("s", "c2")
    put(keeper, tmp_path, "s", "c3", {"b.img": bytes(b2)})
    keeper.gc()
    put(keeper, tmp_path, "s", "c4", {"b.img": bytes(b2)})
    assert exclusive(keeper, "s", "c3") == {"b.img": 0} == exclusive(keeper, "s", "c4")


def test_a_damaged_record_elsewhere_leaves_every_other_figure(keeper, tmp_path):
    from ksfs.ledger import keys as K

    rng = random.Random(5)
    put(keeper, tmp_path, "a", "c1", {"a.img": rng.randbytes(2 * K64)})
    put(keeper, tmp_path, "b", "c1", {"b.img": rng.randbytes(2 * K64)})
    lin = K.lineage_bytes(keeper.ledger.session("b").lineage)
    db = keeper.ledger._ckpts
    with keeper.store.env.begin(write=True) as txn:
        txn.put(K.ckpt_name_key(lin, "c1"), b"\xff not json", db=db)
    rec = keeper.ledger.checkpoint("a", "c1")
    assert keeper.exclusive_bytes(rec, "a.img") >= 2 * K64
    assert ChunkHolders(keeper.store, keeper.ledger).exclusive_bytes(
        rec, "a.img", wait=True) >= 2 * K64


def test_without_wait_the_first_answer_may_be_none_then_the_count(keeper, tmp_path):
    put(keeper, tmp_path, "s", "c1", {"a.img": random.Random(6).randbytes(3 * K64)})
    rec = keeper.ledger.checkpoint("s", "c1")
    holders = ChunkHolders(keeper.store, keeper.ledger)
    first = holders.exclusive_bytes(rec, "a.img")
    assert first is None or first >= 3 * K64
    deadline = time.monotonic() + 30  # the count started in the background
    while holders.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holders.poll() is not None
    assert holders.exclusive_bytes(rec, "a.img") >= 3 * K64
    holders.close()
    holders._start_build()  # once closed (the store is about to be), no count starts
    assert not holders._building()


def test_a_missing_chunk_of_a_deleted_checkpoint_is_checkpoint_gone(keeper, tmp_path):
    from ksfs.errors import CheckpointGone, ChunkMissing

    put(keeper, tmp_path, "s", "c1", {"a.img": random.Random(7).randbytes(K64)})
    rec = keeper.ledger.checkpoint("s", "c1")
    missing = ChunkMissing(chunk="00")
    assert keeper.gone_error("s", rec, "a.img", missing) is missing  # still there: damage
    keeper.delete_checkpoint("s", "c1")
    gone = keeper.gone_error("s", rec, "a.img", missing)
    assert isinstance(gone, CheckpointGone) and gone.exit_code == 3
    assert "c1" in str(gone) and "a.img" in str(gone)
    # the same name taken again by another checkpoint is still "gone" for the old reader
    put(keeper, tmp_path, "s", "c1", {"a.img": random.Random(8).randbytes(K64)})
    assert isinstance(keeper.gone_error("s", rec, "a.img", missing), CheckpointGone)
    # the whole session removed, then made again with a c1 at the same seq
    second = keeper.ledger.checkpoint("s", "c1")
    keeper.remove_session("s")
    assert isinstance(keeper.gone_error("s", second, "a.img", missing), CheckpointGone)
    put(keeper, tmp_path, "s", "c1", {"a.img": random.Random(9).randbytes(K64)})
    assert isinstance(keeper.gone_error("s", second, "a.img", missing), CheckpointGone)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_counts_kept_current_under_concurrent_questions_equal_a_fresh_count(keeper, tmp_path,
                                                                            seed):
    """Imports, deletions and GCs while threads ask for figures and poll: once it settles,
    every live file's figure equals a fresh count's (no stale snapshot kept as current)."""
    import threading

    rng = random.Random(seed)
    pool = [rng.randbytes(K64) for _ in range(6)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def asker():
        while not stop.is_set():
            try:
                for s in keeper.session_names():
                    for rec in keeper.ledger.checkpoints(s):
                        for f in rec.files:
                            keeper._holders.exclusive_bytes(rec, f.name)
                keeper.holdings_version()
            except BaseException as exc:  # noqa: BLE001 - a checkpoint deleted meanwhile
                if "no checkpoint" not in str(exc) and "no session" not in str(exc):
                    errors.append(exc)

    threads = [threading.Thread(target=asker) for _ in range(4)]
    for t in threads:
        t.start()
    live: list[tuple[str, str]] = []
    try:
        for step in range(100):
            op = rng.random()
            if op < 0.6 or not live:
                name = ("s", f"c{step}")
                files = {f"f{i}.img": b"".join(rng.sample(pool, 3)) for i in range(2)}
                put(keeper, tmp_path, *name, files)
                live.append(name)
            elif op < 0.9:
                keeper.delete_checkpoint(*live.pop(rng.randrange(len(live))))
            else:
                keeper.gc()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    fresh = ChunkHolders(keeper.store, keeper.ledger)
    for s, c in live:
        rec = keeper.ledger.checkpoint(s, c)
        for f in rec.files:
            assert keeper.exclusive_bytes(rec, f.name) == fresh.exclusive_bytes(
                rec, f.name, wait=True), (c, f.name)
