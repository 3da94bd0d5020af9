"""A Starlette web application that places orders and announces them through the outbox.

``POST /orders`` stores the order and sends ``OrderPlaced`` in one database
transaction, through ``Outbox.send`` and the request's own ``AsyncSession``:
committed, the event will be published (by the relay of a running ``mdb run``
or ``mdb relay``); rolled back (a refused order), it never will be. The web
process holds no broker connection.

Run it: ``uvicorn app:app`` in this folder (Starlette and uvicorn: ``pip install
'mdbcontainer[console]'``; the settings from ``$MDB_SETTINGS``, else
``./settings.toml``).
"""

from __future__ import annotations

import os
from decimal import Decimal, InvalidOperation

from orders import Order
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mdbcontainer import Outbox, load_settings

settings = load_settings(os.environ.get("MDB_SETTINGS", "settings.toml"))
outbox = Outbox.from_settings(settings)  # no broker connection: it only writes rows


def async_database(url: str) -> str:
    """The container's database through an async driver: aiosqlite, or psycopg's async mode."""
    parsed = make_url(url)
    driver = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg_async"}
    return parsed.set(drivername=driver[parsed.get_backend_name()]).render_as_string(hide_password=False)


engine = create_async_engine(async_database(settings.container.database_url))


class Refused(Exception):
    """An order the shop does not take; its transaction rolls back, its event with it."""


async def place_order(request: Request) -> JSONResponse:
    data = await request.json()
    order_id = int(data["order_id"])
    try:
        async with AsyncSession(engine) as session, session.begin():
            session.add(Order(id=order_id, amount=str(data["amount"])))
            outbox.send(session, "ORDERS", {"order_id": order_id, "amount": str(data["amount"])},
                        message_id=f"order-{order_id}")
            check_amount(str(data["amount"]))  # after the send: a refusal takes it back too
    except Refused as exc:
        return JSONResponse({"error": str(exc)}, status_code=422)
    return JSONResponse({"order_id": order_id, "status": "placed"}, status_code=201)


def check_amount(amount: str) -> None:
    try:
        if Decimal(amount) > 0:
            return
    except InvalidOperation:
        pass
    raise Refused(f"amount {amount!r} is not a positive number")


async def show_order(request: Request) -> JSONResponse:
    async with AsyncSession(engine) as session:
        order = await session.get(Order, int(request.path_params["order_id"]))
    if order is None:
        return JSONResponse({"error": "no such order"}, status_code=404)
    return JSONResponse({"order_id": order.id, "amount": order.amount, "status": order.status})


app = Starlette(routes=[
    Route("/orders", place_order, methods=["POST"]),
    Route("/orders/{order_id:int}", show_order, methods=["GET"]),
])
