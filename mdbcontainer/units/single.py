"""Units of work: container-managed (CMT), bean-managed (BMT) and none.

A unit of work runs the handler and returns an :class:`Outcome`; it never
acknowledges. The delivery pipeline acknowledges only after the outcome is
durable, so nothing is acknowledged before its work commits.

- **Container-managed** (``transaction = "container"``, Required/RequiresNew):
  one session per delivery; the dedup row is claimed first, then the handler
  runs, then the outbox rows are written and everything commits together. A
  failure at flush or commit (a deferred constraint) is a failed delivery
  like any other, not something hidden after the handler returned; so is a
  transaction the database ended under the handler (:func:`ensure_open`).
- **Bean-managed** (``transaction = "bean"``): the handler opens
  ``ctx.transaction()`` itself; the dedup mark is written inside it. A
  transaction opened and not committed fails the delivery, even when the
  handler caught what ended it.
- **None**: the handler runs; sends are published after it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..errors import TransactionError
from ..state.database import is_infrastructure
from ..state.dedup import Dedup, DuplicateMessage
from ..state.outbox import Outbox, Pending
from ..support.outgoing import Outgoing
from .runner import Runner
from .sequence import Plan, claims_first, commit_sequence, handler_returned

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from ..state.store import Store

Kind = Literal["handled", "duplicate_skipped", "failed", "infrastructure"]  # as counted (state.metrics)


@dataclass
class Outcome:
    """What became of a delivery's unit of work."""

    kind: Kind
    error: BaseException | None = None
    pending: list[Pending] = field(default_factory=list)
    direct: list[Outgoing] = field(default_factory=list)


class ClientAcknowledgment(Protocol):
    """``ctx.acknowledge()`` and ``ctx.recover()`` of a delivery (``acknowledge = "client"``)."""

    def acknowledge(self) -> None: ...

    def recover(self) -> None: ...


@dataclass
class TransactionResources:
    """What units of work need from the container, shared by a port's consumers."""

    store: Store | None
    dedup: Dedup | None
    outbox: Outbox | None


class UnitOfWork:
    """One delivery's unit of work; the base runs without a transaction."""

    def __init__(
        self,
        port: str,
        message_id: str,
        resources: TransactionResources,
        *,
        once_only: bool,
        move_copy: Callable[[str, str], Outgoing],
        client_ack: ClientAcknowledgment | None = None,
    ) -> None:
        self.port = port
        self.message_id = message_id
        self.resources = resources
        self.once_only = once_only
        self.rollback_only = False
        self.session: Session | None = None
        self._sends: list[Outgoing] = []
        self._move_copy = move_copy
        self._client_ack = client_ack

    def _plan(self, *, bean: bool = False) -> Plan:
        """The steps of this unit's commit sequence (``units/sequence.py``)."""
        return Plan(self.once_only, claims_first(self.resources.store), bean=bean)

    @property
    def sends(self) -> list[Outgoing]:
        """The sends made so far, in order: published after the handler (no transaction), or
        written as outbox rows at the commit."""
        return self._sends

    def send(self, message: Outgoing) -> None:
        self._sends.append(message)

    def move_to(self, queue: str, reason: str) -> None:
        self._sends.append(self._move_copy(queue, reason))

    def bean_transaction(self) -> Any:
        raise TransactionError(
            f"port {self.port!r}: ctx.transaction() needs transaction = 'bean'"
        )

    def acknowledge(self) -> None:
        if self._client_ack is None:
            raise TransactionError(f"port {self.port!r}: ctx.acknowledge() needs acknowledge = 'client'")
        self._client_ack.acknowledge()

    def recover(self) -> None:
        if self._client_ack is None:
            raise TransactionError(f"port {self.port!r}: ctx.recover() needs acknowledge = 'client'")
        self._client_ack.recover()

    def run(self, call: Callable[..., None], *args: Any) -> Outcome:
        """Run the handler, ``call(*args)``; sends leave after it returns (no transaction to join)."""
        try:
            call(*args)
            handler_returned(self.rollback_only)
        except Exception as exc:
            return failure(exc)
        return Outcome("handled", direct=list(self._sends))


class ContainerManaged(UnitOfWork):
    """CMT: dedup claim, handler, outbox and commit in one transaction the container owns."""

    def run(self, call: Callable[..., None], *args: Any) -> Outcome:
        store = self.resources.store
        assert store is not None
        session = self.session = store.session()
        try:
            with Runner(self.port, self.resources, session).transaction(
                    commit_sequence(self._plan(), [self.message_id])) as turn:
                call(*args)
                turn.returned(self.rollback_only, self._sends)
            return Outcome("handled", pending=turn.pending)
        except DuplicateMessage:
            return Outcome("duplicate_skipped")
        except Exception as exc:
            return failure(exc)
        finally:
            session.close()
            self.session = None


class BeanManaged(UnitOfWork):
    """BMT: the handler demarcates ``with ctx.transaction() as session``; once per delivery."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened = False
        self._committed = False
        self._ended: BaseException | None = None  # what ended an opened transaction uncommitted
        self._pending: list[Pending] = []
        self._after_tx: list[Outgoing] = []

    def send(self, message: Outgoing) -> None:
        # Inside ctx.transaction() a send joins the transaction; outside it, it
        # leaves after the handler returns.
        (self._sends if self.session is not None else self._after_tx).append(message)

    def move_to(self, queue: str, reason: str) -> None:
        self.send(self._move_copy(queue, reason))

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        store = self.resources.store
        assert store is not None
        if self._opened:
            raise TransactionError(f"port {self.port!r}: ctx.transaction() is once per delivery")
        self._opened = True
        session = self.session = store.session()
        try:
            with Runner(self.port, self.resources, session).transaction(
                    commit_sequence(self._plan(bean=True), [self.message_id])) as turn:
                yield session
                turn.returned(self.rollback_only, self._sends)
            self._committed, self._pending = True, turn.pending
        except BaseException as exc:
            self._ended = exc
            raise
        finally:
            session.close()
            self.session = None

    def bean_transaction(self) -> Any:
        return self._transaction()

    def run(self, call: Callable[..., None], *args: Any) -> Outcome:
        try:
            call(*args)
            handler_returned(self.rollback_only, self._opened, self._committed, self._ended)
        except DuplicateMessage:
            return Outcome("duplicate_skipped")
        except Exception as exc:
            return failure(exc)
        return Outcome("handled", pending=self._pending, direct=self._after_tx)


def failure(exc: BaseException) -> Outcome:
    """The outcome of a unit of work whose handler (or commit) raised ``exc``."""
    if is_infrastructure(exc):
        return Outcome("infrastructure", exc)
    return Outcome("failed", exc)


_failure = failure  # the batch units' name for it


def unit_class(transaction: str, attribute: str) -> type[UnitOfWork]:
    """The unit of work for a port's ``transaction`` and ``transaction_attribute``."""
    if transaction == "bean":
        return BeanManaged
    if transaction == "container" and attribute != "NotSupported":
        return ContainerManaged
    return UnitOfWork
