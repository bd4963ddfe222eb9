"""Root running ksfs on a store a user can write into: what the user planted there (a symbolic
link, a hard link, a FIFO) must not make ksfs write to another file, read another file, or hang.
Each planted link names a victim file under tmp_path: it must be left as it was, and no file
made where it points. Each planted FIFO must end the command within its timeout, exit 6 (the
store is damaged) in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

KSFS = [sys.executable, "-m", "ksfs.cli"]
VICTIM = b"ORIGINAL VICTIM\n"


def ksfs(store: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(200_000))
    res = ksfs(store, "import", "demo", "c1", str(data))
    assert res.returncode == 0, res.stderr
    return store


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victims" / "v"
    victim.parent.mkdir()
    victim.write_bytes(VICTIM)
    return victim


def damaged(res: subprocess.CompletedProcess, name: str) -> None:
    """Exit 6, said in one line naming ``name``."""
    assert res.returncode == 6, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], res.stderr


def plant_link(where: Path, victim: Path) -> None:
    if where.exists() or where.is_symlink():
        where.unlink()
    where.symlink_to(victim)


@pytest.mark.parametrize("name", ["lock.mdb", "data.mdb"])
def test_an_index_file_link_is_damage_and_its_target_untouched(store: Path, victim: Path,
                                                                 name: str) -> None:
    plant_link(store / "index" / name, victim)
    damaged(ksfs(store, "stats"), name)
    assert victim.read_bytes() == VICTIM


def test_an_index_file_hard_link_is_damage(store: Path, tmp_path: Path) -> None:
    os.link(store / "index" / "lock.mdb", tmp_path / "other")
    damaged(ksfs(store, "stats"), "lock.mdb")


def test_an_index_directory_link_is_damage(store: Path, tmp_path: Path) -> None:
    """Even to the store's own index, moved: LMDB would make and write files wherever it is."""
    moved = tmp_path / "victims" / "index"
    moved.parent.mkdir()
    (store / "index").rename(moved)
    (store / "index").symlink_to(moved)
    before = {p.name: p.read_bytes() for p in moved.iterdir()}
    damaged(ksfs(store, "stats"), "index")
    assert {p.name: p.read_bytes() for p in moved.iterdir()} == before


def test_a_marker_link_is_damage_and_not_followed(store: Path, victim: Path) -> None:
    marker = store / "ksfs.json"
    victim.write_bytes(marker.read_bytes())  # a good marker: only the link is wrong
    plant_link(marker, victim)
    damaged(ksfs(store, "stats"), "ksfs.json")


def test_a_marker_fifo_is_damage_not_a_hang(store: Path) -> None:
    marker = store / "ksfs.json"
    marker.unlink()
    os.mkfifo(marker)
    damaged(ksfs(store, "stats", timeout=30), "ksfs.json")


def only_pack(store: Path) -> Path:
    [pack] = (store / "packs").iterdir()
    return pack


def import_more(store: Path, tmp_path: Path) -> None:
    more = tmp_path / "more.bin"
    more.write_bytes(os.urandom(100_000))
    res = ksfs(store, "import", "demo", "c2", str(more))
    assert res.returncode == 0, res.stderr
    got = subprocess.run(KSFS + ["--store", str(store), "cat", "demo", "c2", "more.bin"],
                         capture_output=True, timeout=60)
    assert got.stdout == more.read_bytes(), got.stderr


def test_a_pack_link_is_not_appended_to(store: Path, victim: Path, tmp_path: Path) -> None:
    """A victim as long as the index says the pack is: the old reopen appended to it."""
    pack = only_pack(store)
    victim.write_bytes(b"A" * pack.stat().st_size)
    before = victim.read_bytes()
    plant_link(pack, victim)
    import_more(store, tmp_path)
    assert victim.read_bytes() == before


def test_a_hard_linked_pack_is_not_appended_to(store: Path, tmp_path: Path) -> None:
    pack = only_pack(store)
    other = tmp_path / "victims" / "other"
    other.parent.mkdir()
    os.link(pack, other)
    before = other.read_bytes()
    import_more(store, tmp_path)
    assert other.read_bytes() == before


def test_a_pack_fifo_is_damage_not_a_hang(store: Path) -> None:
    pack = only_pack(store)
    pack.unlink()
    os.mkfifo(pack)
    damaged(ksfs(store, "cat", "demo", "c1", "data.bin", timeout=30), "pack")


def in_subprocess(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: an open that waits on a FIFO ends with the timeout."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def test_a_state_temp_link_is_not_written_through(tmp_path: Path, victim: Path) -> None:
    from ksfs.vm.state import SessionState, load_state, save_state

    session = tmp_path / "vm" / "S"
    session.mkdir(parents=True)
    plant_link(session / "state.json.tmp", victim)
    save_state(session / "state.json", SessionState("ksfs-S", {}, 3))
    assert victim.read_bytes() == VICTIM
    dangling = tmp_path / "victims" / "made"
    plant_link(session / "state.json.tmp", dangling)
    save_state(session / "state.json", SessionState("ksfs-S", {}, 4))
    assert not dangling.exists()
    assert load_state(session / "state.json").counter == 4
    assert not (session / "state.json").is_symlink()


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_a_planted_state_is_refused_in_one_line(tmp_path: Path, victim: Path,
                                                plant: str) -> None:
    from ksfs.vm.state import SessionState, save_state

    state = tmp_path / "vm" / "S" / "state.json"
    state.parent.mkdir(parents=True)
    save_state(victim, SessionState("ksfs-victim", {}, 7))  # a good state: only its place is bad
    if plant == "link":
        state.symlink_to(victim)
    else:
        os.mkfifo(state)
    res = in_subprocess(f"from ksfs.vm.state import load_state\n"
                        f"from ksfs.errors import VMError\n"
                        f"try:\n    load_state(__import__('pathlib').Path({str(state)!r}))\n"
                        f"except VMError as exc:\n    print('VMError', exc)\n")
    assert res.stdout.startswith("VMError") and "state.json" in res.stdout, res
    assert len(res.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize("plant", ["temp-link", "cache-link", "cache-fifo"])
def test_the_domain_type_cache_is_neither_written_through_nor_waited_on(
        tmp_path: Path, victim: Path, plant: str) -> None:
    """Whatever is planted, the probe runs again (a stand-in here) and its result replaces it."""
    cache = tmp_path / "vm" / "domain-type.json"
    cache.parent.mkdir()
    if plant == "temp-link":
        plant_link(cache.with_name("domain-type.json.tmp"), victim)
    elif plant == "cache-link":
        victim.write_text('{"version": 1, "type": "kvm"}\n')
        plant_link(cache, victim)
    else:
        os.mkfifo(cache)
    before = victim.read_bytes()
    res = in_subprocess(f"import os, pathlib\nfrom ksfs.vm import probe\n"
                        f"os.environ.pop('KSFS_DOMAIN_TYPE', None)\n"
                        f"probe.probe = lambda: {{'version': 1, 'type': 'qemu'}}\n"
                        f"print(probe.domain_type(pathlib.Path({str(cache)!r})))\n")
    assert res.stdout.strip() == "qemu", res
    assert victim.read_bytes() == before
    assert not cache.is_symlink() and b'"qemu"' in cache.read_bytes()


def guest_link(store: Path):
    from ksfs.keeper.guestlink import GuestLink

    link = GuestLink.__new__(GuestLink)  # a mixin of Keeper: the secret needs only the store
    link.store_path = store
    return link


def test_a_secret_link_is_damage_not_a_key(tmp_path: Path, victim: Path) -> None:
    from ksfs.errors import StoreDamaged

    store = tmp_path / "store"
    store.mkdir()
    plant_link(store / "secret", victim)
    with pytest.raises(StoreDamaged, match="secret"):
        guest_link(store).gateway_token("ab" * 16)
    assert victim.read_bytes() == VICTIM


def test_a_secret_fifo_is_damage_not_a_hang(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    os.mkfifo(store / "secret")
    res = in_subprocess(f"from ksfs.keeper.guestlink import GuestLink\n"
                        f"from ksfs.errors import StoreDamaged\n"
                        f"g = GuestLink.__new__(GuestLink)\n"
                        f"g.store_path = __import__('pathlib').Path({str(store)!r})\n"
                        f"try:\n    g.gateway_token('ab' * 16)\n"
                        f"except StoreDamaged as exc:\n    print('StoreDamaged', exc)\n")
    assert res.stdout.startswith("StoreDamaged") and "secret" in res.stdout, res


def test_a_config_fifo_is_damage_not_a_hang(store: Path) -> None:
    os.mkfifo(store / "config.json")
    env = {k: v for k, v in os.environ.items() if k not in ("KSFS_GUEST", "KSFS_UPSTREAM")}
    res = subprocess.run(KSFS + ["--store", str(store), "session", "new", "plq-cfg"],
                         capture_output=True, text=True, timeout=30, env=env)
    damaged(res, "config.json")
    res = in_subprocess(f"import os, pathlib\nos.environ.pop('KSFS_UPSTREAM', None)\n"
                        f"from ksfs.daemon.run import upstream_url\n"
                        f"from ksfs.errors import StoreDamaged\n"
                        f"try:\n    upstream_url(pathlib.Path({str(store)!r}), None)\n"
                        f"except StoreDamaged as exc:\n    print('StoreDamaged', exc)\n")
    assert res.stdout.startswith("StoreDamaged") and "config.json" in res.stdout, res


def test_a_config_link_is_not_followed(store: Path, victim: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    victim.write_text('{"upstream": "http://victim.invalid/"}\n')
    plant_link(store / "config.json", victim)
    from ksfs.daemon.run import upstream_url
    from ksfs.errors import StoreDamaged

    monkeypatch.delenv("KSFS_UPSTREAM", raising=False)
    with pytest.raises(StoreDamaged, match="config.json"):
        upstream_url(store, None)


@pytest.mark.parametrize("name", ["lock", "index"])
def test_a_new_store_is_not_made_through_a_link_in_a_prepared_directory(tmp_path: Path,
                                                                        name: str) -> None:
    """Security QA F15 (twenty-second session): `ksfs import` into an empty directory someone
    prepared with `lock -> elsewhere/made-by-lock` made root's 0600 file there, and with
    `index -> elsewhere` LMDB's files there. Now no store is made: one line, exit 5, nothing
    made where the link points."""
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(10_000))
    (store / name).symlink_to(elsewhere / "made-by-lock" if name == "lock" else elsewhere)
    res = ksfs(store, "import", "demo", "c1", str(data))
    assert res.returncode == 5, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"its {name} is a symbolic link" in lines[0], res.stderr
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in store.iterdir()) == [name]
