"""Port ``OrdersPort``: confirms each order the web application placed, exactly once.

The event arrives at least once (the relay publishes it again after a crash,
with the same message id); the container's dedup row commits with the
update, so a second copy is skipped before it reaches this handler.
"""

from __future__ import annotations

from orders import Order, OrderPlaced
from sqlalchemy import update

from mdbcontainer import MessageContext, message_driven


@message_driven("OrdersPort")
def on_order_placed(event: OrderPlaced, ctx: MessageContext) -> None:
    ctx.session.execute(update(Order).where(Order.id == event.order_id).values(status="confirmed"))
