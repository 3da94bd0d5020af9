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

Trusting loopback needs one more check: a page the operator visits can point
its own name at 127.0.0.1 (DNS rebinding) and then read the console as its
own origin, CSRF token included. So a console without a token answers only
requests whose ``Host`` is the bound address, ``localhost``, ``127.0.0.1`` or
``[::1]`` (any port), and refuses a POST whose ``Origin`` is another site. With
a token the rebound page has neither the session cookie nor the token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..errors import SettingsError

SESSION_COOKIE = "mdb_session"
CSRF_COOKIE = "mdb_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
OPEN_PATHS = ("/login", "/static/")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

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


def allowed_hosts(bind_host: str, token: str | None) -> frozenset[str] | None:
    """The ``Host`` names a console without a token answers (None: any, the token guards it)."""
    if token:
        return None
    return LOOPBACK_NAMES | {bind_host.lower()}


def host_name(authority: str) -> str:
    """The name in a ``Host`` header or URL authority: no port, no brackets, no final dot, lower case."""
    value = authority.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    name = value.rpartition(":")[0] if value.count(":") == 1 else value
    return name.rstrip(".")


def _port_of(authority: str, scheme: str) -> str:
    """The port in an authority, else the scheme's default."""
    tail = authority.rpartition("]")[2] if authority.startswith("[") else authority
    _, sep, port = tail.rpartition(":")
    return port if sep and port else ("443" if scheme == "https" else "80")


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether a request's ``Origin`` is the console it was sent to (its ``Host``)."""
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc:
        return False
    return (host_name(parts.netloc), _port_of(parts.netloc, parts.scheme)) == (
        host_name(host), _port_of(host, scheme))


def from_another_site(request: Request) -> str | None:
    """What shows that a request came from another site's page, else None.

    ``Origin: null`` says nothing: the console's own pages send it, as their
    ``Referrer-Policy`` is ``no-referrer``. ``Sec-Fetch-Site`` is the browser's
    own word on where the request started.
    """
    origin = request.headers.get("origin")
    if origin and origin != "null" and not same_origin(origin, request.headers.get("host", ""),
                                                       request.url.scheme):
        return f"Origin {origin[:100]!r}"
    site = request.headers.get("sec-fetch-site")
    if site in ("cross-site", "same-site"):
        return f"Sec-Fetch-Site {site!r}"
    return None


def session_value(token: str) -> str:
    """What the session cookie holds: an HMAC of the token, never the token."""
    return hmac.new(token.encode(), b"mdb-console-session", hashlib.sha256).hexdigest()


class TokenGate(BaseHTTPMiddleware):
    """401 for every request without the token (cookie or bearer), but the login page and static files.

    ``hosts``: without a token, the only ``Host`` names answered (400 for any
    other), and a POST from another site's page (its ``Origin``) is refused.
    """

    def __init__(self, app: object, token: str | None,
                 refused: Callable[[Request], Awaitable[Response]],
                 hosts: frozenset[str] | None = None) -> None:
        super().__init__(app)  # type: ignore[arg-type]
        self.token = token
        self.refused = refused
        self.hosts = hosts

    @staticmethod
    def same(given: str, token: str) -> bool:
        """Whether ``given`` is the token, in constant time (bytes: a text may hold any character)."""
        return bool(given) and hmac.compare_digest(given.encode(), token.encode())

    def allowed(self, request: Request) -> bool:
        if not self.token:
            return True
        if request.url.path == "/login" or request.url.path.startswith(OPEN_PATHS):
            return True
        cookie = request.cookies.get(SESSION_COOKIE, "")
        if self.same(cookie, session_value(self.token)):
            return True
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else ""
        return self.same(given, self.token)

    def misdirected(self, request: Request) -> Response | None:
        """The refusal of a request for another name, or of a POST from another site; else None."""
        if self.hosts is None:
            return None
        host = request.headers.get("host", "")
        if host_name(host) not in self.hosts:
            shown = host[:100].encode("ascii", "backslashreplace").decode()
            return PlainTextResponse(
                f"refused: Host {shown!r} is not this console's name (reach it as localhost or "
                "127.0.0.1; another name pointed at this machine is how a web page would reach it)\n",
                status_code=400)
        foreign = from_another_site(request) if request.method == "POST" else None
        if foreign:
            return PlainTextResponse(f"refused: this POST came from another site's page ({foreign})\n",
                                     status_code=403)
        return None

    async def dispatch(self, request: Request,
                       call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = self.misdirected(request)
        if response is not None:
            response.headers.update(HEADERS)
            return response
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
