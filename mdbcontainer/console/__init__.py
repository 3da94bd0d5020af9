"""``mdb console``: a web page for operators over the fleet's database and broker.

It needs the optional extra ``mdbcontainer[console]`` (Starlette, Jinja2,
uvicorn); the page's one script and its styles are files of this package, so
it works with no network access. See README, "The console".
"""

from __future__ import annotations

import socket

import uvicorn

from ..errors import MdbError
from ..settings import Settings
from ..state.store import Store
from .app import build_app
from .security import require_token, split_bind


def serve(settings: Settings, bind: str | None = None) -> int:
    """Serve the console until interrupted; the address is bound first, so a busy one is one line."""
    host, port = split_bind(bind or settings.console.bind)
    token = settings.console.token if require_token(host, settings.console.token) else None
    store = Store(settings.container)
    store.create_tables()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise MdbError(f"console: cannot bind {host}:{port}: {exc.strerror}") from exc
    shown = f"[{host}]" if ":" in host else host
    print(f"mdb console on http://{shown}:{sock.getsockname()[1]}/"
          + (" (token required)" if token else ""), flush=True)
    config = uvicorn.Config(build_app(settings, store, token, host), log_level="warning", access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        store.dispose()
    return 0
