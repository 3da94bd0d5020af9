"""An ``async def`` handler: it awaits a (simulated) pricing service, then stores the quote.

The port runs 50 of these at once on one event loop, so 200 quote requests
that each wait 100 ms take well under a second instead of 20 s. With
``transaction = "container"`` the ``ctx.session`` is a SQLAlchemy
``AsyncSession`` (aiosqlite here, psycopg's async mode on PostgreSQL): the
quote row and the dedup row of the message commit together, once.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import Integer, String, insert
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdbcontainer import MessageContext, message_driven


class Base(DeclarativeBase):
    pass


class Quote(Base):
    __tablename__ = "sample_quotes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sku: Mapped[str] = mapped_column(String(40))
    price: Mapped[str] = mapped_column(String(20))
    message_id: Mapped[str] = mapped_column(String(255))


class QuoteRequested(BaseModel):
    sku: str
    quantity: int


async def price_of(sku: str) -> Decimal:
    """A pricing service that answers in 100 ms (an HTTP call with httpx, in a real service)."""
    await asyncio.sleep(0.1)
    return Decimal("9.99") + len(sku)


@message_driven("QuotesPort")
async def on_quote(request: QuoteRequested, ctx: MessageContext) -> None:
    price = await price_of(request.sku) * request.quantity
    await ctx.session.execute(insert(Quote).values(sku=request.sku, price=str(price),
                                                   message_id=ctx.message.id))
