"""Writes to `resume` and listings of vanished directories through a real `ksfs mount` (QA,
twentieth session): a name written in pieces is acted on once, as a whole; the errno of a bad
name reaches the writer, from a shell too; a session directory removed under a shell sitting
in it lists as gone, without an ERROR traceback in the daemon's log.

The sessions here are made by import (no machine), so a restore of a checkpoint they hold is
refused with EPERM ("has no machine"): which name reached the restore, and how often, is told
by the errno and the input.rejected events."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli_helpers import daemon_mount, ksfs

ENV = dict(os.environ, KSFS_GUEST="")


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    base = tmp_path_factory.mktemp("resumewrites")
    src = base / "notes.txt"
    src.write_text("notes\n")
    with daemon_mount(base, ENV) as (store, mnt):
        for name in ("c1", "c10", "d1"):
            ksfs(store, ENV, "import", "s", name, str(src))
        yield {"store": store, "mnt": mnt, "src": src}


def rejections(mnt: Path, session: str, since: int) -> list[dict]:
    lines = (mnt / "sessions" / session / "events").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [e["body"] for e in events if e["seq"] >= since and e["type"] == "input.rejected"]


def next_seq(mnt: Path, session: str) -> int:
    lines = (mnt / "sessions" / session / "events").read_text().splitlines()
    return json.loads(lines[-1])["seq"] + 1


def test_resume_written_in_pieces_is_acted_on_once_with_the_whole_name(mounted) -> None:
    """QA: each write(2) was a restore of its own bytes, at whatever offset: `c` then `1\\n`
    asked for checkpoint `c` (ENOENT at the first write), then for `1`."""
    mnt = mounted["mnt"]
    resume = mnt / "sessions" / "s" / "resume"
    since = next_seq(mnt, "s")
    fd = os.open(resume, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(fd, b"c") == 1  # the beginning of c1 and c10: nothing done yet
        with pytest.raises(OSError) as err:
            os.write(fd, b"1\n")  # c1, whole: the restore is asked for (and refused: no machine)
        assert err.value.errno == errno.EPERM, err.value
        with pytest.raises(OSError) as err:  # one name per open: its refusal stands
            os.write(fd, b"c10\n")
        assert err.value.errno == errno.EPERM, err.value
    finally:
        os.close(fd)
    got = rejections(mnt, "s", since)
    assert [r["value"] for r in got] == ["c1"], got
    assert "has no machine" in got[0]["why"]

    # A write anywhere but where the name goes on is refused, and nothing is restored.
    since = next_seq(mnt, "s")
    fd = os.open(resume, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as err:
            os.pwrite(fd, b"c1\n", 5)
        assert err.value.errno == errno.EINVAL, err.value
    finally:
        os.close(fd)
    got = rejections(mnt, "s", since)
    assert len(got) == 1 and "offset 5" in got[0]["why"], got

    # Appended (>>), the name starts where the first write lands.
    since = next_seq(mnt, "s")
    res = subprocess.run(["bash", "-c", f"printf 'd1\\n' >> '{resume}'"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1 and "Operation not permitted" in res.stderr, res
    assert [r["value"] for r in rejections(mnt, "s", since)] == ["d1"]


def test_the_errno_of_a_bad_name_reaches_the_writer(mounted) -> None:
    """The name is acted on at the write that completes it, so the shell, which reports
    write(2)'s error and ignores close(2)'s, says why; a name still the beginning of another's
    when closed is acted on at the close, whose error close(2) answers."""
    mnt = mounted["mnt"]
    resume = mnt / "sessions" / "s" / "resume"
    for command, said in ((f"echo nosuch > '{resume}'", "No such file or directory"),
                          (f"printf nosuch > '{resume}'", "No such file or directory"),
                          (f"printf 'a/b' > '{resume}'", "Invalid argument"),
                          (f"echo d1 > '{resume}'", "Operation not permitted"),
                          (f"printf d1 > '{resume}'", "Operation not permitted"),
                          (f"{{ printf c; printf '10\\n'; }} > '{resume}'",
                           "Operation not permitted")):
        since = next_seq(mnt, "s")
        res = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 1 and said in res.stderr, (command, res)
        assert len(rejections(mnt, "s", since)) == 1, command
    # Python's close flushes what a failed write left in its buffer once more: the same
    # answer (it was EINVAL, "one checkpoint name per open", for a name that does not exist)
    since = next_seq(mnt, "s")
    with pytest.raises(FileNotFoundError):
        resume.write_text("nosuch\n")
    assert len(rejections(mnt, "s", since)) == 1
    # by hand: a first piece no checkpoint begins with
    fd = os.open(resume, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(fd, b"no") == 2  # (no checkpoint begins so: refused at once)
    except OSError as exc:
        assert exc.errno == errno.ENOENT
    else:
        raise AssertionError("a name no checkpoint begins with was taken")
    finally:
        os.close(fd)
    # c, the beginning of c1 and c10, closed as it is: refused at the close, ENOENT
    since = next_seq(mnt, "s")
    fd = os.open(resume, os.O_WRONLY | os.O_TRUNC)
    assert os.write(fd, b"c") == 1
    with pytest.raises(OSError) as err:
        os.close(fd)
    assert err.value.errno == errno.ENOENT, err.value
    assert [r["value"] for r in rejections(mnt, "s", since)] == ["c"]
    # and an external printf, which checks its close, says so too
    res = subprocess.run(["bash", "-c", f"/usr/bin/printf c > '{resume}'"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1 and "No such file or directory" in res.stderr, res
    assert (mnt / "sessions" / "s" / "resume").read_text().startswith("rejected: ")


def test_a_session_removed_under_a_shell_lists_as_gone_without_a_traceback(mounted) -> None:
    """QA: `ls` in a session directory removed meanwhile logged an ERROR with a traceback for
    each of its files (status, events, usage, resume) and listed them with placeholders."""
    store, mnt, src = mounted["store"], mounted["mnt"], mounted["src"]
    ksfs(store, ENV, "import", "gone", "c1", str(src))
    sess = mnt / "sessions" / "gone"
    assert "status" in os.listdir(sess)
    log_before = len((store / "daemon.log").read_text())
    fd = os.open(sess, os.O_RDONLY | os.O_DIRECTORY)  # a shell sitting in it
    try:
        ksfs(store, ENV, "session", "rm", "gone")
        here = f"/proc/self/fd/{fd}"  # `ls` there: a new opendir of the directory
        for _ in range(2):  # (the second: the kernel may have cached what the first said)
            with pytest.raises(FileNotFoundError):
                os.listdir(here)
        with pytest.raises(FileNotFoundError):
            os.stat("status", dir_fd=fd)
        ksfs(store, ENV, "import", "gone", "c2", str(src))  # the name taken again
        with pytest.raises(FileNotFoundError):
            os.listdir(here)  # still the removed one's directory
        assert os.listdir(mnt / "sessions" / "gone" / "checkpoints") == ["c2"]
    finally:
        os.close(fd)
    said = (store / "daemon.log").read_text()[log_before:]
    assert " ERROR " not in said and "Traceback" not in said, said
