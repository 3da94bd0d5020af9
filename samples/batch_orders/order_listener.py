"""A batch handler: a list of orders in, one bulk insert per batch.

``batch=True`` makes the handler take a ``list[OrderPlaced]`` (the element
type decides what each item is, as a per-message handler's first parameter
does) and a ``BatchContext``. The container claims the dedup rows of the
whole batch in one statement, calls the handler once with the orders that
were not seen before, and commits once. An order with a negative amount
raises: the batch rolls back, and each order is run again alone, so only
that one fails.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel
from sqlalchemy import Integer, String, insert
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdbcontainer import BatchContext, message_driven

log = logging.getLogger("order_listener")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sample_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sku: Mapped[str] = mapped_column(String(40))
    amount: Mapped[int] = mapped_column(Integer)
    message_id: Mapped[str] = mapped_column(String(255))


class OrderPlaced(BaseModel):
    sku: str
    amount: int


@message_driven("OrdersPort", batch=True)
def on_orders(orders: list[OrderPlaced], ctx: BatchContext) -> None:
    Base.metadata.create_all(ctx.session.connection())  # a real service migrates with Alembic
    for order, message in zip(orders, ctx.messages, strict=True):
        if order.amount < 0:
            raise ValueError(f"order {message.id}: a negative amount ({order.amount})")
    ctx.session.execute(insert(Order), [
        {"sku": o.sku, "amount": o.amount, "message_id": m.id}
        for o, m in zip(orders, ctx.messages, strict=True)
    ])
    log.warning("stored a batch of %d order(s)", len(orders))
