"""Ports for the tests of ``TestContainer`` (tests/testing): an order handler, batched and plain.

``KitOrders`` (container-managed, once-only) stores an ``Order`` row and sends
an event to the topic ``kit.events`` (or the body's ``events``) through the outbox. The body says how it
behaves: ``{"order_id": 1, "amount": "9.99"}`` works; ``"fail": K`` raises
while the message's redelivery count is below K (``K = 99``: poison);
``"hold": true`` waits until :data:`RELEASE` is set (a handler still busy).
``KitBatch`` is the same handler on a batched port; ``KitPlain`` has no
transaction. Every call is appended to :data:`CALLS` as (port, message id,
redelivery count), rolled back or not.
"""

from __future__ import annotations

import threading

from pydantic import BaseModel
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdbcontainer import Message, MessageContext, message_driven

CALLS: list[tuple[str, str, int]] = []
RELEASE = threading.Event()


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "kit_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    amount: Mapped[str] = mapped_column(String(20))


class OrderPlaced(BaseModel):
    order_id: int
    amount: str
    fail: int = 0
    hold: bool = False
    events: str = "kit.events"  # the topic of its event (a test on a shared broker names its own)


def _apply(port: str, order: OrderPlaced, ctx: MessageContext) -> None:
    CALLS.append((port, ctx.message.id, ctx.message.redelivery_count))
    if order.hold:
        RELEASE.wait(30)
    if ctx.message.redelivery_count < order.fail:
        raise ValueError(f"amount {order.amount} refused (delivery {ctx.message.redelivery_count})")
    ctx.session.add(Order(id=order.order_id, amount=order.amount))
    ctx.send(order.events, {"order_id": order.order_id, "event": "placed"},
             message_id=f"{ctx.message.id}.placed")


@message_driven("KitOrders", destination="KIT.ORDERS")
def on_order(order: OrderPlaced, ctx: MessageContext) -> None:
    _apply("KitOrders", order, ctx)


@message_driven("KitBatch", destination="KIT.BATCH", batch_size=3)
def on_batched_order(order: OrderPlaced, ctx: MessageContext) -> None:
    _apply("KitBatch", order, ctx)


@message_driven("KitPlain", destination="KIT.PLAIN", transaction="none")
def on_plain(message: Message, ctx: MessageContext) -> None:
    CALLS.append(("KitPlain", message.id, message.redelivery_count))
    if message.redelivery_count < int((message.body or {}).get("fail", 0)):
        raise ValueError(f"plain message {message.id} refused")


def calls(message_id: str) -> list[int]:
    """The redelivery counts the handlers saw for ``message_id``, in order."""
    return [count for _port, mid, count in CALLS if mid == message_id]
