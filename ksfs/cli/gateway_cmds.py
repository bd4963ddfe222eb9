"""Gateway verbs: ``ksfs gateway serve`` (a standalone gateway for one session), ``ksfs usage``
and ``ksfs budget``.

``usage`` reads the store; ``budget`` writes the budget and its ``budget.set`` event in one LMDB
transaction, which a running daemon's gateway sees on its next call. None of them ever prints or
takes an API key on the command line: the key comes from the environment or a file.
"""

from __future__ import annotations

import errno
import ipaddress
import signal
from pathlib import Path
from typing import Any

import click

from ksfs.cli import emit_json, main, pass_ctx
from ksfs.errors import BadInput, NoSuchSession

DEFAULT_SESSION = "default"
BIND_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


@main.group()
def gateway() -> None:
    """The model-call gateway: OpenAI-style chat completions on loopback, bought once per
    idempotency key, replayed after a save, counted per session and held to a budget.

    Example: ksfs gateway serve --upstream http://127.0.0.1:8000 --port 8900
    """


@gateway.command()
@click.option("--upstream", required=True, metavar="URL",
              help="The model provider's base URL, without /v1 (e.g. https://api.openai.com).")
@click.option("--session", "session", default=DEFAULT_SESSION, show_default=True,
              help="The session whose calls this gateway serves (`default` is created if "
                   "missing).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port to listen on (0: any free port; the bound port is printed).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback exposes the gateway to the network.")
@click.option("--prices", type=click.Path(dir_okay=False), default=None,
              help="Price table (TOML, USD per 1M tokens per model); default: the shipped one.")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds one upstream call may take before the guest gets a 504.")
@click.option("--read-timeout", type=float, default=60.0, show_default=True, metavar="S",
              help="Seconds a request's body may go without a byte arriving before the client "
                   "gets a 408 (the whole body also has a bound: the body limit at 16 KiB/s).")
@click.option("--admission-wait", type=float, default=60.0, show_default=True, metavar="S",
              help="Seconds a call held back by calls in flight that may spend what is left of "
                   "the budget waits for room before it gets a 429.")
@click.option("--max-connections", type=click.IntRange(1, None), default=256,
              show_default=True, metavar="N",
              help="Requests read or answered at once; past it a new one gets a 503 at once.")
@click.option("--completion-reserve", type=click.IntRange(1, 10**7), default=4096,
              show_default=True, metavar="N",
              help="Completion tokens reserved against a budget, while it is in flight, for a "
                   "request that sets no max_tokens of its own.")
@click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Read the upstream API key from this file (default: $KSFS_UPSTREAM_API_KEY, "
                   "else $OPENAI_API_KEY).")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Require every request to carry `Authorization: Bearer TOKEN` (the agent's "
                   "API key) with TOKEN read from this file; others get 401.")
@pass_ctx
def serve(ctx, upstream: str, session: str, port: int, host: str, prices: str | None,
          timeout: float, read_timeout: float, admission_wait: float, max_connections: int,
          completion_reserve: int, api_key_file: str | None, token_file: str | None) -> None:
    """Serve one session's model calls on HOST:PORT until interrupted (Ctrl-C or SIGTERM).

    Prints one line `ksfs gateway: session S on http://HOST:PORT -> UPSTREAM` once listening.
    Point the agent's OpenAI base URL at http://HOST:PORT/v1.

    \b
    Example:
      KSFS_UPSTREAM_API_KEY=sk-... ksfs gateway serve \\
          --upstream https://api.openai.com --session demo --port 8900
    """
    import trio

    from ksfs.gateway import Gateway
    from ksfs.gateway.prices import load_prices
    from ksfs.gateway.service import check_upstream

    # All of it checked before the store (and a `default` session) is made: bad input
    # changes nothing.
    api_key = _secret_of(api_key_file, "API key") if api_key_file is not None else None
    token = _secret_of(token_file, "token") if token_file is not None else None
    check_upstream(upstream, timeout)
    if not 0 < read_timeout < float("inf"):
        raise BadInput(f"--read-timeout must be a number of seconds > 0, not {read_timeout!r}")
    if not 0 < admission_wait < float("inf"):
        raise BadInput(f"--admission-wait must be a number of seconds > 0, not "
                       f"{admission_wait!r}")
    table = load_prices(prices)
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise BadInput(f"--host {host!r} is not an IP address (or localhost)") from None
    _try_bind(host, port)
    # Only the default session is made (with its store) when missing: another name at a
    # mistyped --store is refused with nothing made (QA, eighteenth session)
    keeper = ctx.open_keeper(create=session == DEFAULT_SESSION)
    store, ledger = keeper.store, keeper.ledger
    try:
        ledger.session(session)
    except NoSuchSession:
        if session != DEFAULT_SESSION:
            raise
        with store.env.begin(write=True) as txn:
            ledger.create_session(txn, DEFAULT_SESSION)
    if not _is_loopback(host):
        click.echo(f"ksfs: warning: gateway bound to {host}, not loopback: anyone who can reach "
                   "it can spend this session's budget", err=True)
    gw = Gateway(store, ledger, upstream, table, api_key=api_key, timeout=timeout,
                 completion_reserve=completion_reserve, read_timeout=read_timeout,
                 max_connections=max_connections, admission_wait=admission_wait)
    keeper.gateway = gw
    try:
        trio.run(_serve, gw, session, host, port, upstream, token)
    except BaseExceptionGroup as group:  # the server's nursery wraps the bind's failure
        match, _ = group.split(lambda e: isinstance(e, OSError) and e.errno in BIND_ERRORS)
        if match is None:
            raise
        raise _bind_error(_first(match), host, port) from None


def _try_bind(host: str, port: int) -> None:
    """Bind and let go at once: an address not this machine's, or a port in use, is said
    before the store is touched (the server binds again for real)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(("127.0.0.1" if host == "localhost" else host, port))
        except OSError as exc:
            if exc.errno not in BIND_ERRORS:
                raise
            raise _bind_error(exc, host, port) from None


def _secret_of(path: str, what: str) -> str:
    """A key or token read from a file: its one stripped line; BadInput when empty (an empty
    key file must not quietly fall back to the environment's key)."""
    try:
        value = Path(path).read_text("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read the {what} file {path}: {exc}") from None
    if not value:
        raise BadInput(f"{what} file {path} is empty")
    return value


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _bind_error(exc: BaseException, host: str, port: int) -> Exception:
    from ksfs.errors import Busy

    if getattr(exc, "errno", None) == errno.EADDRINUSE:
        return Busy(f"port {port} on {host} is in use: pick another --port (0: any free one)")
    why = getattr(exc, "strerror", None) or str(exc)
    return BadInput(f"cannot listen on {host}:{port}: {why}")


async def _serve(gw: Any, session: str, host: str, port: int, upstream: str,
                 token: str | None) -> None:
    import functools

    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(functools.partial(
                gw.serve_session, session, port, host, token=token))
            shown = f"[{host}]" if ":" in host else host
            click.echo(f"ksfs gateway: session {session} on http://{shown}:{bound} -> {upstream}")
            async for _ in signals:
                break
            # Calls already bought are stored before the stop (a second signal stops at once).
            wait = gw.stop_wait
            if gw.inflight_count():
                click.echo(f"ksfs gateway: stopping; waiting up to {wait:g} s for "
                           f"{gw.inflight_count()} call(s) in flight")
            async with trio.open_nursery() as draining:
                async def second_signal() -> None:
                    async for _ in signals:
                        # At once, but every answer still open ends with the gateway's error
                        # (a stream with its error event) rather than cut off (QA F12).
                        await gw.stop_now()
                        draining.cancel_scope.cancel()
                        return

                draining.start_soon(second_signal)
                await gw.drain(wait)
                draining.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command()
@click.argument("session")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (as sessions/S/usage).")
@pass_ctx
def usage(ctx, session: str, as_json: bool) -> None:
    """Model-call usage of SESSION: paid calls, replays, tokens, cost, budget.

    Replays (calls served from the store) cost nothing and are counted apart. A call whose
    answer carried no usage is counted at an estimate from the sizes of its request and of
    the text it generated. Prompt tokens read from or written to the provider's prompt cache
    are counted among the tokens in and said apart; they cost the model's cache prices when
    the price table gives them, else its input price.

    Example: ksfs usage demo --json
    """
    from ksfs.gateway import read_usage

    keeper = ctx.open_keeper()
    u = read_usage(keeper.store, keeper.ledger, session)
    if as_json:
        emit_json(u)
        return
    click.echo(f"session          {u['session']}")
    click.echo(f"paid calls       {u['paid_calls']}")
    click.echo(f"replays          {u['replays']}  (free)")
    click.echo(f"refused          {u['refused']}  (over budget)")
    click.echo(f"upstream errors  {u['upstream_errors']}")
    cached = ""
    if u["cache_read_tokens"] or u["cache_write_tokens"]:
        # (parts of the tokens in, priced at the model's cache prices)
        hour = u.get("cache_write_1h_tokens", 0)
        cached = (f" ({u['cache_read_tokens']} read from the cache, "
                  f"{u['cache_write_tokens']} written to it"
                  + (f", {hour} of them for an hour)" if hour else ")"))
    click.echo(f"tokens           {u['prompt_tokens']} in{cached}, "
               f"{u['completion_tokens']} out, {u['total_tokens']} total")
    notes = []
    if u["unpriced_calls"]:
        notes.append(f"{u['unpriced_calls']} call(s) of models with no price, counted as 0")
    if u["unknown_usage_calls"]:
        notes.append(f"{u['unknown_usage_calls']} call(s) without usage, counted at an "
                     "estimate")
    click.echo(f"cost             {u['cost_usd']:.6f} USD" + (f"  ({'; '.join(notes)})"
                                                               if notes else ""))
    click.echo(f"budget           {_show_budget(u['budget'])}")
    if u["remaining"] is not None:
        click.echo(f"remaining        {_show_budget(u['remaining'])}"
                   + ("  (over budget)" if u["over_budget"] else ""))


@main.command()
@click.argument("session")
@click.option("--tokens", type=int, default=None, metavar="N",
              help="Refuse calls once the session has used N tokens (prompt + completion).")
@click.option("--usd", default=None, metavar="X",  # parsed by set_budget: says it as given
              help="Refuse calls once the session has spent X US dollars.")
@click.option("--clear", is_flag=True, help="Remove the session's budget.")
@click.option("--json", "as_json", is_flag=True, help="Print the budget as JSON.")
@pass_ctx
def budget(ctx, session: str, tokens: int | None, usd: str | None, clear: bool,
           as_json: bool) -> None:
    """Show or set the model-call budget of SESSION.

    With --tokens and/or --usd the budget becomes exactly that (an option left out means no
    limit of that kind) and a `budget.set` event is recorded; with neither, the budget is shown.
    A call made once the budget is used up gets HTTP 402 and nothing is sent upstream; replays
    of stored calls are still served, since they cost nothing.

    Example: ksfs budget demo --tokens 200000 --usd 2.50
    """
    from ksfs.gateway import GatewayStore

    keeper = ctx.open_keeper()
    db = GatewayStore(keeper.store, keeper.ledger)
    if clear and (tokens is not None or usd is not None):
        raise BadInput("--clear cannot be given with --tokens or --usd")
    if clear or tokens is not None or usd is not None:
        db.set_budget(session, tokens=tokens, usd=usd)
    current = db.budget(session)
    if as_json:
        emit_json({"session": session, "budget": current})
    else:
        click.echo(f"{session}: {_show_budget(current)}")


def _show_budget(b: dict[str, Any] | None) -> str:
    if b is None:
        return "no budget"
    parts = []
    if b.get("tokens") is not None:
        parts.append(f"{b['tokens']} tokens")
    if b.get("usd") is not None:
        parts.append(f"{b['usd']:g} USD")
    return ", ".join(parts) or "no limit"
