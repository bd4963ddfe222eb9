"""What a session's guest is told about its gateway: a port fixed at creation and a token.

The token is a keyed BLAKE3 of the session's lineage under the store's secret (``STORE/secret``,
mode 0600): it is computed when needed, so no file, event or ledger field of its own holds it, and
a fork, with its new lineage, gets its own. The guest reads both through QEMU's fw_cfg
(``opt/ksfs/gateway``, ``opt/ksfs/token``), which a start, restore or fork sets afresh: a forked
guest therefore talks to its own session's port even though its memory came from the parent.
The token reaches QEMU as a file (``STORE/guest-tokens/LINEAGE``, mode 0600, in a 0700
directory), never as text in the domain's XML: QA (fifteenth session) found that libvirt
passes a text entry on QEMU's command line, which every local user may read in /proc, and
checkpoints keep the XML of their instant. Whoever can read that file (root) or the store's
secret can still act as the session.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import blake3

from ksfs.errors import StoreDamaged, from_os_error
from ksfs.regularfile import is_store_dir, read_store_file, require_store_dir

GUEST_GATEWAY_HOST = "10.0.2.2"  # the host's loopback as QEMU user networking shows it
TOKENS_DIR = "guest-tokens"
log = logging.getLogger("ksfs.keeper")


class GuestLink:
    def _secret(self) -> bytes:
        # Never through a link (a secret -> /etc/shadow would key every token on its bytes)
        # nor waiting on a FIFO: anything but a regular file there is damage.
        path = self.store_path / "secret"
        try:
            return read_store_file(path, self.store_path)
        except FileNotFoundError:
            pass
        key = os.urandom(32)  # what secrets.token_bytes does
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except FileExistsError:  # pragma: no cover - a concurrent first use
            return read_store_file(path, self.store_path)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        return key

    def gateway_token(self, lineage: str) -> str:
        return blake3.blake3(lineage.encode(), key=self._secret()).hexdigest()[:32]

    def allocate_gateway_port(self) -> int:
        """A loopback port free now and given to no other session of this store."""
        import socket  # here: every command loads the keeper, few allocate a port

        taken = {s.config.get("gateway_port") for s in self.ledger.sessions(include_removed=True)}
        for _ in range(100):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in taken:
                return port
        raise RuntimeError("no free loopback port for the gateway")

    def guest_facts(self, rec: Any) -> dict[str, str | Path]:
        """fw_cfg entries for a session's domain: its gateway URL, and its token's file."""
        port = rec.config.get("gateway_port")
        if not port:
            return {}
        return {
            "opt/ksfs/gateway": f"http://{GUEST_GATEWAY_HOST}:{port}",
            "opt/ksfs/token": self._token_file(rec.lineage),
        }

    def _token_file(self, lineage: str) -> Path:
        """The file QEMU reads ``lineage``'s token from, written when missing or stale."""
        tokens = self.store_path / TOKENS_DIR
        require_store_dir(tokens, self.store_path)
        tokens.mkdir(mode=0o700, exist_ok=True)
        path = tokens / lineage
        token = self.gateway_token(lineage)
        try:
            if read_store_file(path, self.store_path) == token.encode():
                return path
        except (FileNotFoundError, StoreDamaged):
            pass  # written anew below: the rename replaces a link or FIFO, never follows it
        tmp = tokens / f".{lineage}.tmp"
        try:
            tmp.unlink(missing_ok=True)  # O_EXCL: a hard link planted there is not truncated
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                os.write(fd, token.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise from_os_error(exc, "write the guest's gateway token", str(path)) from exc
        return path

    def drop_token_file(self, lineage: str) -> None:
        """Remove a removed session's token file (its gateway is no longer served)."""
        tokens = self.store_path / TOKENS_DIR
        if not is_store_dir(tokens):  # a link there: nothing of ours is where it points
            return
        with contextlib.suppress(FileNotFoundError):
            (tokens / lineage).unlink()

    def gateway_listens(self) -> None:
        """Before a new session's guest first runs (session new, fork): with a daemon serving
        gateways, return once its gateway listens, so the guest's first call is not refused
        (its server used to start on the daemon's next poll, up to half a second later). A
        watcher that fails is said and passed by: the poll still starts the server."""
        watcher = getattr(self, "gateway_watcher", None)
        if watcher is None:
            return
        try:
            watcher()
        except Exception as exc:  # (the guest runs anyway: its calls are retried)
            log.warning("could not wait for the new session's gateway to listen: %s", exc)

    def gateway_targets(self) -> dict[str, tuple[int, str]]:
        """session -> (port, token) of every live machine session (for the daemon)."""
        return {
            s.name: (s.config["gateway_port"], self.gateway_token(s.lineage))
            for s in self.ledger.sessions()
            if s.domain and s.config.get("gateway_port")
        }
