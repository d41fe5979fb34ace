"""``pkb serve``. Nothing heavy is imported until the command runs."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

TOKEN_ENV = "PKB_SERVE_TOKEN"


def add_commands(subparsers) -> None:
    from pkb.options import EXECUTORS

    p = subparsers.add_parser("serve", help="an evaluation service over HTTP + JSON (docs/serve.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default loopback; any other needs a token: --token-file or $" + TOKEN_ENV + ")")
    p.add_argument("--port", type=int, default=0, help="default: one the system picks, printed at start")
    p.add_argument("--token-file", help="a file holding the token every request must send "
                                        "(`Authorization: Bearer <token>`); default: $" + TOKEN_ENV)
    p.add_argument("--url-file", help="also write the server's URL here once it listens (for scripts)")
    p.add_argument("--db", help="SQLite file every verdict is stored in (default: ./pkb-results.sqlite)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="evaluations queued or running at most; more are answered 429 busy (default 64)")
    p.add_argument("--sandbox", default="auto", choices=("auto", "required"),
                   help="how candidates are confined (docs/threat-model.md); a service never runs them unconfined")
    p.add_argument("--executor", default="local", choices=EXECUTORS,
                   help="run evaluations on this machine (default) or on a Ray cluster (docs/cluster.md)")
    p.add_argument("--address", help="with --executor ray: auto, ray://HOST:PORT or local")
    p.add_argument("--parallel", type=int, help="evaluations at once (default: what the machine holds)")
    p.set_defaults(func=cmd_serve, json=False)


def cmd_serve(args) -> int:
    from pkb.commands import make_executor
    from pkb.console import UsageError

    token = _token(args)
    if not _is_loopback(args.host) and token is None:
        raise UsageError(f"--host {args.host} is reachable from other machines: give a token with --token-file FILE "
                         f"or ${TOKEN_ENV} (clients send `Authorization: Bearer <token>`)")
    if args.max_queue < 1:
        raise UsageError("--max-queue must be at least 1")
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
    service = EvaluationService(make_executor(args), args.db or DEFAULT_DB, args.max_queue, sandbox=args.sandbox)
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    listener.listen(128)  # before the URL is out: a client that comes first waits in the backlog, not refused
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


def _token(args) -> str | None:
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
