"""Bad input changes nothing and is refused in one clear sentence: hypothesis fuzzing of every
CLI argument that names a session, checkpoint or file, and of every control file of a real mount.

CLI: each refusal is exactly one line on stderr (``ksfs: error: ...``) and a documented exit code
other than 1 (1 is "other error", a bug for bad input). Mount: each refused operation fails with
an errno that says why (EINVAL, ENOENT, EEXIST, EPERM, EROFS, EACCES, ...), never EIO. Before and
after each run the store's file listing (packs with sizes), ``ksfs stats --json`` and every
session's events apart from ``input.rejected`` (and ``fs.unreadable``, a note made when a lookup
finds a checkpoint's disk unreadable as ext4) are identical. An offline store (import-made
sessions) is enough: verbs that need a machine refuse before any VM work.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mount_helpers import mounted

from ksfs.keeper import Keeper

KSFS = [sys.executable, "-m", "ksfs.cli"]
SESSIONS = ("alpha", "beta")
CHECKPOINTS = ("c1", "c2")
# Documented exit codes of bad input (ksfs --help): 2 bad input, 3 not found, 4 exists,
# 12 not permitted / read-only. 5-11 and 13 say the store, VM or daemon failed: not expected.
BAD_INPUT_CODES = {2, 3, 4, 12}

CLI_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=0, max_size=40,
) | st.sampled_from(["..", ".", "../x", "/etc/passwd", "a/b", "x" * 300, "é" * 200, " ",
                     "-", "--", "-h", "\n", "c1/../../x", "alpha", "c1", "memory"])
SAFE_SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("badinput")
    src = root / "src"
    src.mkdir()
    rnd = random.Random(3)
    (src / "memory").write_bytes(rnd.randbytes(200_000))
    (src / "disk.raw").write_bytes(rnd.randbytes(300_000))
    path = root / "store"
    with Keeper(path, create=True) as k:
        for s in SESSIONS:
            for c in CHECKPOINTS:
                k.import_files(s, c, [src / "memory"], disks=[src / "disk.raw"])
    return path


def ksfs(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                          timeout=120, cwd=store.parent)


def snapshot(store: Path) -> dict:
    """What bad input must not change: files (packs with sizes), stats, events."""
    files = sorted(
        (str(p.relative_to(store)), p.stat().st_size if p.suffix == ".pack" else None)
        for p in store.rglob("*")
        if p.is_file() and p.parts[len(store.parts)] not in ("index",)
        and p.name not in ("daemon.log", "daemon.pid", "daemon.sock", "daemon.lock")
    )
    stats = json.loads(ksfs(store, "stats", "--json").stdout)
    with Keeper(store) as k:
        # input.rejected records the refusal itself; fs.unreadable is the mount noting, once,
        # that a looked-up checkpoint's fs/ cannot be read (these disks are random bytes).
        events = {s.name: [(e.seq, e.type, e.body) for e in k.ledger.events(s.name)
                           if e.type not in ("input.rejected", "fs.unreadable")]
                  for s in k.ledger.sessions(include_removed=True)}
    return {"files": files, "stats": stats, "events": events}


def one_line_refusal(res: subprocess.CompletedProcess, args: tuple) -> None:
    lines = res.stderr.splitlines()
    assert res.returncode in BAD_INPUT_CODES, (args, res.returncode, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("ksfs: error: "), (args, res.stderr)
    # a sentence, not a dump: at most the offending value quoted once plus the reason
    assert len(lines[0]) < 300 + max((len(str(a)) for a in args), default=0), (args, lines[0])


# --- the command line ------------------------------------------------------------------------

COMMANDS = {
    # command -> how many free-text arguments it takes (sessions, checkpoints, files, names)
    "cat": 3, "rm": 2, "restore": 2, "fork": 3, "events": 1, "checkpoints": 1, "lineage": 1,
    "diff": 3, "save": 2, "pause": 1, "resume": 1, "import": 3, "usage": 1,
    "budget": 2,  # SESSION --tokens WORD
}


def test_cli_arguments(store: Path) -> None:
    before = snapshot(store)
    tried = {"n": 0}

    @SAFE_SETTINGS
    @given(st.sampled_from(sorted(COMMANDS)), st.lists(CLI_TEXT, min_size=3, max_size=3))
    def fuzz(command: str, words: list[str]) -> None:
        args = list(words[: COMMANDS[command]])
        if command == "import":
            # never an existing file: a random path relative to an empty directory
            args[2] = f"no-such-dir/{args[2]}"
        if command in ("rm",) and args[0] in SESSIONS and args[1] in CHECKPOINTS:
            args[1] += "-not"
        if command == "import" and args[0] in SESSIONS and args[1] in CHECKPOINTS:
            args[1] += "-not"
        if command == "budget":
            if args[0] in SESSIONS:
                args[0] += "-not"  # a real session's budget may be set: not bad input
            args = [args[0], "--tokens", args[1]]
            res = ksfs(store, command, *args)
        else:
            res = ksfs(store, command, "--", *args)
        tried["n"] += 1
        if command in ("cat", "events", "checkpoints", "lineage", "diff", "usage") and \
                res.returncode == 0:
            return  # it named real things: reading is not bad input
        one_line_refusal(res, (command, *args))

    fuzz()
    # Names that cannot go through argv (NUL) or that click would parse as options.
    for args in (("cat", "-x", "c1", "memory"), ("rm", "--bogus", "c1"), ("events",),
                 ("budget", "alpha", "--bogus")):
        res = ksfs(store, *args)
        one_line_refusal(res, args)
        tried["n"] += 1
    assert snapshot(store) == before
    test_cli_arguments.tried = tried["n"]


def test_session_names_through_every_verb_refused_the_same_way(store: Path) -> None:
    """The same bad name gets the same sentence and code from each verb (one checker)."""
    bad = ["..", "a/b", "x" * 300, "tab\there"]
    for name in bad:
        codes = set()
        for cmd in (["events", name], ["checkpoints", name], ["save", name], ["pause", name],
                    ["rm", name, "c1"], ["cat", name, "c1", "memory"], ["lineage", name]):
            res = ksfs(store, *cmd)
            one_line_refusal(res, tuple(cmd))
            codes.add(res.returncode)
        assert codes <= {2, 3}, (name, codes)


def test_cat_refuses_bad_names_as_bad_input(store: Path) -> None:
    """A name no checkpoint could have is bad input (exit 2), as for rm and import, not
    "not found" (exit 3)."""
    session, checkpoint = sorted(SESSIONS)[0], sorted(CHECKPOINTS)[0]
    for args in ((session, checkpoint, ".."), (session, checkpoint, ""),
                 (session, checkpoint, "../c1/memory"), (session, "..", "memory"),
                 ("..", checkpoint, "memory"), (session, checkpoint, "x" * 256)):
        res = ksfs(store, "cat", "--", *args)
        one_line_refusal(res, args)
        assert res.returncode == 2, (args, res.stderr)


# --- the mount ---------------------------------------------------------------------------------

MOUNT_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/"),
    min_size=1, max_size=30,
) | st.sampled_from([".", "..", "x" * 256, "é" * 130, "\n", " ", "c1", "alpha"])
REFUSED = {errno.EINVAL, errno.ENOENT, errno.EEXIST, errno.EPERM, errno.EROFS, errno.EACCES,
           errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.EBADF}


def refused(fn, what: str) -> int:
    try:
        fn()
    except OSError as exc:
        assert exc.errno in REFUSED, (what, exc)
        return exc.errno
    raise AssertionError(f"{what} was accepted")


def test_mount_control_files(store: Path) -> None:
    env = {"KSFS_GUEST": ""}  # no guest template: mkdir sessions/NAME cannot boot anything
    before = snapshot(store)
    seen: dict[str, set[int]] = {}
    with mounted(store, env) as mnt:
        sessions = mnt / "sessions"
        cps = sessions / "alpha" / "checkpoints"

        @settings(max_examples=60, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(["mkdir-session", "mkdir-checkpoint", "mkdir-fork", "rmdir",
                                "resume-text", "resume-bytes", "write-ro", "create", "unlink"]),
               MOUNT_TEXT, st.binary(min_size=1, max_size=300))
        def fuzz(op: str, name: str, data: bytes) -> None:
            if op == "mkdir-session":
                if name in SESSIONS:
                    name += "-x"
                code = refused(lambda: os.mkdir(sessions / name), op)
            elif op == "mkdir-checkpoint":
                code = refused(lambda: os.mkdir(cps / name), op)
            elif op == "mkdir-fork":
                code = refused(lambda: os.mkdir(cps / "c1" / "forks" / name), op)
            elif op == "rmdir":
                if name in CHECKPOINTS:
                    name += "-x"
                code = refused(lambda: os.rmdir(cps / name), op)
            elif op in ("resume-text", "resume-bytes"):
                payload = (name + "\n").encode() if op == "resume-text" else data

                def write() -> None:
                    with open(sessions / "alpha" / "resume", "wb") as f:
                        f.write(payload)
                code = refused(write, op)
            elif op == "write-ro":
                target = random.Random(name).choice(
                    [cps / "c1" / "memory", cps / "c1" / "disk.raw", sessions / "alpha" / "status",
                     sessions / "alpha" / "events", cps / "c1" / "meta.json"])

                def write_ro() -> None:
                    with open(target, "r+b") as f:
                        f.write(data or b"x")
                code = refused(write_ro, op)
            elif op == "create":
                code = refused(lambda: open(cps / "c1" / name, "xb").close(), op)
            else:
                code = refused(lambda: os.unlink(cps / "c1" / "memory"), op)
            seen.setdefault(op, set()).add(code)

        fuzz()
        # Still reads back as it did: the bad input did not disturb the data.
        assert (cps / "c1" / "memory").stat().st_size == 200_000
    assert snapshot(store) == before, "bad input changed the store"
    assert set(seen) >= {"mkdir-session", "mkdir-checkpoint", "rmdir", "resume-text"}
    assert errno.EIO not in set().union(*seen.values())


@pytest.mark.parametrize("args,code", [
    (["session", "new", "a/b", "--guest", "/nonexistent"], 2),
    (["session", "new", "x", "--guest", "/nonexistent"], 3),
])
def test_a_refused_verb_makes_no_store(tmp_path: Path, args: list[str], code: int) -> None:
    """QA (eighteenth session): `session new` refused at a mistyped --store still made a
    whole store there (which later commands then took for one); the directory given empty
    stays empty."""
    for where, existed in ((tmp_path / "typo" / "deeper", False), (tmp_path / "empty", True)):
        if existed:
            where.mkdir()
        res = subprocess.run(KSFS + ["--store", str(where), *args], capture_output=True,
                             text=True)
        assert res.returncode == code, res.stderr
        assert len(res.stderr.splitlines()) == 1, res.stderr
        if existed:
            assert list(where.iterdir()) == []
        else:
            assert not (tmp_path / "typo").exists()
        listed = subprocess.run(KSFS + ["--store", str(where), "session", "list"],
                                capture_output=True, text=True)
        assert listed.returncode == 5, listed  # no store there


def test_a_restore_to_another_sessions_checkpoint_points_at_fork(store: Path) -> None:
    """QA (eighteenth session): "cannot contain '/'" alone, where diff takes OTHER/CP."""
    res = subprocess.run(KSFS + ["--store", str(store), "restore", "alpha", "beta/c1"],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert res.stderr == ("ksfs: error: a restore brings alpha back to one of its own "
                          "checkpoints, not 'beta/c1': `ksfs fork beta c1 NEW` runs that one "
                          "as a session of its own\n"), res.stderr


def test_a_store_in_use_is_never_taken_for_one_made_for_nothing(tmp_path: Path) -> None:
    """Review: two first commands on one new store; the one refused must not remove the store
    the other is making something in."""
    from ksfs.cli import Context, _unused

    path = tmp_path / "new"
    ctx = Context(str(path))
    try:
        ctx.open_keeper(create=True)
        assert _unused(ctx)  # made, empty, no one in a verb on it
        held = ctx.keeper.store.lock(exclusive=False)  # another command's verb
        try:
            assert not _unused(ctx)
        finally:
            os.close(held)
        src = tmp_path / "f.img"
        src.write_bytes(b"x" * 5000)
        ctx.keeper.import_files("s", "c", [src])
        assert not _unused(ctx)  # it holds something now
    finally:
        ctx.close()
