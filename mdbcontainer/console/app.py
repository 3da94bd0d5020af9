"""The console's pages and actions, over the same database and broker as the ``mdb`` commands.

Pages (GET, which change nothing): Ports (``/``, its rows refreshed by the
page every second from ``/ports/rows``), Backout queues (``/queues``, every
backout queue of the settings, or ``?queue=NAME`` alone), a message
(``/message``), History (``/history``). Actions (POST, each with the CSRF
token) call what ``mdb port`` and ``mdb dlq`` call (:meth:`Control.set_port`,
:func:`dlq.replay`, :func:`dlq.purge`), record the action in the history
table, and answer 303 back to the page with a note of what was done.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from ..errors import MdbError
from ..operations import dlq
from ..settings import Settings, format_duration
from ..state.control import STOPPED_BY_OPERATOR
from ..state.database import database_error_types
from ..state.history import History
from ..state.store import Store
from ..support.failures import describe
from ..support.logs import mask_secrets
from ..wire.headers import EXCEPTION
from .fleet import BUCKET, WINDOW, Chart, Fleet
from .security import (
    CSRF_FIELD,
    SESSION_COOKIE,
    TokenGate,
    allowed_hosts,
    csrf_ok,
    csrf_token,
    session_value,
)

log = logging.getLogger("mdbcontainer.console")
HERE = Path(__file__).parent
FLASH_COOKIE = "mdb_flash"
LIST_LIMIT = 200
SAMPLE_EVERY = 2.0


class Console:
    """One console: its settings, the fleet's database, the templates; the handlers of its routes."""

    def __init__(self, settings: Settings, store: Store, token: str | None) -> None:
        self.settings = settings
        self.store = store
        self.token = token
        self.fleet = Fleet(settings, store)
        self.history = History(store)
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.globals.update(window=format_duration_seconds(WINDOW),
                                          bucket=format_duration_seconds(BUCKET),
                                          chart_width=Chart.WIDTH, chart_height=Chart.HEIGHT)
        self.templates.env.filters.update(urldecode=unquote, utc=as_utc)

    # -- rendering ------------------------------------------------------------------

    def page(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        flash = request.cookies.get(FLASH_COOKIE)
        response = self.templates.TemplateResponse(request, name, {
            "csrf": csrf_token(request), "csrf_field": CSRF_FIELD, "flash": flash,
            "queues": self.settings.backout_queues(), **context,
        }, status_code=status)
        if flash:
            response.delete_cookie(FLASH_COOKIE, path="/")
        return response

    def done(self, to: str, note: str) -> Response:
        """303 back to the page, carrying a note of what was done for the next GET to show."""
        response = RedirectResponse(to, status_code=303)
        response.set_cookie(FLASH_COOKIE, quote(mask_secrets(note)[:500]), httponly=True,
                            samesite="strict", path="/")
        return response

    async def unavailable(self, request: Request, exc: Exception) -> Response:
        """The database or broker is away: one line saying so (masked), not a traceback."""
        return self.page(request, "error.html", 503, error=mask_secrets(describe(exc)))

    async def refused(self, request: Request) -> Response:
        return self.page(request, "login.html", 401, error="")

    # -- pages ------------------------------------------------------------------------------

    async def ports(self, request: Request) -> Response:
        rows = await run_in_threadpool(self.fleet.ports)
        return self.page(request, "ports.html", rows=rows)

    async def port_rows(self, request: Request) -> Response:
        rows = await run_in_threadpool(self.fleet.ports)
        return self.page(request, "port_rows.html", rows=rows)

    async def queue(self, request: Request) -> Response:
        """Every backout queue of the settings, one section each, or the one asked for."""
        asked = request.query_params.get("queue")
        if asked is not None and asked not in self.settings.backout_queues():
            return self.page(request, "error.html", 404, error=f"{asked} is not a backout queue "
                             "named in the settings")
        names = [asked] if asked else self.settings.backout_queues()
        sections = [await run_in_threadpool(self.section, name) for name in names]
        back = "/queues?" + urlencode({"queue": asked}) if asked else "/queues"
        return self.page(request, "queues.html", sections=sections, asked=asked, back=back,
                         one=len(sections) == 1)

    def section(self, name: str) -> dict[str, Any]:
        """One queue's part of the page: its first LIST_LIMIT messages and how many it holds."""
        try:
            letters, total = dlq.browse_page(self.settings, name, LIST_LIMIT)
        except MdbError as exc:
            return {"queue": name, "rows": [], "total": 0, "error": mask_secrets(str(exc))}
        rows = [{**d.to_json(), "summary": mask_secrets(d.summary())} for d in letters]
        return {"queue": name, "rows": rows, "total": total, "error": ""}

    async def message(self, request: Request) -> Response:
        queue, mid = request.query_params.get("queue", ""), request.query_params.get("id", "")
        full = request.query_params.get("full") == "1"
        if queue not in self.settings.backout_queues():
            return self.page(request, "error.html", 404, error=f"{queue} is not a backout queue")
        try:
            found = await run_in_threadpool(dlq.find, self.settings, mid, queue)
        except MdbError as exc:
            return self.page(request, "error.html", 404, error=mask_secrets(str(exc)))
        return self.page(request, "message.html", queue=queue, id=mid, full=full,
                         copies=[shown(letter, full) for letter in found])

    async def history_page(self, request: Request) -> Response:
        actions = await run_in_threadpool(self.history.newest)
        return self.page(request, "history.html", actions=actions)

    async def login_page(self, request: Request) -> Response:
        if request.method == "GET":
            return self.page(request, "login.html", error="")
        form = await request.form()
        if not csrf_ok(request, str(form.get(CSRF_FIELD) or "")):
            return self.page(request, "login.html", 403, error="The form was stale: try again.")
        given = str(form.get("token") or "")
        if not self.token or not TokenGate.same(given, self.token):
            return self.page(request, "login.html", 401, error="That is not the console's token.")
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(SESSION_COOKIE, session_value(self.token), httponly=True,
                            samesite="strict", path="/")
        return response

    # -- actions ---------------------------------------------------------------------------

    async def form(self, request: Request) -> FormData | Response:
        """The POST's form when it carries this browser's CSRF token; else the 403 to answer."""
        form = await request.form()
        if csrf_ok(request, str(form.get(CSRF_FIELD) or "")):
            return form
        return HTMLResponse("refused: this action lacks the console's CSRF token (reload the page)\n",
                            status_code=403)

    async def switch(self, request: Request) -> Response:
        form = await self.form(request)
        if isinstance(form, Response):
            return form
        name, verb = request.path_params["name"], request.path_params["verb"]
        if verb not in ("stop", "start") or not await run_in_threadpool(self.fleet.known_port, name):
            return self.page(request, "error.html", 404, error=f"no port {name!r} in the fleet")
        state = "started" if verb == "start" else "stopped"
        reason = "" if state == "started" else STOPPED_BY_OPERATOR
        await run_in_threadpool(self.fleet.control.set_port, name, state, reason)
        await self.record(request, verb, name, f"{state} requested")
        within = format_duration(self.settings.container.control_interval)
        return self.done("/", f"port {name}: {state} requested; running containers act within {within}")

    async def replay(self, request: Request) -> Response:
        form = await self.form(request)
        if isinstance(form, Response):
            return form
        queue = str(form.get("queue") or "")
        if queue not in self.settings.backout_queues():
            return self.page(request, "error.html", 404, error=f"{queue} is not a backout queue")
        back = back_to(form, queue)
        replay_all = form.get("scope") == "all"
        ids = [str(form["one"])] if form.get("one") else [str(v) for v in form.getlist("selected")]
        if not ids and not replay_all:
            return self.done(back, "select the messages to replay first")
        def record(target: str, detail: str) -> None:  # also when the replay stops on an error
            self.write_history(request, "replay", target, detail)

        try:
            result = await run_in_threadpool(lambda: dlq.replay_recorded(
                self.settings, ids, replay_all, queue, None, record=record))
        except MdbError as exc:
            return self.done(back, f"replay failed: {exc}")
        return self.done(back, dlq.replay_detail(result, ids, replay_all, None))

    async def purge(self, request: Request) -> Response:
        form = await self.form(request)
        if isinstance(form, Response):
            return form
        queue = str(form.get("queue") or "")
        if queue not in self.settings.backout_queues():
            return self.page(request, "error.html", 404, error=f"{queue} is not a backout queue")
        if form.get("confirmed") != "yes":  # no script ran the confirm: ask on a page of its own
            return self.page(request, "confirm.html", queue=queue, back=back_to(form, queue))
        try:
            name, count = await run_in_threadpool(dlq.purge, self.settings, queue)
        except MdbError as exc:
            return self.done(back_to(form, queue), f"purge failed: {exc}")
        await self.record(request, "purge", name, f"purged {count} message(s)")
        return self.done(back_to(form, queue), f"purged {count} message(s) from {name}")

    async def record(self, request: Request, action: str, target: str, detail: str) -> None:
        await run_in_threadpool(self.write_history, request, action, target, detail)

    def write_history(self, request: Request, action: str, target: str, detail: str) -> None:
        """Record an action in the history and the log (a thread's call: it writes the database)."""
        client = request.client.host if request.client else "unknown"
        actor = "token holder" if self.token else None
        self.history.record(action, target, detail, origin=f"console from {client}", actor=actor)
        log.info("console: %s %s: %s (from %s)", action, target, detail, client)

    async def sample_forever(self) -> None:
        """Sample the fleet's counts for the charts, whether or not a page is open."""
        while True:
            with contextlib.suppress(Exception):  # a database away now is shown by the page itself
                await run_in_threadpool(self.fleet.sample)
            await anyio.sleep(SAMPLE_EVERY)


def back_to(form: FormData, queue: str) -> str:
    """The page a form came from (a path of this console only), else its queue's page."""
    back = str(form.get("back") or "")
    if back == "/queues" or back.startswith("/queues?"):
        return back
    return "/queues?" + urlencode({"queue": queue})


def shown(letter: dlq.BackedOutMessage, full: bool) -> dict[str, Any]:
    """A backed-out message as its page shows it: headers, properties, the exception, the body.

    Every text is masked as a log line is: a URL's password in a body or a
    header is not shown on a page (``mdb dlq show`` prints the body as it is).
    """
    data = letter.to_json()
    raw, encoding = data.pop("body"), data["body_encoding"]
    data.pop("headers")
    body = mask_secrets(str(raw if encoding != "json" else json.dumps(raw, indent=2, ensure_ascii=False)))
    return {
        **data,
        "summary": mask_secrets(letter.summary()),
        "exception": mask_secrets(letter.exception),
        "header_rows": [(k, mask_secrets(dlq.dumps(v))) for k, v in letter.headers.items()
                        if k != EXCEPTION],
        "property_rows": [(k, mask_secrets(dlq.dumps(v))) for k, v in sorted(letter.properties.items())],
        "body_text": body if full or len(body) <= dlq.BODY_PREVIEW else body[: dlq.BODY_PREVIEW],
        "body_cut": not full and len(body) > dlq.BODY_PREVIEW,
        "body_length": len(body),
        "body_bytes": len(letter.body),
    }


def as_utc(moment: datetime) -> datetime:
    """A time from the database in UTC (PostgreSQL hands it in the session's zone, SQLite naive)."""
    return moment.astimezone(UTC) if moment.tzinfo else moment


def format_duration_seconds(seconds: float) -> str:
    return f"{int(seconds // 60)} min" if seconds >= 60 else f"{int(seconds)} s"


def build_app(settings: Settings, store: Store, token: str | None,
              bind_host: str = "127.0.0.1") -> Starlette:
    """The console's ASGI application (served by uvicorn in :func:`mdbcontainer.console.serve`).

    ``bind_host``: the address it is served on; without a token, the one name
    besides the loopback names that its requests may carry as ``Host``.
    """
    console = Console(settings, store, token)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(console.sample_forever)
            yield
            tasks.cancel_scope.cancel()

    routes = [
        Route("/", console.ports),
        Route("/ports/rows", console.port_rows),
        Route("/ports/{name}/{verb:str}", console.switch, methods=["POST"]),
        Route("/queues", console.queue),
        Route("/queues/replay", console.replay, methods=["POST"]),
        Route("/queues/purge", console.purge, methods=["POST"]),
        Route("/message", console.message),
        Route("/history", console.history_page),
        Route("/login", console.login_page, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={**dict.fromkeys(database_error_types(), console.unavailable),
                                         MdbError: console.unavailable},
                     middleware=[Middleware(TokenGate, token=token, refused=console.refused,
                                             hosts=allowed_hosts(bind_host, token))])
