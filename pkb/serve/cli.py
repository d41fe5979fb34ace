"""``pkb serve``. Nothing heavy is imported until the command runs."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from pathlib import Path

TOKEN_ENV = "PKB_SERVE_TOKEN"


def add_commands(subparsers) -> None:
    from pkb.commands import add_experiment_option, add_option
    from pkb.options import EXECUTORS, OPTIONS, SERVED_EXPERIMENT

    p = subparsers.add_parser("serve", help="an evaluation service over HTTP + JSON (docs/serve.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default loopback; any other needs a token: --token-file or $" + TOKEN_ENV + ")")
    add_option(p, OPTIONS["port"])
    p.add_argument("--token-file", help="a file holding the token every request must send "
                                        "(`Authorization: Bearer <token>`); default: $" + TOKEN_ENV)
    p.add_argument("--url-file", help="also write the server's URL here once it listens (for scripts)")
    p.add_argument("--db", help="SQLite file every verdict is stored in (default: ./pkb-results.sqlite)")
    add_experiment_option(p, SERVED_EXPERIMENT, f"the experiment of a request that names none (default "
                                                f"{SERVED_EXPERIMENT}: service traffic, left out of every report that "
                                                "does not ask for it)")
    add_option(p, OPTIONS["max_queue"])
    p.add_argument("--sandbox", default="auto", choices=("auto", "required"),
                   help="how candidates are confined (docs/threat-model.md); a service never runs them unconfined")
    p.add_argument("--executor", default="local", choices=EXECUTORS,
                   help="run evaluations on this machine (default) or on a Ray cluster (docs/cluster.md)")
    p.add_argument("--address", help="with --executor ray: auto, ray://HOST:PORT or local")
    add_option(p, OPTIONS["parallel"])
    p.set_defaults(func=cmd_serve, json=False)


def cmd_serve(args) -> int:
    """Checks everything a user can get wrong (token, sandbox, port, results database) before it starts the
    service: each is a usage error (exit 2) with nothing started and nothing written."""
    from pkb.commands import make_executor
    from pkb.console import UsageError

    token = _token(args)
    if not _is_loopback(args.host) and token is None:
        raise UsageError(f"--host {args.host} is reachable from other machines: give a token with --token-file FILE "
                         f"or ${TOKEN_ENV} (clients send `Authorization: Bearer <token>`)")
    import uvicorn

    from pkb.runtime.sandbox import check_sandbox, SandboxUnavailable
    from pkb.serve.app import create_app
    from pkb.serve.service import EvaluationService
    from pkb.store.db import DEFAULT_DB

    if args.sandbox == "required":
        try:
            check_sandbox("required")
        except SandboxUnavailable as exc:
            raise UsageError(str(exc)) from None
    if args.url_file and not Path(args.url_file).parent.is_dir():
        raise UsageError(f"--url-file {args.url_file}: its folder does not exist")
    listener = _listen(args.host, args.port)
    executor = None
    try:
        executor = make_executor(args)
        service = EvaluationService(executor, args.db or DEFAULT_DB, args.max_queue, sandbox=args.sandbox,
                                    experiment=args.experiment)
    except BaseException:  # e.g. a --db it cannot store verdicts in (pkb.store.db.StoreUnavailable: a usage error)
        listener.close()
        if executor is not None:
            executor.close()
        raise
    host, port = listener.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    print(f"pkb serve: listening on {url} ({service.health()['executor']}; results in {service.db})", file=sys.stderr)
    if args.url_file:
        Path(args.url_file).write_text(url + "\n")
    server = uvicorn.Server(uvicorn.Config(create_app(service, token), log_level="warning", access_log=False))
    try:
        server.run(sockets=[listener])
    finally:
        service.close()
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (before the URL is out: a client that comes first waits in the
    backlog, not refused); UsageError where the address is taken or not this machine's."""
    from pkb.console import UsageError

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        taken = exc.errno == errno.EADDRINUSE
        raise UsageError(f"cannot listen on {host}:{port}: " + (
            "another process uses that port; pick another --port, or leave it out for one the system picks"
            if taken else f"{exc.strerror}; give an address of this machine with --host")) from None
    return listener


def _token(args) -> str | None:
    from pkb.console import UsageError

    if args.token_file:
        if not Path(args.token_file).is_file():
            raise UsageError(f"--token-file {args.token_file} is not a file: give a file holding the token")
        token = Path(args.token_file).read_text(encoding="utf-8", errors="replace").strip()
        if not token:
            raise UsageError(f"--token-file {args.token_file} is empty: write the token into it")
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
