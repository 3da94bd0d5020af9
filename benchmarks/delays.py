"""Redelivery delays that do not hold the line: the good messages' rate with 1% failing.

Pairs of runs of one ``mdb run`` port (``BenchDelayed``: container-managed,
once-only, prefetch 100, one consumer) on RabbitMQ and PostgreSQL, each
draining N persistent messages from a fresh durable queue, the two runs of a
pair side by side (two containers, two queues, two schemas), so that both see
the same load on a shared machine:

- ``clean``: no message fails;
- ``failing``: 1% of them (every 100th) fail twice, with ``redelivery_delay =
  "1s"``, and succeed on their third delivery.

Each run is timed from the first good message handled to the last (the
failing ones are not in the rate). The target: the ``failing`` rate at least
0.9 x the ``clean`` rate of its pair (the median of the pairs' ratios). With the delay slept in the consumer (before this
change) every failure stalled the port for its second: 2 x N/100 seconds.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kombu
from sqlalchemy import create_engine, func, select, text

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository, for a checkout without an editable install
import listeners_bench as lb  # noqa: E402  (the script's own folder is on sys.path)

from mdbcontainer.settings import QueueSettings, load_settings  # noqa: E402
from mdbcontainer.testing import ContainerProcess, wait_for, write_settings  # noqa: E402
from mdbcontainer.wire.connection import Broker  # noqa: E402
from mdbcontainer.wire.delays import wait_queues  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PREFETCH = 100
TARGET = 0.90
QUEUE_KEYS = {"redelivery_delay": "1s", "backout_threshold": 5}


@contextmanager
def services_kept_up() -> Iterator[None]:
    """Hold the machine's disruptive lock shared: runs that stop RabbitMQ or PostgreSQL wait for us."""
    with Path("/tmp/mdb-disruptive.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            print("waiting for /tmp/mdb-disruptive.lock (a run is stopping a service)", flush=True)
            fcntl.flock(handle, fcntl.LOCK_SH)
        yield


class Run:
    """One run's queue (and its wait queues), PostgreSQL schema and scratch folder."""

    def __init__(self, n: int, failing: bool) -> None:
        self.n = n
        self.failing = failing
        self.tag = uuid.uuid4().hex[:8]
        self.queue = f"bench-delays-{self.tag}"
        self.schema = f"bench_{self.tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb-bench-delays-"))
        self.engine = create_engine(POSTGRES_URL)
        self.stamp = self.tmp / "stamp"  # the good messages' timing, written by the handler
        self.began = 0.0
        self.queues = [self.queue, f"{self.queue}.DLQ",
                       *wait_queues(self.queue, QueueSettings(**QUEUE_KEYS))]

    def fails(self, i: int) -> int:
        """Deliveries message ``i`` fails: 2 for every 100th in the failing run."""
        return 2 if self.failing and i % 100 == 50 else 0

    @property
    def good(self) -> int:
        return sum(1 for i in range(self.n) if not self.fails(i))

    def settings(self) -> Path:
        with self.engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        lb.effects_table(self.schema).create(self.engine)
        return write_settings(self.tmp / "settings.toml", {
            "container": {"broker_url": RABBITMQ_URL, "database_url": POSTGRES_URL,
                          "db_schema": self.schema, "listeners": ["listeners_delays"],
                          "dead_letter_queue": f"{self.queue}.DLQ", "control_interval": "500ms"},
            "ports": {"BenchDelayed": {"destination": self.queue, "prefetch": PREFETCH,
                                       "max_retries": 1000}},
            "queues": {self.queue: QUEUE_KEYS},
        })

    def load(self, settings: Path) -> None:
        """Declare the queue and its waits as the container does, and publish the N messages."""
        broker = Broker(load_settings(settings, environ={}))
        with broker.connect() as conn:
            channel = conn.channel()
            broker.declare_queue(channel, self.queue)
            producer = kombu.Producer(channel)
            for i in range(self.n):
                producer.publish({"n": i, "fail": self.fails(i)}, exchange="", routing_key=self.queue,
                                 serializer="json", delivery_mode=2, message_id=f"{self.tag}-{i}")

    def start(self) -> ContainerProcess:
        """Load the queue (neither loading nor start-up is timed), then start the container."""
        settings = self.settings()
        self.load(settings)
        env = {"BENCH_N": str(self.good), "BENCH_STAMP": str(self.stamp), "BENCH_SCHEMA": self.schema,
               "PYTHONPATH": f"{HERE}{os.pathsep}{HERE.parent}"}
        self.began = time.monotonic()
        return ContainerProcess(settings, env=env, cwd=HERE).start(wait=False)

    def finish(self, container: ContainerProcess) -> tuple[float, float, float]:
        """The good messages' rate, the consumer's CPU microseconds per good message, and the
        seconds from the container's start to every message applied (each exactly once)."""
        wait_for(self.stamp.exists, 900, 0.05, f"{self.good} good messages")
        elapsed, cpu = (float(x) for x in self.stamp.read_text().split())
        table = lb.effects_table(self.schema)
        with self.engine.connect() as conn:
            def rows() -> int:
                return int(conn.execute(select(func.count()).select_from(table)).scalar_one())
            wait_for(lambda: rows() == self.n, 300, 0.2, f"all {self.n} messages handled")
            total = time.monotonic() - self.began
            distinct = conn.execute(select(func.count(table.c.message_id.distinct()))).scalar_one()
        if distinct != self.n:
            raise RuntimeError(f"{distinct} distinct messages applied of {self.n}")
        container.terminate()
        return self.good / elapsed, cpu / self.good * 1e6, total

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as broker:
                channel = broker.channel()
                for name in self.queues:
                    channel.queue_delete(queue=name)
        except Exception as exc:
            print(f"warning: queues of {self.queue} left on RabbitMQ: {exc}", file=sys.stderr)
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()


def pair(n: int) -> dict[bool, tuple[float, float, float]]:
    """One clean and one failing run side by side, so that both see the same load."""
    runs = {failing: Run(n, failing) for failing in (False, True)}
    containers: list[ContainerProcess] = []
    try:
        for run in runs.values():
            containers.append(run.start())
        return {failing: run.finish(c) for (failing, run), c in zip(runs.items(), containers, strict=True)}
    finally:
        for container in containers:
            if container.alive():
                container.kill()
        for run in runs.values():
            run.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="messages per run")
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (the median counts)")
    args = parser.parse_args()
    print(f"N={args.n}, prefetch {PREFETCH}, one consumer, container-managed once-only; failing run: "
          f"1% fail twice, redelivery_delay 1s; clean and failing run side by side; load averages "
          f"before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    figures: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    ratios: list[float] = []
    with services_kept_up():
        for _ in range(args.repeat):
            try:
                measured = pair(args.n)
            except Exception as exc:
                print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
            for failing, figure in measured.items():
                figures[failing].append(figure)
            ratios.append(measured[True][0] / measured[False][0])
    print(f"{'run':<8} {'good msg/s':>10}  {'runs':<22} {'CPU us/good msg':>15} {'all applied after':>18}")
    for failing, label in ((False, "clean"), (True, "failing")):
        rates = [f[0] for f in figures[failing]]
        print(f"{label:<8} {statistics.median(rates):>10.0f}  {', '.join(f'{r:.0f}' for r in rates):<22} "
              f"{statistics.median(f[1] for f in figures[failing]):>15.0f} "
              f"{statistics.median(f[2] for f in figures[failing]):>17.1f}s")
    ratio = statistics.median(ratios)
    print(f"ratio failing / clean per pair: {', '.join(f'{r:.2f}' for r in ratios)}; median {ratio:.2f} "
          f"(target >= {TARGET}) {'ok' if ratio >= TARGET else 'BELOW TARGET'}")
    print(f"(a delay slept in the consumer would have stalled the port {2 * (args.n // 100)} s "
          "in the failing run)")
    print(f"load averages after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
