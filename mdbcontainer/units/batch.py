"""Units of work for a batch of deliveries (README: Batches).

A batched port runs up to ``batch_size`` deliveries in one unit of work, so
that exactly-once costs one database commit per batch instead of one per
message:

- **Container-managed**: one transaction; the dedup rows of the whole batch
  are claimed in one statement (``dedup.claim_many``) before any handler
  runs; messages already claimed, and a second copy of one id in the batch,
  are duplicates that reach no handler; then the handlers (a per-message
  handler once per message in delivery order, sharing the session; a batch
  handler once), the outbox rows, and one commit. On SQLite the claim goes
  last (``transactions.claims_first``): the ids already claimed are read
  before the transaction, and a claim refused at the end (a copy committed
  meanwhile) rolls the batch back as a ``conflict``.
- **Bean-managed** (batch handlers only): ``ctx.transaction()`` is one
  transaction for the batch with every dedup mark inside it. A message found
  already claimed there rolls the batch back (``conflict``): the pipeline then
  runs each message alone, where the duplicate is told apart.
- **None**: a per-message handler runs for each message in turn and a failing
  one fails alone, while a database outage of its own is held (``hold``) as on
  the per-message path; a batch handler runs once.

A transaction that did not commit (the database ended it under a handler
that caught the error, ``units.sequence.ensure_open``) is a failed batch, never
a handled one.

The order of the steps is the one of every unit of work (``units/sequence.py``);
a batch's runner claims all its ids with one statement.

A unit never acknowledges; the pipeline (``pipeline/batch.py``) settles the batch
after the outcome is durable, exactly as for one delivery.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from ..errors import TransactionError
from ..handlers.registry import Invoker
from ..message import Message
from ..state.database import is_infrastructure
from ..state.dedup import DuplicateMessage
from ..state.outbox import Pending
from ..support.outgoing import Outgoing
from .context import BatchContext, MessageContext
from .runner import Runner
from .sequence import Plan, claims_first, commit_sequence, handler_returned
from .single import ClientAcknowledgment, Outcome, TransactionResources, UnitOfWork

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

BatchKind = Literal["handled", "failed", "infrastructure", "conflict"]
# Runs one message's unit of work through a database outage; None when the port stopped meanwhile.
Hold = Callable[[Callable[[], Outcome]], Outcome | None]


def _at_once(call: Callable[[], Outcome]) -> Outcome | None:
    return call()


@dataclass
class BatchItem:
    """One delivery of a batch that passed steps 1-6: its envelope and its handler argument."""

    message: Message
    argument: Any
    move_copy: Callable[[str, str], Outgoing]


@dataclass
class BatchOutcome:
    """What became of a batch's unit of work.

    ``handled`` and ``duplicates`` are indexes into the batch. ``failed`` holds
    the messages that failed alone (transaction none, per-message handlers);
    ``held_back`` the ones that did not run because the port stopped while a
    database outage was held (they go back uncounted).
    ``direct`` are sends published after the handlers returned, each with
    the index of the message that made it (-1: the batch handler's).
    """

    kind: BatchKind
    error: BaseException | None = None
    handled: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    failed: dict[int, Outcome] = field(default_factory=dict)
    held_back: list[int] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)
    direct: list[tuple[int, Outgoing]] = field(default_factory=list)


def _no_move(queue: str, reason: str) -> Outgoing:
    raise TransactionError("move_to is for one message: a batch handler has no ctx.move_to()")


class _Member(UnitOfWork):
    """A unit inside a container-managed batch: the batch's session, its own sends and flag."""

    def __init__(self, port: str, message_id: str, resources: TransactionResources,
                 session: Session, move_copy: Callable[[str, str], Outgoing]) -> None:
        super().__init__(port, message_id, resources, once_only=False, move_copy=move_copy)
        self.session = session


class _BeanBatch(UnitOfWork):
    """BMT for a batch handler: ``ctx.transaction()`` covers the batch, dedup marks included."""

    def __init__(self, port: str, message_ids: list[str], resources: TransactionResources, *,
                 once_only: bool, client_ack: ClientAcknowledgment | None = None) -> None:
        super().__init__(port, "", resources, once_only=once_only, move_copy=_no_move,
                         client_ack=client_ack)
        self.message_ids = message_ids
        self.opened = False
        self.committed = False
        self.ended: BaseException | None = None  # what ended the opened transaction uncommitted
        self.pending: list[Pending] = []
        self.after_tx: list[Outgoing] = []

    def send(self, message: Outgoing) -> None:
        # Inside ctx.transaction() a send joins the transaction; outside it, it
        # leaves after the handler returns.
        (self._sends if self.session is not None else self.after_tx).append(message)

    def _plan(self, *, bean: bool = True) -> Plan:
        """Every dedup mark of the batch inside the handler's one transaction."""
        return Plan(self.once_only, claims_first(self.resources.store), bean=bean, batch=True)

    def opening(self) -> None:
        """``ctx.transaction()`` is once per batch."""
        if self.opened:
            raise TransactionError(f"port {self.port!r}: ctx.transaction() is once per batch")
        self.opened = True

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        store = self.resources.store
        assert store is not None
        self.opening()
        session = self.session = store.session()
        try:
            with Runner(self.port, self.resources, session, many=True).transaction(
                    commit_sequence(self._plan(), self.message_ids)) as turn:
                yield session
                turn.returned(self.rollback_only, self._sends)
            self.committed, self.pending = True, turn.pending
        except BaseException as exc:
            self.ended = exc
            raise
        finally:
            session.close()
            self.session = None

    def bean_transaction(self) -> Any:
        return self._transaction()

    def returned(self) -> None:
        """The batch handler returned (see :func:`handler_returned`)."""
        handler_returned(self.rollback_only, self.opened, self.committed, self.ended)


class BatchRunner:
    """Runs one batch in the unit of work of the port's ``transaction`` setting."""

    def __init__(self, port: str, resources: TransactionResources, invoker: Invoker, *,
                 transaction: str, attribute: str, once_only: bool) -> None:
        self.port = port
        self.resources = resources
        self.invoker = invoker
        self.batch_handler = invoker.spec.batch
        self.once_only = once_only
        if transaction == "bean":
            self.kind = "bean"
        elif transaction == "container" and attribute != "NotSupported":
            self.kind = "container"
        else:
            self.kind = "none"
        # A container-managed batch: the messages applied already are left out, not refused.
        self.plan = Plan(once_only, claims_first(resources.store), partial=True, batch=True)

    def run(self, items: list[BatchItem], *, hold: Hold = _at_once,
            client_ack: ClientAcknowledgment | None = None) -> BatchOutcome:
        """Run the batch; ``hold`` waits out a database outage of one message (transaction none).

        ``client_ack``: the ``ctx.acknowledge()`` hooks of a batch of one on a
        port with ``acknowledge`` client (``batch_size = 1``).
        """
        if self.kind == "container":
            return self._container(items)
        if self.kind == "bean":
            return self._bean(items, client_ack)
        return self._none(items, hold, client_ack)

    def _distinct(self, items: list[BatchItem]) -> tuple[list[int], list[int]]:
        """First copies, and second copies of an id within the batch (once-only: duplicates)."""
        if not self.once_only:
            return list(range(len(items))), []
        seen: set[str] = set()
        first: list[int] = []
        again: list[int] = []
        for index, item in enumerate(items):
            (again if item.message.id in seen else first).append(index)
            seen.add(item.message.id)
        return first, again

    def _call_batch(self, items: list[BatchItem], indexes: list[int], unit: UnitOfWork) -> None:
        ctx = BatchContext([items[i].message for i in indexes], self.port, unit)
        self.invoker([items[i].argument for i in indexes], ctx)

    # -- container-managed -------------------------------------------------

    def _container(self, items: list[BatchItem]) -> BatchOutcome:
        store = self.resources.store
        assert store is not None
        first, _ = self._distinct(items)
        session = store.session()
        try:
            with Runner(self.port, self.resources, session, many=True).transaction(
                    commit_sequence(self.plan, [items[i].message.id for i in first])) as turn:
                fresh = _fresh(items, first, turn.fresh)
                members = self._call_members(items, fresh, session)
                turn.returned(*_left(members))
        except DuplicateMessage as exc:  # claimed meanwhile by a copy in flight elsewhere
            return BatchOutcome("conflict", exc)
        except Exception as exc:
            return _failure(exc)
        finally:
            session.close()
        duplicates = sorted(set(range(len(items))) - set(fresh))
        return BatchOutcome("handled", handled=fresh, duplicates=duplicates, pending=turn.pending)

    def _call_members(self, items: list[BatchItem], fresh: list[int], session: Session) -> list[_Member]:
        """The handlers of a container-managed batch, sharing its session; their units' flags and sends."""
        members: list[_Member] = []
        if self.batch_handler:
            members.append(_Member(self.port, "", self.resources, session, _no_move))
            if fresh:
                self._call_batch(items, fresh, members[0])
            return members
        for i in fresh:
            item = items[i]
            member = _Member(self.port, item.message.id, self.resources, session, item.move_copy)
            members.append(member)
            self.invoker(item.argument, MessageContext(item.message, self.port, member))
        return members

    # -- bean-managed (batch handlers) ---------------------------------------

    def _bean(self, items: list[BatchItem], client_ack: ClientAcknowledgment | None) -> BatchOutcome:
        first, again = self._distinct(items)
        unit = _BeanBatch(self.port, [items[i].message.id for i in first], self.resources,
                          once_only=self.once_only, client_ack=client_ack)
        try:
            self._call_batch(items, first, unit)
            unit.returned()
        except DuplicateMessage as exc:
            return BatchOutcome("conflict", exc)
        except Exception as exc:
            return _failure(exc)
        return BatchOutcome("handled", handled=first, duplicates=again, pending=unit.pending,
                            direct=[(-1, send) for send in unit.after_tx])

    # -- no transaction ------------------------------------------------------

    def _none(self, items: list[BatchItem], hold: Hold,
              client_ack: ClientAcknowledgment | None) -> BatchOutcome:
        if self.batch_handler:
            unit = UnitOfWork(self.port, "", self.resources, once_only=False, move_copy=_no_move,
                              client_ack=client_ack)
            everyone = list(range(len(items)))
            outcome = unit.run(lambda: self._call_batch(items, everyone, unit))
            if outcome.kind != "handled":
                return _failure(outcome.error or RuntimeError("the batch handler failed"))
            return BatchOutcome("handled", handled=everyone,
                                direct=[(-1, send) for send in outcome.direct])
        result = BatchOutcome("handled")
        for index, item in enumerate(items):
            if result.held_back:  # the port stopped during an outage: the rest go back unrun
                result.held_back.append(index)
                continue
            alone = hold(partial(self._one, item))
            if alone is None:
                result.held_back.append(index)
            elif alone.kind == "handled":
                result.handled.append(index)
                result.direct.extend((index, send) for send in alone.direct)
            else:
                result.failed[index] = alone
        return result

    def _one(self, item: BatchItem) -> Outcome:
        unit = UnitOfWork(self.port, item.message.id, self.resources, once_only=False,
                          move_copy=item.move_copy)
        ctx = MessageContext(item.message, self.port, unit)
        return unit.run(lambda: self.invoker(item.argument, ctx))


def _fresh(items: list[BatchItem], first: list[int], ids: list[str]) -> list[int]:
    """The indexes of the first copies whose ids the sequence left to handle."""
    fresh = set(ids)
    return [i for i in first if items[i].message.id in fresh]


def _left(members: list[_Member]) -> tuple[bool, list[Outgoing]]:
    """What a container-managed batch's handlers left: any rollback-only, and their sends."""
    return any(m.rollback_only for m in members), [s for m in members for s in m.sends]


def _failure(exc: BaseException) -> BatchOutcome:
    if is_infrastructure(exc):
        return BatchOutcome("infrastructure", exc)
    return BatchOutcome("failed", exc)
