"""Names the daemon changes show at once through its mount.

A checkpoint's name is cached by the kernel for a second; when the daemon itself publishes or
deletes a checkpoint (a CLI verb through its control socket, an rmdir) it drops that cached
entry at once, so a name deleted and taken again never shows the old checkpoint's files."""

from __future__ import annotations

import os

from tests.cli_helpers import daemon_mount, ksfs


def test_a_name_deleted_and_taken_again_shows_the_new_files_at_once(tmp_path):
    env = dict(os.environ, KSFS_GUEST="")
    src = tmp_path / "f.img"
    with daemon_mount(tmp_path, env) as (store, mnt):
        f = mnt / "sessions" / "re" / "checkpoints" / "c" / "f.img"
        for round_ in range(3):
            data = f"version {round_}\n".encode()
            src.write_bytes(data)
            ksfs(store, env, "import", "re", "c", str(src))  # through the daemon
            assert f.read_bytes() == data, round_
            ksfs(store, env, "rm", "re", "c")
            assert not f.exists()


def test_a_session_removed_and_made_again_shows_its_new_checkpoints_at_once(tmp_path):
    env = dict(os.environ, KSFS_GUEST="")
    src = tmp_path / "f.img"
    with daemon_mount(tmp_path, env) as (store, mnt):
        f = mnt / "sessions" / "again" / "checkpoints" / "c" / "f.img"
        for round_ in range(3):
            data = f"session {round_}\n".encode()
            src.write_bytes(data)
            ksfs(store, env, "import", "again", "c", str(src))
            assert f.read_bytes() == data, round_
            ksfs(store, env, "session", "rm", "again")  # through the daemon
            assert "again" not in os.listdir(mnt / "sessions")
