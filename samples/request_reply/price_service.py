"""A price service: it answers each request on the request's ``reply_to``.

``ctx.reply`` sends to ``message.reply_to`` with the request's correlation id
(else its message id), so the requester can match the answer to its question.
"""

from __future__ import annotations

from decimal import Decimal

from pydantic import BaseModel

from mdbcontainer import MessageContext, message_driven

PRICES = {"A-1": Decimal("9.99"), "B-2": Decimal("24.50")}


class Quote(BaseModel):
    sku: str


@message_driven("PriceService")
def quote(request: Quote, ctx: MessageContext) -> None:
    price = PRICES.get(request.sku)
    if price is None:
        ctx.reply({"sku": request.sku, "error": "unknown sku"})
        return
    ctx.reply({"sku": request.sku, "price": str(price)})
