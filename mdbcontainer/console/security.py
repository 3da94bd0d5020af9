"""Who may use the console, and proof that an action came from its own page.

On the loopback bind a person at the machine is trusted, as with the ``mdb``
command. Any other bind needs ``[console] token``: a request without it
answers 401 (the login page, never a redirect, so a script sees the refusal),
except the login page itself and the static files it uses. The token arrives
once, in the login form, and lives on as a cookie holding an HMAC of it (the
token itself never sits in the browser's cookie jar); scripts may send it as
``Authorization: Bearer TOKEN``.

Every action is a POST carrying a CSRF token that equals the ``mdb_csrf``
cookie (double submit): another site can make the browser send the cookie,
but cannot read it to put it in the form or the ``X-CSRF-Token`` header.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import Response

from ..errors import SettingsError

SESSION_COOKIE = "mdb_session"
CSRF_COOKIE = "mdb_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
OPEN_PATHS = ("/login", "/static/")

# Every script and style comes from the console itself; nothing may frame it.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def split_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8089`` for IPv6) as host and port; SettingsError names what is wrong."""
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingsError(f"--bind {bind!r}: expected HOST:PORT, e.g. 127.0.0.1:8089")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token(host: str, token: str | None) -> bool:
    """Whether requests must carry the token; refuses a non-loopback bind that has none."""
    if token:
        return True
    if not is_loopback(host):
        raise SettingsError(
            f"binding {host} serves the console beyond this machine: set [console] token "
            "(or MDB_CONSOLE__TOKEN) to require it, or bind 127.0.0.1"
        )
    return False


def session_value(token: str) -> str:
    """What the session cookie holds: an HMAC of the token, never the token."""
    return hmac.new(token.encode(), b"mdb-console-session", hashlib.sha256).hexdigest()


class TokenGate(BaseHTTPMiddleware):
    """401 for every request without the token (cookie or bearer), but the login page and static files."""

    def __init__(self, app: object, token: str | None,
                 refused: Callable[[Request], Awaitable[Response]]) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self.token = token
        self.refused = refused

    @staticmethod
    def same(given: str, token: str) -> bool:
        """Whether ``given`` is the token, in constant time."""
        return bool(given) and hmac.compare_digest(given.encode(), token.encode())

    def allowed(self, request: Request) -> bool:
        if not self.token:
            return True
        if request.url.path == "/login" or request.url.path.startswith(OPEN_PATHS):
            return True
        cookie = request.cookies.get(SESSION_COOKIE, "")
        if cookie and hmac.compare_digest(cookie, session_value(self.token)):
            return True
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else ""
        return self.same(given, self.token)

    async def dispatch(self, request: Request,
                       call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request) if self.allowed(request) else await self.refused(request)
        response.headers.update(HEADERS)
        if CSRF_COOKIE not in request.cookies and "csrf" in request.scope.get("state", {}):
            set_csrf_cookie(response, request.scope["state"]["csrf"])
        return response


def csrf_token(request: Request) -> str:
    """This browser's CSRF token: its cookie's, else a new one (set on the response by TokenGate)."""
    token = request.cookies.get(CSRF_COOKIE) or getattr(request.state, "csrf", None)
    if not token:
        token = secrets.token_urlsafe(32)
        request.state.csrf = token
    return str(token)


def set_csrf_cookie(response: Response, token: str) -> None:
    response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict", path="/")


def csrf_ok(request: Request, form_value: str | None) -> bool:
    """Whether the POST carries this browser's CSRF token in the form or the header."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    given = form_value or request.headers.get(CSRF_HEADER, "")
    return bool(cookie) and bool(given) and hmac.compare_digest(cookie.encode(), given.encode())
