"""The fleet as the console's Ports page shows it: ``mdb ports`` rows, switches, last failures, rates.

The rows are the containers' heartbeats (:meth:`Control.live`, what ``mdb
ports`` prints); the Stop / Start button follows the fleet's wanted state (the
``mdb_port`` switch), so it offers Start for a port stopped by Maximum
retries even while a container is still stopping it. The chart's rates come
from the heartbeats' counts, sampled by the console every few seconds and
kept in memory: a console started a minute ago draws a minute.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from ..operations.ports import batch_figures
from ..settings import Settings
from ..state.control import Control
from ..state.store import Store
from ..support.logs import mask_secrets

WINDOW = 300.0  # seconds the chart covers
BUCKET = 10.0  # seconds per bar of the chart
BUCKETS = int(WINDOW / BUCKET)
Key = tuple[str, str]  # (container, port)


@dataclass
class Rates:
    """Handled and failed deliveries per BUCKET seconds, per container and port, over WINDOW."""

    samples: deque[tuple[float, dict[Key, tuple[int, int]]]] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, rows: list[dict[str, Any]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        counts = {(r["container"], r["port"]): (int(r.get("handled") or 0), int(r.get("failed") or 0))
                  for r in rows}
        with self.lock:
            self.samples.append((now, counts))
            while self.samples and self.samples[0][0] < now - WINDOW - BUCKET:
                self.samples.popleft()

    def series(self, key: Key, now: float | None = None) -> list[tuple[int, int]]:
        """BUCKETS pairs (handled, failed), oldest first; a counter that went down restarted at 0."""
        now = time.monotonic() if now is None else now
        bars = [(0, 0)] * BUCKETS
        with self.lock:
            samples = list(self.samples)
        for (_, before), (t1, after) in itertools.pairwise(samples):
            if key not in after or now - t1 >= WINDOW:
                continue
            old = before.get(key, (0, 0))
            new = after[key]
            handled = new[0] - old[0] if new[0] >= old[0] else new[0]
            failed = new[1] - old[1] if new[1] >= old[1] else new[1]
            index = BUCKETS - 1 - int((now - t1) // BUCKET)
            h, f = bars[index]
            bars[index] = (h + handled, f + failed)
        return bars


@dataclass(frozen=True)
class Bar:
    """One bar of a chart, in SVG user units."""

    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Chart:
    """Bars of handled and failed deliveries per bucket in a WIDTH x HEIGHT box, and their totals."""

    handled: list[Bar]
    failed: list[Bar]
    total_handled: int
    total_failed: int
    peak: int

    WIDTH = 150
    HEIGHT = 32

    @classmethod
    def of(cls, series: list[tuple[int, int]]) -> Chart:
        """Side by side in each bucket: handled, then failed, scaled to the highest of either."""
        peak = max([1, *(h for h, _ in series), *(f for _, f in series)])
        slot = cls.WIDTH / max(1, len(series))
        room = cls.HEIGHT - 3

        def bars(values: list[int], offset: float) -> list[Bar]:
            out = []
            for i, v in enumerate(values):
                if v:
                    height = max(1.5, v * room / peak)
                    out.append(Bar(round(i * slot + offset, 2), round(cls.HEIGHT - 1 - height, 2),
                                   round(slot * 0.42, 2), round(height, 2)))
            return out

        return cls(bars([h for h, _ in series], slot * 0.08), bars([f for _, f in series], slot * 0.5),
                   sum(h for h, _ in series), sum(f for _, f in series), peak)


class Fleet:
    """Reads what the Ports page shows from the fleet's database."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.control = Control(store, container_id="console")
        self.rates = Rates()

    def live(self) -> list[dict[str, Any]]:
        return self.control.live(control_interval=self.settings.container.control_interval)

    def sample(self) -> None:
        """Take one sample of the fleet's counts for the charts."""
        self.rates.observe(self.live())

    def known_port(self, name: str) -> bool:
        """A port a running container has, or one the fleet's switches name."""
        return any(r["port"] == name for r in self.live()) or name in self.control.wanted()

    def ports(self) -> list[dict[str, Any]]:
        """One row per running container and port, grouped by port, with what the page draws."""
        rows = self.live()
        self.rates.observe(rows)
        wanted = self.control.wanted()
        failures = self.last_failures({str(r.get("queue") or "") for r in rows} - {""})
        rows.sort(key=lambda r: (r["port"], r["container"]))
        out = []
        for index, row in enumerate(rows):
            first = index == 0 or rows[index - 1]["port"] != row["port"]
            switch = wanted.get(row["port"])
            out.append({
                **row,
                "reason": mask_secrets(str(row.get("reason") or "")),
                "first_of_port": first,
                "span": sum(1 for r in rows if r["port"] == row["port"]),
                "wanted": switch.state if switch else "started",
                "chart": Chart.of(self.rates.series((row["container"], row["port"]))),
                "last_failure": failures.get(str(row.get("queue") or ""), ""),
                "batch_figures": batch_figures(row),  # as mdb ports shows them
            })
        return out

    def last_failures(self, queues: set[str]) -> dict[str, str]:
        """Per queue, the type and message of its last failed delivery (a traceback's last line)."""
        t = self.store.tables.delivery
        found: dict[str, str] = {}
        with self.store.engine.connect() as conn:
            for queue in sorted(queues):
                text = conn.execute(
                    select(t.c.last_exception).where(t.c.queue == queue, t.c.last_exception.is_not(None))
                    .order_by(t.c.updated_at.desc()).limit(1)
                ).scalar()
                if text:
                    lines = [line for line in str(text).splitlines() if line.strip()]
                    found[queue] = mask_secrets(lines[-1].strip()) if lines else ""
        return found
