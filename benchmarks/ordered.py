"""Ordered ports against the same port unordered (docs/guides/ordered-ports.md), on RabbitMQ.

```
.venv/bin/python benchmarks/ordered.py [--n 2000] [--n-serial 500] [--sleep 0.005] [--rounds 1]
```

Every contestant drains the same N persistent JSON messages, spread evenly over
100 keys (``{"key": "k17", "seq": 3}``), from a fresh durable queue, through
port ``BenchOrdered`` (``benchmarks/listeners_ordered.py``): a handler that
sleeps 5 ms (I/O-bound), ``transaction = "none"``. The queue is loaded first,
then ``mdb run`` starts; a contestant is timed in the handler, from its first
message to its N-th.

- **ordered vs unordered**, at ``concurrency`` 1, 8 and 32: ``order_by =
  "body:key"`` (one consumer, per-key lanes, ``concurrency`` workers, the
  default prefetch ``max(1000, 8 x concurrency)``) against the same port without
  ``order_by`` (``concurrency`` consumers, prefetch 10 each). Goal: >= 0.8x.
- **one hot key among 100**, ``concurrency`` 8: N messages of the 100 keys plus
  N/4 more of a key ``hot``; the time until the last message of the other keys
  is done, against the same N messages without the hot key. With the default
  prefetch (1000) and with ``prefetch = 100``: the hot key's backlog waits
  unacknowledged in the container, and once it fills the prefetch window the
  other keys wait for it (the limit the guide documents).

The load averages before and after are printed: the figures of a busy machine
are not those of an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from mdbcontainer import Producer, load_settings  # noqa: E402
from mdbcontainer.testing import ContainerProcess, write_settings  # noqa: E402

BROKER = "amqp://guest:guest@127.0.0.1:5672//"
KEYS = 100


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def settings_for(tmp: Path, queue: str, port: dict[str, Any]) -> Path:
    data = {
        "container": {"broker_url": BROKER, "database_url": f"sqlite:///{tmp / 'container.db'}",
                      "listeners": ["listeners_ordered"], "dead_letter_queue": f"{queue}.DLQ",
                      "control_interval": "1s"},
        "queues": {queue: {}},
        "ports": {"BenchOrdered": {"destination": queue, "transaction": "none", "max_retries": 1000,
                                   **port}},
    }
    return write_settings(tmp / f"{queue}.toml", data)


def publish(settings: Path, queue: str, bodies: list[dict[str, Any]]) -> None:
    with Producer.from_settings(load_settings(settings, environ={})) as producer:
        for index, body in enumerate(bodies):
            producer.send(queue, body, message_id=f"{body['key']}-{index}")


def run(tmp: Path, port: dict[str, Any], bodies: list[dict[str, Any]], sleep: float) -> dict[str, float]:
    """Load the queue, start mdb run, wait for the handler's stamp; its times."""
    queue = f"BENCH.ORDERED.{uuid.uuid4().hex[:8]}"
    settings = settings_for(tmp, queue, port)
    publish(settings, queue, bodies)
    stamp = tmp / f"{queue}.stamp"
    env = {"BENCH_N": str(len(bodies)), "BENCH_STAMP": str(stamp), "BENCH_SLEEP": str(sleep),
           "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
    with ContainerProcess(settings, env=env, cwd=HERE) as container:
        deadline = time.monotonic() + 600
        while not stamp.exists():
            if time.monotonic() > deadline or not container.alive():
                raise RuntimeError(f"no stamp: {container.output()[-2000:]}")
            time.sleep(0.2)
        container.terminate()
    _delete(queue)
    times: dict[str, float] = json.loads(stamp.read_text())
    return times


def _delete(queue: str) -> None:
    import kombu

    with kombu.Connection(BROKER) as conn:
        channel = conn.channel()
        for name in (queue, f"{queue}.DLQ"):
            channel.queue_delete(queue=name)


def spread(n: int, hot: int = 0) -> list[dict[str, Any]]:
    """N bodies over 100 keys, round robin; ``hot`` more of key ``hot`` mixed in evenly."""
    bodies = [{"key": f"k{i % KEYS}", "seq": i // KEYS} for i in range(n)]
    if hot:
        every = max(1, n // hot)
        for j in range(hot):
            bodies.insert(min(len(bodies), j * (every + 1)), {"key": "hot", "seq": j})
    return bodies


def compare(tmp: Path, args: argparse.Namespace) -> list[tuple[int, float, float]]:
    rows = []
    for concurrency in (1, 8, 32):
        n = args.n_serial if concurrency == 1 else args.n
        bodies = spread(n)
        plain = run(tmp, {"concurrency": concurrency}, bodies, args.sleep)
        ordered = run(tmp, {"concurrency": concurrency, "order_by": "body:key"}, bodies, args.sleep)
        rate_plain = (n - 1) / (plain["last"] - plain["first"])
        rate_ordered = (n - 1) / (ordered["last"] - ordered["first"])
        print(f"  concurrency {concurrency:>2}: unordered {rate_plain:8,.0f} msg/s, ordered "
              f"{rate_ordered:8,.0f} msg/s, ordered/unordered {rate_ordered / rate_plain:.2f} "
              f"(goal >= 0.80); load {load()}", flush=True)
        rows.append((concurrency, rate_plain, rate_ordered))
    return rows


def hot_key(tmp: Path, args: argparse.Namespace) -> None:
    n = args.n
    for prefetch in (None, 100):
        port: dict[str, Any] = {"concurrency": 8, "order_by": "body:key"}
        if prefetch:
            port["prefetch"] = prefetch
        cold = run(tmp, port, spread(n), args.sleep)
        hot = run(tmp, port, spread(n, hot=n // 4), args.sleep)
        alone = cold["last_other"] - cold["first"]
        beside = hot["last_other"] - hot["first"]
        print(f"  hot key (+{n // 4} messages of one key), concurrency 8, prefetch "
              f"{prefetch or 'default (1000)'}: the other keys done in {beside:.2f}s, "
              f"{alone:.2f}s without the hot key ({beside / alone:.2f}x); the hot key done after "
              f"{hot['last'] - hot['first']:.2f}s (its floor: {n // 4 * args.sleep:.2f}s serial); "
              f"load {load()}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--n-serial", type=int, default=500, help="messages at concurrency 1")
    parser.add_argument("--sleep", type=float, default=0.005, help="the handler's I/O wait")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scenario", choices=["compare", "hot", "all"], default="all")
    args = parser.parse_args()
    print(f"N={args.n} over {KEYS} keys (concurrency 1: {args.n_serial}), handler sleep "
          f"{args.sleep * 1000:.0f} ms; {os.cpu_count()} cores; load averages before: {load()}",
          flush=True)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}", flush=True)
            if args.scenario in ("compare", "all"):
                compare(tmp, args)
            if args.scenario in ("hot", "all"):
                hot_key(tmp, args)
    print(f"load averages after: {load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
