"""The command line's contract where a script leans on it (QA of the eleventh session): every
verb refuses a name no session can have alike, an error is one line whatever its path holds,
a read changes nothing in the store, and names cannot hide what they are."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from ksfs.cas import ChunkStore
from ksfs.gateway.store import GatewayStore
from ksfs.ledger import Ledger
from tests.cli_helpers import KSFS, ksfs

BAD_NAMES = ["a/b", "..", ".", "", "x" * 256, "tab\there"]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    s = tmp_path / "store"
    f = tmp_path / "one.bin"
    f.write_bytes(b"one" * 1000)
    ksfs(s, None, "import", "demo", "c1", str(f))
    return s


def files_of(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and p.parent.name != "locks"
            and p.name not in ("lock", "lock.mdb")}  # readers take locks, and change nothing


@pytest.mark.parametrize("verb", [["events"], ["checkpoints"], ["lineage"], ["usage"],
                                  ["budget"], ["budget", "--tokens", "5"]])
def test_read_verbs_refuse_bad_names_as_every_verb_does(store: Path, verb: list[str]) -> None:
    before = files_of(store)
    for name in BAD_NAMES:
        res = ksfs(store, None, verb[0], name, *verb[1:], check=False)
        assert res.returncode == 2, (verb, name, res.stderr)
        assert "invalid name" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert files_of(store) == before


def test_a_read_of_a_store_the_gateway_never_served_writes_nothing(store: Path) -> None:
    before = files_of(store)
    assert ksfs(store, None, "usage", "demo", "--json").returncode == 0
    assert ksfs(store, None, "usage", "nosuch", check=False).returncode == 3
    assert ksfs(store, None, "budget", "demo").returncode == 0
    assert files_of(store) == before


def test_a_gateway_sees_databases_another_writer_made_after_it_opened(tmp_path: Path) -> None:
    with ChunkStore.open(tmp_path / "s", create=True) as s:
        led = Ledger(s)
        with s.env.begin(write=True) as txn:
            led.create_session(txn, "s1")
        serving = GatewayStore(s, led)  # before any database of the gateway exists
        assert serving.spending(led.session("s1").lineage) == (None, {"tokens": 0, "usd": 0.0})
        GatewayStore(s, led).set_budget("s1", tokens=5)  # `ksfs budget` beside it
        budget, _ = serving.spending(led.session("s1").lineage)
        assert budget == {"tokens": 5, "usd": None}


def test_an_error_is_one_line_whatever_its_path_holds(store: Path, tmp_path: Path) -> None:
    for path in (str(tmp_path / "no\nsuch" / "f.bin"), str(tmp_path / "esc\x1b[31m" / "f.bin")):
        res = ksfs(store, None, "import", "demo", "c2", path, check=False)
        assert res.returncode == 3 and res.stderr.count("\n") == 1, res.stderr
        assert "\x1b" not in res.stderr and ("\\n" in res.stderr or "\\x1b" in res.stderr)


@pytest.mark.parametrize("name", ["c\u0085x", "c\u009b31m", "bidi\u202e", "zw\u200bsp",
                                  "bom\ufeff"])
def test_names_cannot_hide_controls_or_show_as_another(store: Path, tmp_path: Path,
                                                       name: str) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes(b"x")
    res = ksfs(store, None, "import", "demo", name, str(f), check=False)
    # which one is named (QA, nineteenth session: a bidi override was "a control character")
    bad = next(c for c in name if ord(c) >= 0x80)
    assert res.returncode == 2 and "control or invisible formatting characters " \
        f"(U+{ord(bad):04X})" in res.stderr, res.stderr
    assert ksfs(store, None, "import", "demo", "family\u200d", str(f)).returncode == 0  # ZWJ


def test_import_paths_as_posix_tools_read_them(store: Path, tmp_path: Path) -> None:
    f = tmp_path / "k.bin"
    f.write_bytes(b"k" * 70000)
    res = ksfs(store, None, "import", "demo", "c2", str(f) + "/", check=False)
    assert res.returncode == 2 and "ends in '/'" in res.stderr
    # one file named twice is bad input, positional or --disk alike
    for args in ([str(f), str(tmp_path / "." / "k.bin")],
                 ["--disk", str(f), "--disk", str(tmp_path / "." / "k.bin")]):
        res = ksfs(store, None, "import", "demo", "c3", *args, check=False)
        assert res.returncode == 2 and "name one file" in res.stderr, res.stderr
    ksfs(store, None, "import", "demo", "c3", str(f), "--disk", str(f))  # a file, as a disk
    assert ksfs(store, None, "cat", "demo", "c3", "k.bin").stdout == "k" * 70000


def test_a_file_and_a_disk_are_one_file_by_the_file_not_its_path(store: Path,
                                                                  tmp_path: Path) -> None:
    """Issue #2 review: `import --disk ./f S C f` stored f once, as a disk, but `--disk $PWD/f
    S C f` was refused as two files of one name: the paths were compared, not the files."""
    f = tmp_path / "k.bin"
    f.write_bytes(b"k" * 70000)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(KSFS + ["--store", str(store), "import", "demo", *args],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)

    for c, args in (("c2", ["--disk", str(f), "k.bin"]), ("c3", ["--disk", "k.bin", str(f)]),
                    ("c4", ["--disk", "./k.bin", "k.bin"])):
        res = run("--json", c, *args)
        assert res.returncode == 0, (args, res.stderr)
        files = json.loads(res.stdout)["files"]
        assert [(x["name"], x["chunking"]) for x in files] == [("k.bin", "fixed")], args
    # one group naming one file twice, by any path, is still refused as one file named twice
    for args in (["k.bin", str(f)], ["--disk", "k.bin", "--disk", str(f)]):
        res = run("c5", *args)
        assert res.returncode == 2 and "name one file: give it once" in res.stderr, res.stderr
    # a missing file is said first, as before
    res = run("c5", "--disk", str(tmp_path / "nosuch"), "nosuch")
    assert res.returncode == 3 and "not found: nosuch" in res.stderr, res.stderr
    # two names of one file (a hard link) are two files, each under its own name
    os.link(f, tmp_path / "other.bin")
    res = run("--json", "c6", "--disk", "other.bin", "k.bin")
    assert res.returncode == 0, res.stderr
    files = json.loads(res.stdout)["files"]
    assert sorted((x["name"], x["chunking"]) for x in files) == [("k.bin", "cdc"),
                                                                 ("other.bin", "fixed")]
    # different files of one base name are still refused as such
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "k.bin").write_bytes(b"other")
    res = run("c7", "--disk", str(tmp_path / "d" / "k.bin"), "k.bin")
    assert res.returncode == 2 and "would both be stored as 'k.bin'" in res.stderr, res.stderr


def test_stats_of_an_empty_store_shows_no_ratio_as_a_dash(tmp_path: Path) -> None:
    s = tmp_path / "empty"
    ChunkStore.open(s, create=True).close()
    out = ksfs(s, None, "stats").stdout
    assert "dedup_ratio    -" in out and "None" not in out


def test_names_a_store_made_before_the_rules_of_new_names_grew_still_work(tmp_path: Path,
                                                                          monkeypatch) -> None:
    """Review (eleventh session): the stricter rule for new names, applied to every lookup,
    made a store holding such a name unlistable (session list, stats, check raised) and the
    session unremovable. Names are looked up by the rules they were made under."""
    from ksfs import model
    from ksfs.keeper import Keeper

    f = tmp_path / "f.bin"
    f.write_bytes(b"legacy" * 100)
    store = tmp_path / "store"
    legacy = "old\u200bname"
    with monkeypatch.context() as m:  # a ksfs from before the rule: it made this name
        m.setattr(model, "_control", lambda c, new: ord(c) < 0x20 or ord(c) == 0x7F)
        with Keeper(store, create=True) as k:
            k.import_files(legacy, "c\u0085x", [f])
    assert legacy in ksfs(store, None, "session", "list").stdout
    assert ksfs(store, None, "stats").returncode == 0
    assert ksfs(store, None, "check").returncode == 0
    assert ksfs(store, None, "cat", legacy, "c\u0085x", "f.bin").stdout == "legacy" * 100
    assert ksfs(store, None, "rm", legacy, "c\u0085x").returncode == 0
    assert ksfs(store, None, "session", "rm", legacy).returncode == 0
    # and a new name with such a character is still refused
    res = ksfs(store, None, "import", legacy, "c1", str(f), check=False)
    assert res.returncode == 2 and "invisible formatting characters (U+200B)" in res.stderr


def test_stats_of_a_store_whose_checkpoints_all_went_shows_no_ratio(tmp_path: Path) -> None:
    """QA: before its gc it said dedup_ratio 0.0, as if nothing deduplicated."""
    s, f = tmp_path / "store", tmp_path / "f.bin"
    f.write_bytes(b"q" * 5000)
    ksfs(s, None, "import", "demo", "c1", str(f))
    ksfs(s, None, "rm", "demo", "c1")
    figures = json.loads(ksfs(s, None, "stats", "--json").stdout)
    assert figures["logical_bytes"] == 0 and figures["stored_bytes"] > 0
    assert figures["dedup_ratio"] is None
    assert "dedup_ratio    -" in ksfs(s, None, "stats").stdout


def test_a_umask_of_000_makes_nothing_others_can_write(tmp_path: Path) -> None:
    """QA (fifteenth session): under umask 000 the store, vm/ and the daemon's log were
    world-writable, so any local user could plant symlinks there or rewrite the log."""
    import os
    import stat
    import subprocess

    from tests.cli_helpers import KSFS

    src = tmp_path / "notes.txt"
    src.write_text("notes\n")
    store = tmp_path / "store"
    subprocess.run(KSFS + ["--store", str(store), "import", "s", "c1", str(src)], check=True,
                   capture_output=True, preexec_fn=lambda: os.umask(0))
    made = [store, *store.rglob("*")]
    writable = [p for p in made
                if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) & 0o022]
    assert not writable, [(str(p), oct(p.stat().st_mode)) for p in writable]
    assert len(made) > 5


def test_a_machine_directory_planted_as_a_symlink_is_refused(tmp_path: Path) -> None:
    """QA (fifteenth session): `session new` followed a symlink planted at vm/SESSION, wrote
    the machine's disk and memory where it pointed, and `session rm` left them there."""
    from tests.cli_helpers import guest_dir

    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    elsewhere.mkdir()
    src = tmp_path / "notes.txt"
    src.write_text("notes\n")
    ksfs(store, None, "import", "x", "c1", str(src))
    (store / "vm").mkdir(exist_ok=True)
    (store / "vm" / "planted").symlink_to(elsewhere)
    # what it points at names a file elsewhere as a hand-back's leftover: never removed
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (elsewhere / "state.json").write_text(json.dumps({"domain": "ksfs-planted", "disks": {
        "vda": {"root": "/x", "root_fmt": "raw", "base_checkpoint": None,
                "handing_back": {"top": "/x", "tmp": str(victim)}}}}))
    res = ksfs(store, None, "session", "new", "planted", "--guest", str(guest_dir()),
               check=False)
    if res.returncode == 0:  # the bug back: its machine must not outlive the test
        ksfs(store, None, "session", "rm", "planted", check=False)
    assert res.returncode == 10, res
    assert "is a symbolic link" in res.stderr and len(res.stderr.splitlines()) == 1
    assert [p.name for p in elsewhere.iterdir()] == ["state.json"]
    assert victim.read_text() == "keep me\n"  # (the review: it was deleted as root)
    assert not (store / "vm" / "planted").exists()  # the link itself went
    # nor is the token file written for its start left (review: it outlived the session)
    assert list((store / "guest-tokens").iterdir()) == []
    listed = json.loads(ksfs(store, None, "session", "list", "--json").stdout)
    assert [s["session"] for s in listed] == ["x"], listed


def test_a_link_for_guest_tokens_is_damage_and_one_for_vm_keeps_its_mode(tmp_path: Path) -> None:
    """Security QA (twenty-second session), root on a store its owner could plant links in:
    F12, guest-tokens -> elsewhere had the token files made and deleted there; F11, vm ->
    elsewhere had that directory made 0755 (vm -> /root opened /root to every user). Now a
    guest-tokens that is no directory of its own is damage (exit 6, one line, no machine
    left), and a vm link, the user's choice of place, keeps the mode its target has."""
    import os
    import stat
    import uuid

    from tests.cli_helpers import guest_dir, remove_sessions, virsh

    guest = guest_dir()
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    src = tmp_path / "notes.txt"
    src.write_text("notes\n")
    ksfs(store, None, "import", "x", "c1", str(src))
    name = f"tokens-{uuid.uuid4().hex[:6]}"
    (store / "guest-tokens").symlink_to(elsewhere)
    try:
        res = ksfs(store, None, "session", "new", name, "--guest", str(guest), check=False)
        assert res.returncode == 6, res
        assert f"{store / 'guest-tokens'} is a symbolic link" in res.stderr, res.stderr
        assert len(res.stderr.splitlines()) == 1, res.stderr
        assert list(elsewhere.iterdir()) == []
        assert virsh("domstate", f"ksfs-{name}").returncode != 0  # no machine left
        listed = json.loads(ksfs(store, None, "session", "list", "--json").stdout)
        assert [s["session"] for s in listed] == ["x"], listed
        (store / "guest-tokens").unlink()
        machines = store / "vm"
        if machines.exists():
            os.rename(machines, tmp_path / "vm-was")
        machines.symlink_to(elsewhere)
        ksfs(store, None, "session", "new", name, "--guest", str(guest))
        assert (elsewhere / name / "state.json").exists()
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700
    finally:
        remove_sessions(store, None, [f"ksfs-{name}"])


def test_the_help_names_every_exit_code_of_the_error_family(tmp_path: Path) -> None:
    """`ksfs --help` lists the exit codes scripts lean on: each class of the one error family
    has its code there (14, DaemonTimeout's, was left out when it came)."""
    import re

    import ksfs.errors as errors

    def family(cls):
        yield cls
        for sub in cls.__subclasses__():
            yield from family(sub)

    codes = {c.exit_code for c in family(errors.KsfsError)}
    text = " ".join(ksfs(tmp_path / "store", None, "--help").stdout.split())
    listed = text.split("Exit codes:", 1)[1]
    said = {int(n) for n in re.findall(r"(?:^|, )(\d+) ", listed.split(".", 1)[0])}
    assert codes <= said, sorted(codes - said)
