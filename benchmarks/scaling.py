"""Scaling of a CPU-bound handler with ``mdb run --processes N`` (RabbitMQ, PostgreSQL for control).

Each message costs about 1 ms of pure Python (benchmarks/listeners_scaling.py,
calibrated here on this machine's CPU time). For each set-up (processes x
consumer threads per process) the supervisor starts with the port stopped,
N persistent messages are loaded, ``mdb port start`` lets every process
consume, and the rate is N over the time from the first handled message (in
any process) to the last. "cores used" is the CPU time of all the container
processes over that time: on an idle 2-core machine it cannot pass 2, which
is where the rate flattens; on a busy one it shows the share they got. ``--processes 1`` with two consumer threads shows
what threads give a CPU-bound handler: the GIL lets one run at a time.
Not a test: it prints figures and the load average, which on a shared
machine moves them a lot. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import kombu
from sqlalchemy import create_engine, text

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository, for a checkout without an editable install
import listeners_scaling as ls  # noqa: E402  (the script's own folder is on sys.path)

from mdbcontainer.settings import load_settings  # noqa: E402
from mdbcontainer.state.control import Control  # noqa: E402
from mdbcontainer.state.store import Store  # noqa: E402
from mdbcontainer.testing import wait_for, write_settings  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PORT = "BenchCpu"
PREFETCH = 100  # enough buffered per consumer that a slow broker on a busy machine does not starve it
SETUPS = [(1, 1), (1, 2), (2, 1), (4, 1)]  # (processes, consumer threads per process)


class BenchError(Exception):
    """A run did not drain its messages (the script exits 1)."""


def calibrate(target: float = 0.001) -> int:
    """Loop iterations that cost ``target`` seconds of this thread's CPU time (the best of five)."""
    probe = 200_000
    best = min(_cpu(probe) for _ in range(5))
    return max(1, round(probe * target / best))


def _cpu(iterations: int) -> float:
    start = time.thread_time()
    ls.spin(iterations)
    return time.thread_time() - start


@dataclass(frozen=True)
class Measure:
    """One run: messages per second, and the CPU the container processes used."""

    rate: float
    cores: float  # CPU seconds per wall-clock second, all processes together
    cpu_ms: float  # CPU milliseconds per message, all processes together


@dataclass
class Result:
    processes: int
    threads: int
    runs: list[Measure] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return statistics.median(m.rate for m in self.runs)

    @property
    def cores(self) -> float:
        return statistics.median(m.cores for m in self.runs)

    @property
    def cpu_ms(self) -> float:
        return statistics.median(m.cpu_ms for m in self.runs)


class Run:
    """One supervisor's queue, schema and folder; ``close()`` removes them."""

    def __init__(self, processes: int, threads: int, n: int, spin: int, transaction: str,
                 prefetch: int) -> None:
        self.processes, self.n = processes, n
        self.tag = uuid.uuid4().hex[:8]
        self.queue, self.schema = f"scaling-{self.tag}", f"scaling_{self.tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix="mdb-scaling-"))
        self.engine = create_engine(POSTGRES_URL)
        with self.engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        self.settings = write_settings(self.tmp / "settings.toml", {
            "container": {"broker_url": RABBITMQ_URL, "database_url": POSTGRES_URL,
                          "listeners": ["listeners_scaling"], "db_schema": self.schema,
                          "dead_letter_queue": f"{self.queue}.DLQ", "control_interval": "100ms",
                          "log_level": "WARNING"},
            "ports": {PORT: {"destination": self.queue, "transaction": transaction,
                             "concurrency": threads, "prefetch": prefetch}},
        })
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
                    "BENCH_DIR": str(self.tmp), "BENCH_SPIN": str(spin)}

    def mdb(self, *args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "mdbcontainer", *args, "-c", str(self.settings)],
                              env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise BenchError(f"mdb {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")

    def handled(self) -> tuple[int, int]:
        """Messages handled so far over every container's heartbeat (as ``mdb ports``), and containers."""
        store = Store(load_settings(self.settings, environ={}).container)
        try:
            rows = Control(store).live()
        finally:
            store.dispose()
        return sum(int(r["handled"]) for r in rows if r["port"] == PORT), len(rows)

    def load(self) -> None:
        with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as conn:
            channel = conn.channel()
            channel.queue_declare(queue=self.queue, durable=True, auto_delete=False)
            producer = kombu.Producer(channel)
            for i in range(self.n):
                producer.publish({"n": i}, exchange="", routing_key=self.queue, serializer="json",
                                 delivery_mode=2, message_id=f"{self.tag}-{i}")
            wait_for(lambda: channel.queue_declare(queue=self.queue, passive=True).message_count
                     == self.n, 60, 0.1, f"{self.n} messages on {self.queue}")

    def measure(self) -> Measure:
        """Start the supervisor with the port stopped, load, start the port, drain; msg/s."""
        self.mdb("port", "stop", PORT)
        log = (self.tmp / "supervisor.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "mdbcontainer", "run", "-c", str(self.settings),
             "--processes", str(self.processes)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            wait_for(lambda: self._alive(proc) and self.handled()[1] == self.processes, 120, 0.2,
                     f"{self.processes} container processes to register")
            self.load()
            self.mdb("port", "start", PORT)
            wait_for(lambda: self._alive(proc) and self.handled()[0] >= self.n, 60 + self.n / 50,
                     0.2, f"{self.n} messages handled")
            proc.send_signal(signal.SIGTERM)
            if proc.wait(60) != 0:
                raise BenchError(f"the supervisor exited with {proc.returncode}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        return self._rate()

    def _alive(self, proc: subprocess.Popen[bytes]) -> bool:
        if proc.poll() is not None:
            tail = (self.tmp / "supervisor.log").read_text(errors="replace").strip().splitlines()
            raise BenchError(f"the supervisor exited with {proc.returncode}: {(tail or ['-'])[-1]}")
        return True

    def _rate(self) -> Measure:
        stats = [tuple(float(x) for x in p.read_text().split()) for p in self.tmp.glob("*.txt")]
        count = int(sum(s[0] for s in stats))
        if count != self.n:
            raise BenchError(f"{count} messages handled, {self.n} sent")
        wall = max(s[2] for s in stats) - min(s[1] for s in stats)
        cpu = sum(s[3] for s in stats)
        return Measure(self.n / wall, cpu / wall, cpu / self.n * 1000)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as conn:
                channel = conn.channel()
                for name in (self.queue, f"{self.queue}.DLQ"):
                    channel.queue_delete(queue=name)
        except Exception as exc:
            print(f"warning: queue {self.queue} left on RabbitMQ: {exc}", file=sys.stderr)
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()


def loads() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def report(results: list[Result]) -> None:
    base = results[0].rate
    print(f"\n{'processes':>9} {'threads':>7} {'msg/s':>7} {'ratio':>6} {'cores used':>10} "
          f"{'CPU ms/msg':>10}  runs (msg/s)")
    for r in results:
        runs = " ".join(f"{m.rate:,.0f}" for m in r.runs)
        print(f"{r.processes:>9} {r.threads:>7} {r.rate:>7,.0f} {r.rate / base:>6.2f} {r.cores:>10.2f} "
              f"{r.cpu_ms:>10.2f}  {runs}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000, help="messages per run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per set-up (the median counts)")
    parser.add_argument("--prefetch", type=int, default=PREFETCH, help="per consumer")
    parser.add_argument("--transaction", choices=["none", "container"], default="none",
                        help="the port's transaction kind (container: once-only CMT, a commit a message)")
    args = parser.parse_args()
    spin = calibrate()
    print(f"N={args.n}, transaction {args.transaction}, prefetch {args.prefetch}, {spin} loop iterations "
          f"= 1 ms of CPU per message; {os.cpu_count()} cores; load averages before: {loads()}")
    results = [Result(p, t) for p, t in SETUPS]
    try:
        for _ in range(args.repeat):
            for result in results:
                run = Run(result.processes, result.threads, args.n, spin, args.transaction,
                          args.prefetch)
                try:
                    result.runs.append(run.measure())
                finally:
                    run.close()
                last = result.runs[-1]
                print(f"  {result.processes} process(es) x {result.threads} thread(s): "
                      f"{last.rate:,.0f} msg/s, {last.cores:.2f} cores (load {loads()})", flush=True)
    except Exception as exc:  # one line; queues and schemas are removed all the same
        print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    report(results)
    print(f"\nload averages after: {loads()} (shared machine: other work competes for the cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
