"""``mdb ports --watch``: a live table of every port of every running container.

It is meant to stay open during an incident, so it must keep drawing while
the broker or the database is away: a sampler thread reads the containers'
heartbeats (the database) and the queue depths (one broker connection,
passive declares, so nothing is created or consumed), and the screen is
redrawn every second from the latest sample, saying how old it is and what
could not be read. Rates are deliveries per second over the last few
seconds of heartbeats, smoothed because heartbeats and redraws tick apart.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from ..errors import MdbError
from ..operations.ports import batch_figures
from ..settings import Settings
from ..state.control import Control
from ..state.store import Store
from ..support.failures import describe
from ..support.terminal import Column, fit
from ..wire.connection import Broker, connection_errors
from ..wire.queues import QueueSession

REFRESH = 1.0
RATE_WINDOW = 5.0
STALE_AFTER = 3.0


@dataclass
class Sample:
    """What one look at the fleet found, and what it could not read."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    depths: dict[str, int | None] = field(default_factory=dict)
    taken_at: float = 0.0
    wall: datetime | None = None
    problems: list[str] = field(default_factory=list)


class QueueDepths:
    """Ready messages per queue over one broker connection, reopened after a failure."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._queues: QueueSession | None = None

    def measure(self, queues: list[str]) -> dict[str, int | None]:
        """Depth of each queue (None: it does not exist); raises on a lost connection."""
        if self._queues is None:
            self._queues = QueueSession(self.broker, timeout=2.0)
        return {queue: self._depth(self._queues, queue) for queue in queues}

    def _depth(self, queues: QueueSession, queue: str) -> int | None:
        try:
            return queues.status(queue).messages
        except connection_errors():
            self.close()
            raise
        except Exception:  # a missing queue (the session takes a new channel next time)
            return None

    def close(self) -> None:
        queues, self._queues = self._queues, None
        if queues is not None:
            queues.close()


class Rates:
    """Deliveries per second per (container, port), from the delivered counters' deltas."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self._history: dict[tuple[str, str], deque[tuple[float, int]]] = {}

    def update(self, rows: list[dict[str, Any]], now: float) -> dict[tuple[str, str], float]:
        rates = {}
        for row in rows:
            key = (row["container"], row["port"])
            history = self._history.setdefault(key, deque())
            history.append((now, int(row.get("delivered") or 0)))
            while len(history) > 2 and now - history[0][0] > self.window:
                history.popleft()
            (t0, d0), (t1, d1) = history[0], history[-1]
            rates[key] = (d1 - d0) / (t1 - t0) if t1 > t0 and d1 >= d0 else 0.0
        return rates


class Sampler:
    """Takes a :class:`Sample` every ``interval`` in a thread of its own."""

    def __init__(self, settings: Settings, interval: float = REFRESH) -> None:
        self.settings = settings
        self.interval = interval
        self.store = Store(settings.container)
        self.depths = QueueDepths(Broker(settings))
        self.latest = Sample()
        self.taken = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mdb-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(3.0)
        if self._thread.is_alive():
            # Still in a sample (a slow broker or database): its connection is the thread's
            # own, and closing a py-amqp connection under the thread that reads it can wait
            # for ever. The thread is a daemon: it ends with the process.
            return
        self.depths.close()
        with suppress(Exception):
            self.store.dispose()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.latest = self.take()
            self.taken.set()
            self._stop.wait(self.interval)

    def take(self) -> Sample:
        sample = Sample(rows=self.latest.rows, depths=self.latest.depths)
        try:
            sample.rows = Control(self.store).live(control_interval=self.settings.container.control_interval)
        except Exception as exc:
            sample.problems.append(f"database: {describe(exc)} (rows as last read)")
        queues = sorted({q for q in map(queue_of, sample.rows) if q} | set(self.backout_queues()))
        try:
            sample.depths = self.depths.measure(queues)
        except Exception as exc:
            self.depths.close()
            sample.problems.append(str(exc) if isinstance(exc, MdbError)
                                   else f"broker {self.depths.broker.masked_url}: {describe(exc)}")
        sample.taken_at, sample.wall = time.monotonic(), datetime.now(UTC)
        return sample

    def backout_queues(self) -> list[str]:
        return self.settings.backout_queues()


def queue_of(row: dict[str, Any]) -> str:
    """The queue a port reads (older containers report only the destination)."""
    return str(row.get("queue") or row.get("destination") or "")


# The same rule as ``mdb ports`` (cli/output.py): container and port tell the rows
# apart and stay whole; empty columns go first; the rest move to a second line.
WATCH_COLUMNS = (
    Column("container", keep=True), Column("port", keep=True), Column("queue", 8),
    Column("state", keep=True), Column("msg/s", right=True, drop=1),
    Column("failures", right=True, drop=1), Column("delivered", right=True, drop=4),
    Column("failed", right=True, drop=3), Column("backed out", right=True, drop=3),
    Column("invalid", right=True, drop=3), Column("backlog", right=True, drop=2),
    Column("waiting", right=True, drop=3),
    Column("batches", right=True, drop=5), Column("since", drop=6), Column("reason", drop=7),
)
ALARMS = {"stuck": "bold red", "stopped": "bold red", "stopping": "bold red", "reconnecting": "bold red"}


def render(sample: Sample, rates: dict[tuple[str, str], float], source: str,
           backout_queues: list[str], now: float, width: int = 200) -> Group:
    """The screen: the ports table, the backout queues, and what could not be read."""
    stamp = sample.wall.strftime("%H:%M:%S UTC") if sample.wall else "--:--:--"
    title = Text(f"mdb ports --watch  {source}  {stamp}  (Ctrl-C to exit)", style="italic")
    rows = []
    for row in sample.rows:
        key = (row["container"], row["port"])
        depth = sample.depths.get(queue_of(row))
        rows.append([
            str(row["container"]), str(row["port"]), queue_of(row) or "-",
            "stuck" if row.get("stuck") else str(row["state"]),
            f"{rates.get(key, 0.0):.1f}", str(row.get("consecutive_failures", 0)),
            str(row.get("delivered", 0)), str(row.get("failed", 0)),
            str(row.get("backed_out", 0)), str(row.get("invalid_body", 0)),  # as --json counts them
            "-" if depth is None else str(depth), str(row.get("waiting", 0)),  # out a redelivery delay
            batch_figures(row), str(row.get("since", ""))[11:19],
            str(row.get("reason") or "-"),
        ])
    table = [Text(line) for line in fit(WATCH_COLUMNS, rows, width)]
    table[0].stylize("bold")
    for line in table[1:]:
        line.highlight_words(list(ALARMS), style="bold red")
    lines: list[Any] = [title, *table]
    if not sample.rows:
        lines.append(Text("no running containers", style="yellow"))
    lines += _stop_reasons(sample.rows)
    held = [f"{q} {sample.depths[q]}" for q in backout_queues if sample.depths.get(q) is not None]
    if held:
        lines.append(Text("backout queues: " + ", ".join(held)))
    if sample.taken_at and now - sample.taken_at > STALE_AFTER:
        lines.append(Text(f"data is {now - sample.taken_at:.0f}s old: still waiting for it",
                          style="bold yellow"))
    lines += [Text(problem, style="bold red") for problem in sample.problems]
    return Group(*lines)


def _stop_reasons(rows: list[dict[str, Any]]) -> list[Text]:
    """The whole reason of each stopped port, once: it names the message that stopped it."""
    seen: dict[tuple[str, str], None] = {}
    for row in rows:
        if row.get("state") != "started" and row.get("reason"):
            seen[(str(row["port"]), str(row["reason"]))] = None
    return [Text(f"{port} stopped: {reason}", style="red") for port, reason in seen]


def watch(settings: Settings, iterations: int | None = None, interval: float = REFRESH) -> None:
    """Redraw every ``interval`` until Ctrl-C (or ``iterations`` redraws, for tests).

    Ctrl-C is heard even when the process started with SIGINT ignored (what a
    non-interactive shell gives its background jobs, and what a test runner's
    worker may pass on): Python then leaves it ignored, and the watch ran on,
    deaf to the one key that ends it.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    sampler = Sampler(settings, interval)
    console = Console() if Console().is_terminal else Console(width=200)
    try:
        sampler.start()
        sampler.taken.wait(interval * 3)
        with Live(console=console, auto_refresh=False) as live:
            _redraw(live, sampler, iterations, interval)
        console.line()
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a person leaves: exit 0
    finally:
        sampler.stop()


def _redraw(live: Live, sampler: Sampler, iterations: int | None, interval: float) -> None:
    rates = Rates()
    current: dict[tuple[str, str], float] = {}
    last_taken = -1.0
    drawn = 0
    while iterations is None or drawn < iterations:
        sample = sampler.latest
        if sample.taken_at != last_taken:
            last_taken, current = sample.taken_at, rates.update(sample.rows, sample.taken_at)
        live.update(render(sample, current, sampler.settings.source, sampler.backout_queues(),
                           time.monotonic(), live.console.width), refresh=True)
        drawn += 1
        if iterations is None or drawn < iterations:
            time.sleep(interval)
