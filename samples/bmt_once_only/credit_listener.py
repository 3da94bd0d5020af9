"""A bean-managed MDB: it credits accounts, and each message exactly once.

The bean opens its own transaction with ``ctx.transaction()``; the container
writes the dedup row ``(port, message id)`` inside it. The crash window the
README describes under "Once and only once" (the database committed, the broker never heard the
acknowledgment, so the message comes again) is closed by that row: a
redelivered or duplicated message whose row exists is acknowledged without
calling the bean.

A transfer with ``"crash_after_commit": true`` kills the process right after
its transaction commits, once, to show that window.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from pydantic import BaseModel
from sqlalchemy import Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdbcontainer import MessageContext, message_driven

log = logging.getLogger("credit_listener")
CRASHED_ONCE = Path(".mdb/crashed-once")


class Base(DeclarativeBase):
    """The sample's tables: settings.toml names it as container.metadata, so the container
    creates them at start (a real service migrates them with Alembic)."""


class Credit(Base):
    __tablename__ = "sample_credits"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account: Mapped[str] = mapped_column(String(40))
    amount: Mapped[int] = mapped_column(Integer)
    message_id: Mapped[str] = mapped_column(String(255))


class Transfer(BaseModel):
    account: str
    amount: int
    crash_after_commit: bool = False


@message_driven("CreditPort", transaction="bean")
class CreditBean:
    """One instance per consumer thread (a pooled bean)."""

    def setup(self) -> None:
        self.credited = 0

    def on_message(self, transfer: Transfer, ctx: MessageContext) -> None:
        with ctx.transaction() as session:
            session.add(Credit(account=transfer.account, amount=transfer.amount,
                               message_id=ctx.message.id))
        self.credited += 1
        log.warning("credited %s with %d (message %s)", transfer.account, transfer.amount,
                    ctx.message.id)
        if transfer.crash_after_commit and not CRASHED_ONCE.exists():
            CRASHED_ONCE.write_text("the power went out after the commit")
            log.warning("power cut: the transaction committed, the acknowledgment never leaves")
            os.kill(os.getpid(), signal.SIGKILL)

