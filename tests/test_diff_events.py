"""``ksfs diff`` between imported ext4 checkpoints: which events lie between two checkpoints (in
one log, and along the fork tree across sessions), mode and owner changes, and names with control
characters quoted in the human output only.

Forks are made at the ledger level (``create_session`` with a ForkPoint, as ``keeper.fork`` records
them) so no VM is needed; their checkpoints are imported like any offline session's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from ksfs.cli import main
from ksfs.guestfs.mkimage import build_ext4
from ksfs.keeper import Keeper
from ksfs.model import ForkPoint


def _image(tmp: Path, name: str, files: dict[str, bytes], modes: dict[str, int] | None = None,
           owners: dict[str, tuple[int, int]] | None = None) -> Path:
    src = tmp / f"src-{name}"
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
        os.chmod(src / rel, (modes or {}).get(rel, 0o644))
        if owners and rel in owners:
            os.chown(src / rel, *owners[rel])
    out = tmp / f"img-{name}" / "disk.raw"
    out.parent.mkdir()
    build_ext4(src, out, 16)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """s: A, B, C. f forked from s/A (before B) with fa; g forked from f/fa with ga; x unrelated.

    A -> B: tiny chmod 644 -> 600 (mode only), "new\\nline" 3 -> 8 bytes, own chowned 0:0 -> 1:2.
    """
    tmp = tmp_path_factory.mktemp("diff-events")
    base = {"tiny": b"tiny\n", "new\nline": b"abc", "own": b"owned\n", "same": b"same\n"}
    changed = dict(base, **{"new\nline": b"abcdefgh"})
    root = os.geteuid() == 0
    img_a = _image(tmp, "A", base)
    img_b = _image(tmp, "B", changed, modes={"tiny": 0o600},
                   owners={"own": (1, 2)} if root else None)
    img_c = _image(tmp, "C", dict(changed, extra=b"x"), modes={"tiny": 0o600},
                   owners={"own": (1, 2)} if root else None)
    store = tmp / "store"
    with Keeper(store, create=True) as k:
        ra = k.import_files("s", "A", [img_a])
        with k.store.env.begin(write=True) as txn:
            k.ledger.create_session(txn, "f", parent=ForkPoint("s", "A", ra.seq))
        k.ledger.record("f", "pause", {})
        rfa = k.import_files("f", "fa", [img_b])
        k.ledger.record("s", "resume", {})
        k.import_files("s", "B", [img_b])
        k.import_files("s", "C", [img_c])
        with k.store.env.begin(write=True) as txn:
            k.ledger.create_session(txn, "g", parent=ForkPoint("f", "fa", rfa.seq))
        k.import_files("g", "ga", [img_c])
        k.import_files("x", "X", [img_a])
        logs = {s: list(k.ledger.events(s)) for s in ("s", "f", "g", "x")}
    return store, logs, root


def cli(store: Path, *args: str) -> str:
    res = CliRunner().invoke(main, ["--store", str(store), "diff", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return res.output


def as_json(store: Path, *args: str) -> dict:
    return json.loads(cli(store, *args, "--json"))


def published(log, name: str) -> int:
    return next(e.seq for e in log if e.type == "checkpoint.published"
                and e.body["name"] == name)


def evs(d: dict) -> list[tuple[str, int, str]]:
    return [(e["session"], e["seq"], e["type"]) for e in d["events"]]


def test_same_checkpoint_has_no_events_between(world) -> None:
    store, _, _ = world
    d = as_json(store, "s", "A", "A")
    assert d["events"] == [] and d["files"] == [] and d["attr_changes"] == []
    assert "events between: 0\n" in cli(store, "s", "B", "B")


def test_events_after_a_published_through_b_published(world) -> None:
    store, logs, _ = world
    log = logs["s"]
    pa, pb, pc = (published(log, n) for n in "ABC")
    d = as_json(store, "s", "A", "B")
    want = [("s", e.seq, e.type) for e in log if pa < e.seq <= pb]
    assert evs(d) == want
    types = [t for _, _, t in want]
    assert types == ["fork.created", "resume", "checkpoint.begin", "checkpoint.published"]
    assert d["events"][-1]["body"]["name"] == "B"
    assert d["events_path"] == [{"session": "s", "lineage": d["events_path"][0]["lineage"],
                                 "from_seq": pa + 1, "to_seq": pb}]
    # B before A: the same events; B to C: only C's own begin and published
    assert evs(as_json(store, "s", "B", "A")) == want
    bc = as_json(store, "s", "B", "C")
    assert [(s, t) for s, _, t in evs(bc)] == [("s", "checkpoint.begin"),
                                               ("s", "checkpoint.published")]
    assert [e["seq"] for e in bc["events"]] == [pc - 1, pc]
    out = cli(store, "s", "B", "C")
    assert f"events between: 2\n  {pc - 1:>6} checkpoint.begin\n  {pc:>6} checkpoint." \
           "published\n" in out


def test_fork_against_its_parents_checkpoint(world) -> None:
    store, logs, _ = world
    f = logs["f"]
    d = as_json(store, "f", "s/A", "fa")
    want = [("f", e.seq, e.type) for e in f if e.seq <= published(f, "fa")]
    assert evs(d) == want
    assert [t for _, _, t in want] == ["lineage.forked", "pause", "checkpoint.begin",
                                       "checkpoint.published"]
    assert evs(as_json(store, "f", "fa", "s/A")) == want
    out = cli(store, "f", "s/A", "fa")
    assert "events between: 4\n" in out and f"  {0:>6} lineage.forked\n" in out
    # asked from the parent's side, the lines are the fork's: named so (QA, eighteenth
    # session: they read as s's own seq 0..3)
    out = cli(store, "s", "A", "f/fa")
    assert f"  along: f seq 0..{published(f, 'fa')}\n" in out, out
    assert f"  f {0:>6} lineage.forked\n" in out, out


def test_across_the_fork_tree(world) -> None:
    store, logs, _ = world
    s, f, g = logs["s"], logs["f"], logs["g"]
    pa, pb = published(s, "A"), published(s, "B")
    # B (in s, after the fork) to fa: s's log after A's end through B's, then f's from its start
    d = as_json(store, "s", "B", "f/fa")
    s_part = [("s", e.seq, e.type) for e in s if pa < e.seq <= pb]
    f_part = [("f", e.seq, e.type) for e in f if e.seq <= published(f, "fa")]
    assert sorted(evs(d)) == sorted(s_part + f_part)
    assert evs(d) == s_part + f_part  # up from B (none: s is shared), across s, down into f
    assert evs(as_json(store, "f", "fa", "s/B")) == f_part + s_part
    # ga (fork of a fork) to B: up through g and f, then across s
    g_part = [("g", e.seq, e.type) for e in g if e.seq <= published(g, "ga")]
    d = as_json(store, "g", "ga", "s/B")
    assert evs(d) == g_part + f_part + s_part
    assert [p["session"] for p in d["events_path"]] == ["g", "f", "s"]
    out = cli(store, "g", "ga", "s/B")
    assert f"  along: g seq 0..{published(g, 'ga')}, f seq 0..{published(f, 'fa')}, " \
           f"s seq {pa + 1}..{pb}\n" in out
    assert "  g      0 lineage.forked\n" in out
    # two forks of one lineage: f/fa against g/ga is only g's part
    assert evs(as_json(store, "g", "f/fa", "ga")) == g_part


def test_unrelated_sessions_have_no_path(world) -> None:
    store, _, _ = world
    d = as_json(store, "s", "A", "x/X")
    assert d["events"] == [] and d["events_path"] is None
    assert "events between: none (the two sessions share no lineage)" in cli(store, "s", "A",
                                                                               "x/X")


def test_mode_and_owner_changes_are_reported(world) -> None:
    store, _, root = world
    d = as_json(store, "s", "A", "B")
    assert {c["path"] for c in d["files"]} == {"new\nline"}  # diff -rq's view, unchanged
    by = {c["path"]: c for c in d["files"] + d["attr_changes"]}
    assert by["tiny"]["kind"] == "attrs" and by["tiny"]["attrs"] == {"mode": [0o644, 0o600]}
    assert by["new\nline"]["kind"] == "changed" and by["new\nline"]["attrs"] == {}
    assert "same" not in by
    out = cli(store, "s", "A", "B")
    assert "M tiny  (mode 644 -> 600)\n" in out
    if root:
        assert by["own"]["attrs"] == {"uid": [0, 1], "gid": [0, 2]}
        assert "M own  (owner 0:0 -> 1:2)\n" in out
    assert (f"files: {2 + root} changed ({1 + root} in mode, owner or extended attributes "
            f"only)\n") in out
    assert out.index("M \"new\\nline\"") < out.index("M tiny")


def test_names_are_quoted_in_human_output_only(world) -> None:
    store, _, _ = world
    out = cli(store, "s", "A", "B")
    assert 'M "new\\nline"  (file, 3 -> 8)\n' in out
    assert "new\nline" not in out
    assert "new\nline" in {c["path"] for c in as_json(store, "s", "A", "B")["files"]}


def test_quote_name() -> None:
    from ksfs.cli.store_cmds import quote_name

    assert quote_name("plain name é") == "plain name é"
    assert quote_name("a\tb\\c\"d") == '"a\\tb\\\\c\\"d"'
    assert quote_name("x\x01y\x7f") == '"x\\001y\\177"'
    assert quote_name("bad\udcff") == '"bad\\377"'  # a non-UTF-8 byte as surrogateescape keeps it
    assert quote_name("ls\u2028") == '"ls\\342\\200\\250"'


def test_a_changed_type_is_said_with_both_types(tmp_path: Path) -> None:
    """QA (fifteenth session): a directory that became a file showed as `(file, - -> 0)`."""
    src_a, src_b = tmp_path / "a", tmp_path / "b"
    (src_a / "was-dir").mkdir(parents=True)
    (src_a / "was-dir" / "inside").write_bytes(b"x")
    src_b.mkdir()
    (src_b / "was-dir").write_bytes(b"")
    imgs = []
    for name, src in (("A", src_a), ("B", src_b)):
        out = tmp_path / f"img-{name}" / "disk.raw"
        out.parent.mkdir()
        build_ext4(src, out, 16)
        imgs.append(out)
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        k.import_files("t", "A", [imgs[0]])
        k.import_files("t", "B", [imgs[1]])
    out = cli(store, "t", "A", "B")
    assert "M was-dir  (dir -> file, - -> 0)\n" in out, out


def test_extended_attribute_changes_are_reported(tmp_path: Path) -> None:
    """A guest file whose extended attributes alone changed (a value, one added, one removed)
    is an "attrs" change naming them; diff -rq's view (files) is unchanged."""
    images = {}
    for name, tags in (("A", {"user.tag": b"a", "user.gone": b"x"}),
                       ("B", {"user.tag": b"b", "user.new": b"y"})):
        src = tmp_path / f"src-{name}"
        src.mkdir()
        for f in ("tagged", "plain"):
            (src / f).write_bytes(b"same bytes\n")
        try:
            for key, value in tags.items():
                os.setxattr(src / "tagged", key, value)
        except OSError as exc:
            pytest.skip(f"the temporary directory takes no user xattrs: {exc}")
        images[name] = tmp_path / f"img-{name}" / "disk.raw"
        images[name].parent.mkdir()
        build_ext4(src, images[name], 16)
    store = tmp_path / "store"
    with Keeper(store, create=True) as k:
        for name, img in images.items():
            k.import_files("s", name, [img])
    d = as_json(store, "s", "A", "B")
    assert d["files"] == []
    assert [(c["path"], c["kind"], c["attrs"]) for c in d["attr_changes"]] == [
        ("tagged", "attrs", {"xattrs": {"added": ["user.new"], "removed": ["user.gone"],
                                        "changed": ["user.tag"]}})]
    out = cli(store, "s", "A", "B")
    # QA (seventeenth session): the names alone did not say which way each moved
    assert "M tagged  (xattrs +user.new -user.gone ~user.tag)\n" in out, out
    back = as_json(store, "s", "B", "A")["attr_changes"][0]["attrs"]["xattrs"]
    assert back == {"added": ["user.gone"], "removed": ["user.new"], "changed": ["user.tag"]}
    assert "files: 1 changed (1 in mode, owner or extended attributes only)\n" in out
