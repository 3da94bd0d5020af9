"""Port ``Typed``: a handler with a pydantic body."""

from pydantic import BaseModel

from mdbcontainer import MessageContext, message_driven

from .common import effects


class Order(BaseModel):
    order_id: int
    amount: str


@message_driven("Typed", transaction="container")
def typed(order: Order, ctx: MessageContext) -> None:
    ctx.session.execute(effects.insert().values(port="Typed", message_id=ctx.message.id,
                                                n=order.order_id))
