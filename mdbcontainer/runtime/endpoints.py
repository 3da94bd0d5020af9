"""The operations HTTP server on ``container.metrics_port``: ``/metrics``, ``/healthz``, ``/readyz``.

One stdlib ``ThreadingHTTPServer`` in a daemon thread, so a scrape or a probe
never waits behind a delivery and a hung client never holds the container.

The two probes answer different questions, as Kubernetes uses them:

- ``/healthz`` (liveness): would restarting the process help? Only when a
  thread that should be running has died or is wedged: a consumer's drain
  loop refreshes ``PortConsumer.alive_at`` every half second, so a consumer that
  is consuming, is not inside a delivery and has not looped for
  ``WEDGED_AFTER`` seconds is stuck; and, where a port sets ``handler_timeout``,
  a handler call running longer than that is stuck (a deadlocked handler holds
  its prefetch for ever: a restart hands it to another consumer, counted as a
  crash). Time a delivery spends waiting out an outage is not handler time. A
  broker or database outage is *not* a
  liveness failure: a restart cannot bring the broker back, and restarting
  every replica at once during an outage only adds load.
- ``/readyz`` (readiness): is the container doing its job? Connected to the
  broker and the database, and every port started that should be: a port
  stopped with ``mdb port stop``, or ``autostart = false`` and never started,
  is stopped as configured; a port stopped by Maximum retries is not (it
  needs a person), nor is one still starting or reconnecting.

A failing probe answers 503 with a JSON body whose ``reasons`` say why, one
line each, naming the port or the connection.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import MdbError
from ..state.control import STOPPED_BY_OPERATOR

if TYPE_CHECKING:
    from ..pipeline.resources import SharedResources
    from ..settings import Settings
    from .port import ListenerPort

log = logging.getLogger("mdbcontainer.endpoints")

WEDGED_AFTER = 60.0


class Observed(Protocol):
    """What the probes read of a container (met by ``container.Container``)."""

    settings: Settings
    resources: SharedResources
    ports: dict[str, ListenerPort]

    @property
    def threads(self) -> list[threading.Thread]: ...
JSON = "application/json"


def liveness(container: Observed, wedged_after: float = WEDGED_AFTER) -> list[str]:
    """Why the process should be restarted; empty while it is alive and not wedged."""
    if container.resources.shutting_down:
        return []
    reasons = [f"container thread {t.name} died" for t in container.threads if not t.is_alive()]
    now = time.monotonic()
    for name, port in container.ports.items():
        reasons += [stuck.describe() for stuck in port.stuck(now)]  # a stopping port's too
        if port.stopping:
            continue
        for consumer in list(port.consumers):
            where = f"port {name} consumer {consumer.index}"
            if consumer.thread.ident is not None and not consumer.thread.is_alive():
                reasons.append(f"{where}: thread died while the port should run")
            elif (consumer.consuming and consumer.delivering_since is None
                  and now - consumer.alive_at > wedged_after):
                reasons.append(f"{where}: wedged: no drain loop for {now - consumer.alive_at:.0f}s")
    return reasons


def readiness(container: Observed) -> list[str]:
    """Why the container is not doing its job; empty while connected with its ports started."""
    resources = container.resources
    if resources.shutting_down:
        return ["container shutting down"]
    reasons = [f"{kind} unavailable for {seconds:.0f}s: {error}"
               for kind, (seconds, error) in sorted(resources.outage_report().items())]
    for name, port in container.ports.items():
        if should_run(port) and port.state != "started":
            reasons.append(f"port {name} {port.state}" + (f": {port.reason}" if port.reason else ""))
    return reasons


def should_run(port: ListenerPort) -> bool:
    """True unless the port is stopped as configured (``mdb port stop``, or never auto-started)."""
    if port.reason == STOPPED_BY_OPERATOR:
        return False
    return port.settings.autostart or bool(port.consumers) or port.stopping or bool(port.reason)


def port_states(container: Observed) -> dict[str, str]:
    return {name: port.state for name, port in container.ports.items()}


class OperationsServer:
    """Serves the container's metrics and probes until :meth:`stop`."""

    def __init__(self, container: Observed, host: str, port: int) -> None:
        self.container = container
        self.host = host
        self.port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve; a port already in use is one line naming the setting."""
        try:
            server = ThreadingHTTPServer((self.host, self.port), _handler_for(self.container))
        except OSError as exc:
            raise MdbError(
                f"{self.container.settings.source}: container.metrics_port: cannot listen on "
                f"{self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, name="mdb-http", daemon=True)
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on http://%s:%d", self.host, self.port)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def _handler_for(container: Observed) -> type[BaseHTTPRequestHandler]:
    class Handler(_OperationsHandler):
        pass

    Handler.container = container
    return Handler


class _OperationsHandler(BaseHTTPRequestHandler):
    """GET /metrics, /healthz, /readyz; anything else is 404."""

    container: Observed
    server_version = "mdbcontainer"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, self.container.resources.metrics.exposition())
        elif path == "/healthz":
            self._probe(liveness(self.container), "alive")
        elif path == "/readyz":
            self._probe(readiness(self.container), "ready")
        else:
            self._json(404, {"error": f"no such path {path or '/'}; try /metrics, /healthz, /readyz"})

    def _probe(self, reasons: list[str], good: str) -> None:
        body = {"status": "not " + good if reasons else good, "reasons": reasons,
                "ports": port_states(self.container)}
        self._json(503 if reasons else 200, body)

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, JSON, (json.dumps(body) + "\n").encode())

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds: not one log line each."""
