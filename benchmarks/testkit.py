"""A test of three messages, start to end: ``TestContainer`` beside FastStream's ``TestRabbitBroker``.

One "test" is what a user's test of the README's order handler does:

- mdbcontainer: ``TestContainer("settings.example.toml", ports=["OrdersPort"])``
  (the real container in this process, embedded broker and SQLite in a fresh
  temporary folder, the tables created), three orders sent, ``drain()``, the
  outcomes and the events sent asserted, the container stopped.
- FastStream: the same handler as a FastStream subscriber (the order stored
  with SQLAlchemy in a fresh SQLite file, the event published to the topic
  ``orders.events``) under ``TestRabbitBroker`` (its in-memory fake broker),
  three orders published, the calls asserted.

Both run in this process, interleaved, 50 times each after two warm-up runs
(the first pays the imports); the figures are the median and p95 of the
wall time of one test, and the median of its CPU time (all threads of the
process: on a busy machine the wall time is mostly waiting for a core). FastStream comes from the ``bench`` extra
(``pip install -e '.[bench]'``); without it the kit's figures are printed
alone, with a note. The machine's load (``uptime``) is printed with them.

    .venv/bin/python benchmarks/testkit.py [--runs 50]
"""

# No ``from __future__ import annotations``: FastStream reads the handler's annotations at run
# time, in the scope where it was defined (a local import of OrderPlaced).
import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "settings.example.toml"
ORDERS = [{"order_id": n, "amount": "9.99"} for n in (1, 2, 3)]


def kit_test() -> None:
    """The user's test on the kit: three orders handled, their events sent."""
    from mdbcontainer.testing import TestContainer

    with TestContainer(SETTINGS, ports=["OrdersPort"]) as mdb:
        for n, body in enumerate(ORDERS):
            mdb.send("ORDERS", body, message_id=f"o-{n}")
        mdb.drain()
        assert mdb.outcomes("OrdersPort") == {"handled": 3}
        assert sorted(m.body["order_id"] for m in mdb.sent("orders.events")) == [1, 2, 3]


def faststream_test() -> Callable[[], None] | None:
    """The same handler and test on FastStream's TestRabbitBroker; None when it is not installed."""
    try:
        from faststream.rabbit import RabbitBroker, RabbitExchange, RabbitQueue, TestRabbitBroker
    except ImportError:
        return None
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from listeners.orders import Base, Order, OrderPlaced

    def run() -> None:
        folder = Path(tempfile.mkdtemp(prefix="fs-test-", dir=_scratch()))
        engine = create_engine(f"sqlite:///{folder / 'app.db'}")
        Base.metadata.create_all(engine)
        broker = RabbitBroker()
        events = RabbitExchange("orders.events", type="topic")
        seen: list[int] = []

        @broker.subscriber("ORDERS")
        async def on_order(order: OrderPlaced) -> None:
            with Session(engine) as session, session.begin():
                session.add(Order(id=order.order_id, amount=order.amount))
            await broker.publish({"order_id": order.order_id, "event": "placed"}, exchange=events,
                                 routing_key="orders.events")

        @broker.subscriber(RabbitQueue("audit", routing_key="#"), exchange=events)
        async def on_event(event: dict[str, Any]) -> None:
            seen.append(int(event["order_id"]))

        async def test() -> None:
            async with TestRabbitBroker(broker) as br:
                for n, body in enumerate(ORDERS):
                    await br.publish(body, "ORDERS", message_id=f"o-{n}")
                assert on_order.mock is not None and on_order.mock.call_count == 3
                assert sorted(seen) == [1, 2, 3]

        try:
            asyncio.run(test())
        finally:
            engine.dispose()
            shutil.rmtree(folder, ignore_errors=True)

    return run


def _scratch() -> str | None:
    """The folder the kit puts its files in (/dev/shm where there is one): FastStream's SQLite too."""
    from mdbcontainer.testing.kit import _scratch as kit_scratch

    return kit_scratch()


def timed(test: Callable[[], None]) -> tuple[float, float]:
    """Wall time and CPU time (every thread of this process) of one test."""
    began, cpu = time.perf_counter(), time.process_time()
    test()
    return time.perf_counter() - began, time.process_time() - cpu


def figures(name: str, times: list[tuple[float, float]]) -> str:
    ordered = sorted(wall for wall, _ in times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    cpu = statistics.median(c for _, c in times)
    return (f"{name:<30} median {statistics.median(ordered) * 1000:7.1f} ms   "
            f"p95 {p95 * 1000:7.1f} ms   min {ordered[0] * 1000:6.1f} ms   "
            f"CPU median {cpu * 1000:6.1f} ms   ({len(ordered)} runs)")


def load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average {os.getloadavg()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    os.chdir(ROOT)  # the settings' listeners (listeners.orders) are found from here
    sys.path.insert(0, str(ROOT))
    contestants: dict[str, Callable[[], None]] = {"mdbcontainer TestContainer": kit_test}
    faststream = faststream_test()
    if faststream is None:
        print("note: faststream is not installed (pip install -e '.[bench]'): "
              "the kit's figures alone", flush=True)
    else:
        contestants["FastStream TestRabbitBroker"] = faststream
    for test in contestants.values():  # warm-up: imports, first connections
        test()
        test()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contestants}
    print(f"before: {load()}", flush=True)
    for _ in range(args.runs):
        for name, test in contestants.items():
            times[name].append(timed(test))
    print(f"after:  {load()}")
    print("a test of three messages, start to end (wall time; CPU: every thread of this process):")
    for name, measured in times.items():
        print(figures(name, measured))


if __name__ == "__main__":
    main()
