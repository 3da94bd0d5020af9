"""Sends from a web application, atomic with its transaction: orders placed over HTTP.

Run it: ``python samples/web_orders/run.py`` (``--keep`` keeps the scratch directory;
Starlette, uvicorn and httpx: ``pip install 'mdbcontainer[console]' httpx``).

1. ``mdb run`` runs port ``OrdersPort`` and the outbox relay; the web application
   (app.py, Starlette under uvicorn) is a process of its own, with no broker
   connection.
2. 20 orders are placed with ``POST /orders``: each stores the order and sends
   ``OrderPlaced`` through the outbox in one transaction; the port confirms each.
3. An order with a negative amount is refused after its send was made: its
   transaction rolls back, and no event ever leaves.
4. ``mdb outbox``: nothing waits; SIGTERM stops both processes cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from _support import Walk, main
from sqlalchemy import create_engine, text

PORT = "OrdersPort"
ORDERS = 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def walk_through(walk: Walk) -> None:
    walk.say("Start the container (port OrdersPort and the outbox relay) and the web application")
    container = walk.start()
    container.wait_started(PORT)
    http_port = free_port()
    log = (walk.tmp / "web.log").open("ab")
    web = subprocess.Popen([sys.executable, "-m", "uvicorn", "app:app", "--port", str(http_port),
                            "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "MDB_SETTINGS": str(walk.settings_path)})
    log.close()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10) as client:
            walk.wait_for(lambda: _answers(client), "the web application to answer")
            walk.note(f"$ uvicorn app:app --port {http_port}")
            place_and_refuse(walk, client)
    finally:
        web.send_signal(signal.SIGTERM)
        code = web.wait(30)
        walk.expect(code in (0, -signal.SIGTERM), f"SIGTERM: the web application stops ({code})")
    walk.mdb("outbox")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/orders/0").status_code == 404
    except httpx.TransportError:
        return False


def place_and_refuse(walk: Walk, client: httpx.Client) -> None:
    walk.say(f"Place {ORDERS} orders: POST /orders (the order and its event in one transaction)")
    answers = [client.post("/orders", json={"order_id": n, "amount": f"{n}.50"})
               for n in range(1, ORDERS + 1)]
    walk.note(f"POST /orders {{order_id: 1, amount: 1.50}}: {answers[0].status_code} {answers[0].json()}")
    walk.expect([a.status_code for a in answers] == [201] * ORDERS, f"{ORDERS} orders placed (201)")
    walk.wait_for(lambda: walk.ports()[PORT]["handled"] == ORDERS, f"{ORDERS} events handled")
    statuses = [client.get(f"/orders/{n}").json()["status"] for n in range(1, ORDERS + 1)]
    walk.note(f"GET /orders/1: {client.get('/orders/1').json()}")
    walk.expect(statuses == ["confirmed"] * ORDERS, f"{ORDERS} orders confirmed by the port, each once")

    walk.say("An order the shop refuses after its send was made: the transaction rolls back")
    refused = client.post("/orders", json={"order_id": 99, "amount": "-5"})
    walk.note(f"POST /orders {{order_id: 99, amount: -5}}: {refused.status_code} {refused.json()}")
    walk.expect(refused.status_code == 422, "refused")
    walk.expect(client.get("/orders/99").status_code == 404, "no order 99 stored")
    walk.mdb("ports")
    walk.expect(walk.ports()[PORT]["delivered"] == ORDERS, "no event for order 99 ever left")
    walk.expect(confirmations(walk) == ORDERS, f"{ORDERS} orders stored, each confirmed exactly once")


def confirmations(walk: Walk) -> int:
    engine = create_engine(walk.settings.container.database_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(
                text("SELECT count(*) FROM sample_orders WHERE status = 'confirmed'")).scalar() or 0)
    finally:
        engine.dispose()


if __name__ == "__main__":
    main(walk_through, __file__)
