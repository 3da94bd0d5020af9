"""The orders table, shared by the web application (app.py) and the port (order_listener.py)."""

from __future__ import annotations

from pydantic import BaseModel
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sample_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    amount: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default="placed")


class OrderPlaced(BaseModel):
    """The event the web application sends through the outbox when it stores an order."""

    order_id: int
    amount: str
