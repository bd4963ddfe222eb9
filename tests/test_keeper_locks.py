"""The lock of a session a verb is about to make leaves no file when the verb is refused and
made no session (QA: refused forks, session new and adopts each left STORE/locks/<hash>.lock);
the real verbs are in tests/test_keeper_vm_qa.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ksfs.keeper.locks import drop_session_lock, new_session_lock, session_lock


def files(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "locks").iterdir())


def test_a_refused_verb_leaves_no_lock_file(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    with session_lock(store, "other"):
        pass
    before = files(store)
    with pytest.raises(RuntimeError):
        with new_session_lock(store, "x", lambda: False):
            raise RuntimeError("refused")
    assert files(store) == before
    # made after all (or cannot tell): the file stays, it is the session's
    for made in (lambda: True, lambda: 1 / 0):
        with pytest.raises(RuntimeError):
            with new_session_lock(store, "y", made):
                raise RuntimeError("failed later")
        assert len(files(store)) == len(before) + 1
        drop_session_lock(store, "y")
    with new_session_lock(store, "z", lambda: False):
        pass  # done: the verb made its session
    assert len(files(store)) == len(before) + 1


def test_a_file_dropped_meanwhile_and_made_again_is_not_removed(tmp_path: Path) -> None:
    """A failure that removed the session dropped the lock already; a new holder's file by
    that name must stay."""
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(RuntimeError):
        with new_session_lock(store, "x", lambda: False):
            drop_session_lock(store, "x")
            with session_lock(store, "x"):  # a new file, as a waiter would make
                pass
            raise RuntimeError("refused")
    assert len(files(store)) == 1
