"""MessageContext: what a handler can do besides reading its message.

The context delegates to the delivery's unit of work (``units/single.py``),
so the same ``ctx.send`` is an outbox row under a transaction and a publish
after the handler returns without one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import NoReplyTo, TransactionError
from ..message import Message
from ..support.outgoing import outgoing

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from .single import UnitOfWork


class _UnitContext:
    """What both contexts offer: the unit of work's session, rollback and sends."""

    __slots__ = ("_unit", "port")
    _no_session = ""  # why there is no session, said by each context in its own words

    def __init__(self, port: str, unit: UnitOfWork) -> None:
        self.port = port
        self._unit = unit

    @property
    def session(self) -> Session:
        """The SQLAlchemy session of the container-managed transaction."""
        session = self._unit.session
        if session is None:
            raise TransactionError(f"port {self.port!r}: ctx.session exists only with {self._no_session}")
        return session

    def set_rollback_only(self) -> None:
        """Mark the transaction for rollback: the delivery fails (a batch is run again one by one)."""
        self._unit.rollback_only = True

    @property
    def rollback_only(self) -> bool:
        return self._unit.rollback_only

    def acknowledge(self) -> None:
        """Client acknowledgment: acknowledge this and every earlier message of this consumer.

        On a batch handler, ``acknowledge = "client"`` needs ``batch_size = 1``.
        """
        self._unit.acknowledge()

    def recover(self) -> None:
        """Client acknowledgment: redeliver every unacknowledged message of this consumer."""
        self._unit.recover()

    def transaction(self) -> AbstractContextManager[Session]:
        """Bean-managed: a transaction that commits on normal exit, with the dedup marks inside it."""
        manager: AbstractContextManager[Session] = self._unit.bean_transaction()
        return manager

    def send(
        self,
        destination: str,
        body: Any,
        *,
        priority: int | None = None,
        ttl: timedelta | str | float | None = None,
        persistent: bool = True,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        content_type: str | None = None,
    ) -> str:
        """Send a message as part of this unit of work; return its id.

        Inside a transaction it leaves only if the transaction commits. The
        keywords are those of :meth:`mdbcontainer.Producer.send`.
        """
        message = outgoing(
            destination, body, priority=priority, ttl=ttl, persistent=persistent,
            headers=headers, message_id=message_id, reply_to=reply_to,
            correlation_id=correlation_id, content_type=content_type,
        )
        self._unit.send(message)
        return message.message_id



class MessageContext(_UnitContext):
    """The handler's view of its delivery: session, rollback, sends, acknowledgment."""

    __slots__ = ("message",)
    _no_session = "transaction = 'container' (Required or RequiresNew); with 'bean' use ctx.transaction()"

    def __init__(self, message: Message, port: str, unit: UnitOfWork) -> None:
        self.port = port  # as _UnitContext.__init__, without the call: one context per delivery
        self._unit = unit
        self.message = message

    def reply(
        self,
        body: Any,
        *,
        priority: int | None = None,
        ttl: timedelta | str | float | None = None,
        persistent: bool = True,
        headers: dict[str, Any] | None = None,
        message_id: str | None = None,
        correlation_id: str | None = None,
        content_type: str | None = None,
    ) -> str:
        """Answer a request: to ``reply_to``, correlated with the request's correlation id or id.

        Part of the unit of work, as :meth:`send`; ``correlation_id`` overrides
        the request's.
        """
        if not self.message.reply_to:
            raise NoReplyTo(f"port {self.port!r}: message {self.message.id} has no reply_to")
        message = outgoing(
            self.message.reply_to, body, priority=priority, ttl=ttl, persistent=persistent,
            headers=headers, message_id=message_id, content_type=content_type,
            correlation_id=correlation_id or self.message.correlation_id or self.message.id,
        )
        self._unit.send(replace(message, reply=True))
        return message.message_id

    def move_to(self, queue: str, reason: str) -> None:
        """Move this message to ``queue`` as part of the unit of work; the delivery then counts as handled."""
        self._unit.move_to(queue, reason)


class BatchContext(_UnitContext):
    """A batch handler's view of its batch: session, rollback, sends (``batch=True``).

    One context for the whole list: ``messages`` are the envelopes in the
    order of the list, ``session`` is the batch's one transaction (container-
    managed), ``transaction()`` opens it (bean-managed, covering every dedup
    mark of the batch), and ``set_rollback_only()`` rolls the whole batch back,
    after which each message is run again alone (a list of one).
    """

    __slots__ = ("messages",)
    _no_session = ("transaction = 'container' (Required or RequiresNew), or inside "
                   "ctx.transaction() with 'bean'")

    def __init__(self, messages: list[Message], port: str, unit: UnitOfWork) -> None:
        super().__init__(port, unit)
        self.messages = messages
