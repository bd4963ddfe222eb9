"""Recover and the intents a killed verb left in the log, against a real guest: a `session rm`
cut short that the user went on from is abandoned, not finished; a restore cut short before it
touched the machine, after which the user went on, does not send the machine back to its target.

One booted session is shared by the module (forks of it for the removals); every domain made
here is destroyed and undefined at the end, even on failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.cli_helpers import guest_dir, remove_sessions, virsh
from tests.guest import guest_writes
from tests.test_keeper_vm import events_of, run, save

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    store = tmp_path_factory.mktemp("intents") / "store"
    e = dict(os.environ, KSFS_GUEST=str(guest_dir()))
    made: list[str] = []
    yield {"store": store, "env": e, "tag": uuid.uuid4().hex[:6], "made": made}
    remove_sessions(store, e, made)
    shutil.rmtree(store, ignore_errors=True)


@pytest.fixture(scope="module")
def agent(env) -> str:
    name = f"intent-{env['tag']}"
    env["made"].append(name)
    run(env["store"], "session", "new", name, env=env["env"])
    return name


def fork(env: dict, agent: str, prefix: str) -> str:
    store, e = env["store"], env["env"]
    new = f"{prefix}-{env['tag']}"
    env["made"].append(new)
    run(store, "fork", agent, save(store, agent, e), new, env=e)
    return new


def recover(store: Path, e: dict, session: str) -> list[str]:
    report = json.loads(run(store, "recover", "--json", env=e).stdout)
    mine = [r for r in report if r["session"] == session]
    assert not mine or not mine[0]["failed"], report
    return mine[0]["actions"] if mine else []


def checkpoints(store: Path, e: dict, session: str) -> list[str]:
    return [c["name"] for c in json.loads(run(store, "checkpoints", session, "--json",
                                              env=e).stdout)]


def listed(store: Path, e: dict) -> set[str]:
    return {s["session"] for s in json.loads(run(store, "session", "list", "--json",
                                                 env=e).stdout)}


def test_a_killed_session_rm_after_which_the_session_was_restored_is_not_finished(
        env, agent: str) -> None:
    """QA 2, variant A: `session rm f` killed once the machine was gone; the user restored f
    and saved 'important'; recover then finished the removal: every checkpoint went."""
    store, e = env["store"], env["env"]
    f = fork(env, agent, "rmA")
    save(store, f, e, "f1")
    res = run(store, "session", "rm", f, check=False,
              env=dict(e, KSFS_CRASH_AT="session.remove"))
    assert res.returncode == -signal.SIGKILL
    assert virsh("domstate", f"ksfs-{f}").returncode != 0  # the machine is gone
    assert f in listed(store, e)
    res = run(store, "save", f, check=False, env=e)
    # the two ways on, and which is which (the hint said "restore (or recover) makes it
    # again", and recover finished the removal)
    assert res.returncode == 10, res.stderr
    assert f"`ksfs session rm {f}` (or `ksfs recover`) finishes the removal, `ksfs restore {f} " \
        f"CHECKPOINT` makes the machine again and keeps the session" in res.stderr, res.stderr
    run(store, "restore", f, "f1", env=e)
    save(store, f, e, "important")
    actions = recover(store, e, f)
    assert any(a.startswith("removal begun at seq") and "removal abandoned" in a
               for a in actions), actions
    assert not any(re.match(r"removal begun at seq \d+ finished", a) for a in actions), actions
    assert f in listed(store, e)
    assert {"f1", "important"} <= set(checkpoints(store, e, f))
    assert virsh("domstate", f"ksfs-{f}").stdout.strip() == "running"
    last = [ev for ev in events_of(store, f, e) if ev["type"].startswith("session.remov")][-1]
    assert last["type"] == "session.remove_failed" and \
        last["body"]["reason"].startswith("abandoned"), last
    assert recover(store, e, f) == []  # said once
    save(store, f, e)  # the session works on
    # and a removal asked for again is done in full
    run(store, "session", "rm", f, env=e)
    assert f not in listed(store, e)
    assert virsh("domstate", f"ksfs-{f}").returncode != 0


def test_a_session_rm_killed_before_it_destroyed_anything_then_used_is_kept(
        env, agent: str) -> None:
    """QA 2, variant B: `session rm` killed right after its session.removing committed, the
    machine still running; the user saved and forked; the next recover (the mount's start)
    destroyed the machine and deleted the new work."""
    store, e = env["store"], env["env"]
    f = fork(env, agent, "rmB")
    # The state such a kill leaves: the intent committed, nothing else done (no crash point
    # lies between the commit and the destroy, so the event is written as `session rm` does).
    code = ("import sys\nfrom ksfs.keeper import Keeper\n"
            "Keeper(sys.argv[1]).ledger.record(sys.argv[2], 'session.removing', "
            "{'keep_checkpoints': False})\n")
    subprocess.run([sys.executable, "-c", code, str(store), f], check=True, env=e)
    assert virsh("domstate", f"ksfs-{f}").stdout.strip() == "running"
    save(store, f, e, "work")
    child = f"{f}-child"
    env["made"].append(child)
    run(store, "fork", f, "work", child, env=e)
    actions = recover(store, e, f)
    assert any("removal abandoned" in a for a in actions), actions
    assert virsh("domstate", f"ksfs-{f}").stdout.strip() == "running"
    assert "work" in checkpoints(store, e, f) and {f, child} <= listed(store, e)
    run(store, "session", "rm", child, env=e)
    run(store, "session", "rm", f, env=e)


def test_a_killed_removal_nothing_came_after_is_still_finished(env, agent: str) -> None:
    """The intent stays whole: a `session rm` killed after the machine went, with nothing of
    the user's after it (a model call of the guest's does not count), is finished by recover."""
    store, e = env["store"], env["env"]
    f = fork(env, agent, "rmC")
    res = run(store, "session", "rm", f, check=False,
              env=dict(e, KSFS_CRASH_AT="session.remove"))
    assert res.returncode == -signal.SIGKILL
    code = ("import sys\nfrom ksfs.keeper import Keeper\n"
            "Keeper(sys.argv[1]).ledger.record(sys.argv[2], 'gateway.call', {'key': 'k'})\n")
    subprocess.run([sys.executable, "-c", code, str(store), f], check=True, env=e)
    actions = recover(store, e, f)
    assert actions and actions[0].startswith("removal begun at seq") and \
        "finished" in actions[0], actions
    assert f not in listed(store, e)


def test_recover_after_a_stale_killed_restore_brings_back_the_newest_save(env, agent: str
                                                                          ) -> None:
    """QA 3: a restore to a1 killed before it touched the machine (left paused); the user
    resumed and saved a3; the machine died; recover restored a1, the killed restore's target,
    instead of a3."""
    store, e = env["store"], env["env"]
    save(store, agent, e, "a1")
    guest_writes(store, agent, 3)
    save(store, agent, e, "a2")
    res = run(store, "restore", agent, "a1", check=False,
              env=dict(e, KSFS_CRASH_AT="restore.staged"))
    assert res.returncode == -signal.SIGKILL
    assert virsh("domstate", f"ksfs-{agent}").stdout.strip() == "paused"
    run(store, "resume", agent, env=e)
    guest_writes(store, agent, 3)
    save(store, agent, e, "a3")
    virsh("destroy", f"ksfs-{agent}")
    actions = recover(store, e, agent)
    assert any("restore to a1 begun at seq" in a and "marked failed" in a and "went on" in a
               for a in actions), actions
    assert actions[-1].endswith("restored to checkpoint a3"), actions
    assert virsh("domstate", f"ksfs-{agent}").stdout.strip() == "running"
    done = [ev for ev in events_of(store, agent, e) if ev["type"] == "restore.done"][-1]
    assert done["body"]["checkpoint"] == "a3"
    save(store, agent, e)


def test_recover_after_a_killed_restore_with_nothing_after_it_still_restores_its_target(
        env, agent: str) -> None:
    """The target of a restore killed once the machine was gone, nothing after it, still
    wins: recover finishes what the user asked for."""
    store, e = env["store"], env["env"]
    save(store, agent, e, "b1")
    save(store, agent, e, "b2")
    res = run(store, "restore", agent, "b1", check=False,
              env=dict(e, KSFS_CRASH_AT="restore.staged"))
    assert res.returncode == -signal.SIGKILL
    virsh("destroy", f"ksfs-{agent}")
    actions = recover(store, e, agent)
    assert any(re.fullmatch(r"restore to b1 begun at seq \d+ marked failed", a)
               for a in actions), actions
    assert actions[-1].endswith("restored to checkpoint b1"), actions
    assert virsh("domstate", f"ksfs-{agent}").stdout.strip() == "running"
