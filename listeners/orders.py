"""Sample: an orders listener with a typed body, container-managed transaction, once-only.

Send one from a second terminal::

    mdb send ORDERS '{"order_id": 1, "amount": "9.99"}' -c settings.example.toml
"""

from __future__ import annotations

import logging
from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import Integer, Numeric, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdbcontainer import MessageContext, message_driven

log = logging.getLogger("listeners.orders")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sample_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(12, 2))
    status: Mapped[str] = mapped_column(String(20), default="placed")


class OrderPlaced(BaseModel):
    order_id: int
    amount: Decimal


@message_driven("OrdersPort")
def on_order(order: OrderPlaced, ctx: MessageContext) -> None:
    """Record the order; the container commits it with the dedup row, then acknowledges.

    The ``sample_orders`` table exists before the first delivery: the settings
    name ``Base`` as ``container.metadata``, so the container creates the
    missing tables at start (a real service migrates them with Alembic).
    """
    ctx.session.add(Order(id=order.order_id, amount=order.amount))
    ctx.send("orders.events", {"order_id": order.order_id, "event": "placed"})
    log.info("order %s placed (%s)", order.order_id, order.amount)
