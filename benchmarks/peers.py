"""Python peers against the same RabbitMQ: Celery, Dramatiq and FastStream, at-least-once.

Each peer drains N persistent messages from a fresh durable queue with one
consumer, prefetch 100, acknowledging after its handler (Celery
``acks_late`` on the threads pool, Dramatiq's own ack-after-processing,
FastStream ``AckPolicy.NACK_ON_ERROR``), with the same trivial handler (read
the message's ``n``). In the same rounds, interleaved: the plain kombu
consumer (ack each, no database) every ratio is taken against, and
``mdb run`` with the batched exactly-once port of throughput.py
(``BenchBatch``: CMT, once-only, a batch handler doing one bulk insert,
batch_size 100).

The peers are installed only into this script's own environment,
``benchmarks/.peers-venv`` (made on first use with ``python -m venv`` and
pip); they are never dependencies of the package. The harness runs in the
project's .venv; each peer's producer and worker run as a subprocess of the
peers' Python (``peers.py _load|_work PEER ...``), timed by the worker from
its first message to its N-th.

    .venv/bin/python benchmarks/peers.py [--n 20000] [--repeat 3] [--peers celery,dramatiq,faststream]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VENV = HERE / ".peers-venv"
PYTHON = VENV / "bin" / "python"
REQUIREMENTS = ["celery>=5.3", "dramatiq[rabbitmq]>=1.15", "faststream[rabbit]>=0.5"]
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"  # kombu's spelling of the vhost "/"
PIKA_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"  # pika's and aio-pika's
PREFETCH = 100
PEERS = ("celery", "dramatiq", "faststream")
# --async: FastStream and mdb run on the same I/O-bound handler (await asyncio.sleep(0.02)).
IO_WAIT = 0.02


# -- the peer side (runs in .peers-venv; imports no mdbcontainer) ---------------------------

class Stamp:
    """Counts handled messages; at the N-th writes first-to-N-th wall and CPU seconds to a file."""

    def __init__(self, n: int, path: str) -> None:
        self.n, self.path, self.count = n, path, 0
        self.first = self.first_cpu = 0.0

    def tick(self) -> None:
        if self.count == 0:
            self.first, self.first_cpu = time.perf_counter(), time.thread_time()
        self.count += 1
        if self.count == self.n:
            elapsed = time.perf_counter() - self.first
            cpu = time.thread_time() - self.first_cpu
            Path(self.path).write_text(f"{elapsed!r} {cpu!r}\n")


def work(n: Any) -> int:
    """The trivial work every contestant does: read the message's number."""
    return int(n)


def celery_app(queue: str, stamp: Stamp | None) -> tuple[Any, Any]:
    from celery import Celery

    app = Celery("peers", broker=RABBITMQ_URL)
    app.conf.update(task_acks_late=True, worker_prefetch_multiplier=PREFETCH,
                    task_default_queue=queue, task_ignore_result=True,
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)

    @app.task(name="touch")  # type: ignore[misc]
    def touch(n: int) -> None:
        work(n)
        if stamp is not None:
            stamp.tick()

    return app, touch


def dramatiq_actor(queue: str, stamp: Stamp | None) -> tuple[Any, Any]:
    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker = RabbitmqBroker(url=PIKA_URL)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=queue, max_retries=0)  # type: ignore[misc]
    def touch(n: int) -> None:
        work(n)
        if stamp is not None:
            stamp.tick()

    return broker, touch


async def faststream_load(queue: str, n: int) -> None:
    from faststream.rabbit import RabbitBroker, RabbitQueue

    broker = RabbitBroker(PIKA_URL)
    await broker.connect()
    await broker.declare_queue(RabbitQueue(queue, durable=True))
    for i in range(n):
        await broker.publish({"n": i}, queue=queue, persist=True)
    await broker.stop()


async def faststream_work(queue: str, stamp: Stamp, wait: float = 0.0) -> None:
    from faststream import AckPolicy
    from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

    broker = RabbitBroker(PIKA_URL)

    @broker.subscriber(RabbitQueue(queue, durable=True), channel=Channel(prefetch_count=PREFETCH),
                       ack_policy=AckPolicy.NACK_ON_ERROR)  # type: ignore[misc]
    async def touch(body: dict[str, Any]) -> None:
        if wait:  # faststream-io: the I/O-bound handler of async_handlers.py
            await asyncio.sleep(wait)
        work(body["n"])
        stamp.tick()

    await broker.start()
    await asyncio.Event().wait()


def peer_load(peer: str, queue: str, n: int) -> None:
    if peer == "celery":
        _, touch = celery_app(queue, None)
        for i in range(n):
            touch.apply_async((i,), queue=queue)
    elif peer == "dramatiq":
        broker, touch = dramatiq_actor(queue, None)
        for i in range(n):
            touch.send(i)
        broker.close()
    else:
        asyncio.run(faststream_load(queue, n))


def peer_work(peer: str, queue: str, n: int, path: str) -> None:
    stamp = Stamp(n, path)
    if peer == "celery":
        app, _ = celery_app(queue, stamp)
        app.worker_main(["worker", "--pool=threads", "--concurrency=1", f"--queues={queue}",
                         "--without-gossip", "--without-mingle", "--without-heartbeat",
                         "--loglevel=WARNING"])
    elif peer == "dramatiq":
        from dramatiq import Worker

        broker, _ = dramatiq_actor(queue, stamp)
        worker = Worker(broker, worker_threads=1)
        worker.queue_prefetch = PREFETCH  # dramatiq 2 reads it from $dramatiq_queue_prefetch
        worker.start()
        while True:
            time.sleep(3600)
    elif peer == "faststream-io":
        asyncio.run(faststream_work(queue, stamp, IO_WAIT))
    else:
        asyncio.run(faststream_work(queue, stamp))


# -- the harness (runs in the project's .venv) ----------------------------------------------

def ensure_venv() -> None:
    """Make benchmarks/.peers-venv with the peers, once (never the package's dependencies)."""
    if PYTHON.exists():
        return
    print(f"creating {VENV} with {', '.join(REQUIREMENTS)}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)


def queue_depth(queue: str) -> int:
    import kombu

    with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as conn:
        return int(conn.channel().queue_declare(queue=queue, passive=True).message_count)


def delete_queues(names: list[str]) -> None:
    import kombu

    with kombu.Connection(RABBITMQ_URL, connect_timeout=5) as conn:
        for name in names:
            try:
                conn.channel().queue_delete(queue=name)
            except Exception:  # a peer that never declared it
                pass


def run_peer(peer: str, n: int, tmp: Path) -> tuple[float, float]:
    """Load n messages the peer's way, then time its worker from the first to the N-th."""
    from mdbcontainer.testing import wait_for

    queue = f"peer-{peer}-{uuid.uuid4().hex[:8]}"
    stamp = tmp / f"{queue}.stamp"
    env = {**os.environ, "PYTHONPATH": ""}
    try:
        subprocess.run([str(PYTHON), __file__, "_load", peer, queue, str(n)], check=True, env=env,
                       timeout=600)
        wait_for(lambda: queue_depth(queue) == n, 60, 0.2, f"{n} messages on {queue}")
        worker = subprocess.Popen([str(PYTHON), __file__, "_work", peer, queue, str(n), str(stamp)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: stamp.exists() or worker.poll() is not None, 120 + n / 20, 0.1,
                     f"{peer} to handle {n} messages")
            if not stamp.exists():
                raise RuntimeError(f"{peer} worker exited {worker.returncode}: "
                                   f"{(worker.stderr.read() if worker.stderr else b'').decode()[-500:]}")
        finally:
            worker.kill()
            worker.wait()
        elapsed, cpu = map(float, stamp.read_text().split())
        return elapsed, cpu
    finally:
        delete_queues([queue, f"{queue}.DQ", f"{queue}.XQ"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds (the median counts)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--no-mdb", action="store_true", help="leave out mdb run's batch port")
    parser.add_argument("--async", dest="io", action="store_true",
                        help="instead: the I/O-bound async handler (20 ms await), FastStream (prefetch "
                             "100) against mdb run's BenchAsyncSleep (concurrency 100)")
    args = parser.parse_args()
    ensure_venv()
    sys.path.insert(0, str(HERE))
    import async_handlers  # noqa: F401  (adds the async ports to throughput.PORTS)
    import throughput as tp

    peers = [p for p in args.peers.split(",") if p]
    names = ["kombu plain", *peers, *([] if args.no_mdb else ["mdb BenchBatch (exactly-once)"])]
    if args.io:
        peers = ["faststream-io"]
        names = ["kombu plain", "faststream-io", "mdb BenchAsyncSleep (async, c=100)"]
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    print(f"N={args.n}, prefetch {PREFETCH}, one consumer, {args.repeat} interleaved round(s); "
          f"load averages before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tp.services_kept_up():
        bench = tp.Bench(args.n)
        try:
            for _ in range(args.repeat):
                for name in names:
                    if name == "kombu plain":
                        timing = tp.hand_written(bench, "plain", args.n)
                    elif name in peers:
                        timing = run_peer(name, args.n, bench.tmp)
                    elif args.io:
                        timing = tp.container(bench, "BenchAsyncSleep", args.n)
                    else:
                        timing = tp.container(bench, "BenchBatch", args.n)
                    timings[name].append(timing)
                    print(f"  {name}: {args.n / timing[0]:,.0f} msg/s", flush=True)
        except Exception as exc:
            print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.close()
    base = statistics.median(args.n / wall for wall, _ in timings["kombu plain"])
    print(f"\n{'contestant':<32}{'msgs/s':>8}{'ratio':>7}  {'runs (msgs/s)':<24}{'CPU us/msg':>11}")
    for name in names:
        rates = [args.n / wall for wall, _ in timings[name]]
        cpu = statistics.median(c / args.n * 1e6 for _, c in timings[name])
        rate = statistics.median(rates)
        runs = " ".join(f"{r:,.0f}" for r in rates)
        print(f"{name:<32}{rate:>8,.0f}{rate / base:>7.2f}  {runs:<24}{cpu:>11,.0f}")
    print(f"\nload averages after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores, shared with whatever else runs)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_load":
        peer_load(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_work":
        peer_work(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
