"""The commit sequence of a unit of work, written once, as steps that do no I/O.

Every transactional unit of work (container- or bean-managed, one message or
a batch, a ``def`` or an ``async def`` handler) commits in this order:

1. claim last (SQLite): a short read, outside the transaction, of the ids applied already
2. begin
3. claim first (PostgreSQL): claim the dedup rows, so a concurrent copy waits before any work
4. the handler (bean-managed: the body of ``with ctx.transaction()``)
5. crash point ``in-handler`` (container-managed: inside the transaction)
6. rollback-only: the transaction rolls back (:class:`RollbackOnly`)
7. :func:`ensure_open`: a transaction the database ended under the handler cannot commit
8. claim last: claim the dedup rows now
9. write the outbox rows of the sends
10. crash point ``before-commit`` (batches)
11. commit, then crash point ``after-commit``

:func:`commit_sequence` decides this and nothing else: it yields each
:class:`Step` and is sent back the step's answer (the ids claimed, the outbox
rows written). The runners (``units/runner.py``, one for a ``Session`` and one
for an ``AsyncSession``) do the I/O; the units (``single``, ``batch`` and
their async twins) only say which ids and call the handler at ``HANDLE``. So
a new check before the commit is a line here, and every kind of unit has it
(h11 and httpx share their protocol between sync and async code this way).

An id found already applied stops the sequence with :class:`DuplicateMessage`
(the transaction rolls back: no work, no row), except in a container-managed
batch (``partial``), where the other messages go on without it; a claim
refused at step 8 stops even a batch (a copy committed meanwhile: a conflict).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..state.dedup import DuplicateMessage
from ..support.crash import crash_point

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, SessionTransaction

    from ..state.outbox import Pending
    from ..state.store import Store
    from ..support.outgoing import Outgoing

_PQTRANS_INERROR = 3  # libpq's transaction status after an error inside it (psycopg, psycopg2)

# What a step asks of its runner (compared by identity: one string each).
READ = "read"  # which of ``ids`` are applied already (outside the transaction): a set of ids
BEGIN = "begin"  # open the transaction
CLAIM = "claim"  # claim the dedup rows of ``ids`` in the transaction: the set of ids claimed
HANDLE = "handle"  # run the handler(s) of ``ids``; answer (rollback_only, sends)
CRASH = "crash"  # the crash point ``point``
CHECK = "check"  # ensure_open: raise when the transaction can no longer commit
WRITE = "write"  # write the outbox rows of ``sends``: the rows written (Pending)
COMMIT = "commit"  # commit the transaction


class RollbackOnly(Exception):
    """The handler marked the transaction rollback-only."""

    def __str__(self) -> str:
        return "the handler called ctx.set_rollback_only()"


class TransactionAborted(Exception):
    """The transaction ended before its commit: its COMMIT would roll everything back, silently.

    PostgreSQL aborts a transaction at the first error inside it; a handler
    that catches that error and goes on (the "insert if missing" idiom) leaves
    a transaction whose COMMIT answers ROLLBACK without raising. Acknowledged,
    its message would be lost with its rows and dedup mark: it is a failed
    delivery instead, counted like any other.
    """


@dataclass(frozen=True, slots=True)
class Step:
    """One thing for a runner to do: ``op`` (one of the names above) and what it works on."""

    op: str
    ids: list[str] | None = None
    sends: list[Outgoing] | None = None
    point: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """What a port's units of work share: which steps their sequence has.

    ``partial``: a container-managed batch, whose messages applied already are
    left out (duplicates) instead of stopping it. ``bean``: the handler's own
    ``ctx.transaction()`` (its ``in-handler`` crash point comes after it).
    ``batch``: the ``before-commit`` crash point is a batch's.
    """

    once_only: bool
    claim_first: bool
    partial: bool = False
    bean: bool = False
    batch: bool = False


@dataclass(slots=True)
class Committed:
    """What a sequence that reached its end committed: the ids handled, the outbox rows."""

    fresh: list[str]
    pending: list[Pending]


_BEGIN = Step(BEGIN)
_IN_HANDLER = Step(CRASH, point="in-handler")
_CHECK = Step(CHECK)
_BEFORE_COMMIT = Step(CRASH, point="before-commit")
_COMMIT = Step(COMMIT)
_AFTER_COMMIT = Step(CRASH, point="after-commit")

Sequence = Generator[Step, Any, Committed]


def commit_sequence(plan: Plan, ids: list[str]) -> Sequence:
    """The steps of one unit of work over the deliveries ``ids`` (one, or a batch's first copies)."""
    fresh = ids
    claim_last = plan.once_only and not plan.claim_first
    if claim_last:
        applied: set[str] = yield Step(READ, ids)
        fresh = _without(plan, fresh, applied)
    yield _BEGIN
    if plan.once_only and plan.claim_first:
        claimed: set[str] = yield Step(CLAIM, fresh)
        fresh = _within(plan, fresh, claimed)
    rollback_only, sends = yield Step(HANDLE, fresh)
    if not plan.bean:
        yield _IN_HANDLER
    if rollback_only:
        raise RollbackOnly
    yield _CHECK
    if claim_last and fresh:
        _refuse_missing(fresh, (yield Step(CLAIM, fresh)))
    pending: list[Pending] = yield Step(WRITE, sends=sends)
    if plan.batch:
        yield _BEFORE_COMMIT
    yield _COMMIT
    yield _AFTER_COMMIT
    return Committed(fresh, pending)


def _without(plan: Plan, ids: list[str], applied: set[str]) -> list[str]:
    """The ids not applied yet; any applied stops a unit that is not ``partial``."""
    if not applied:
        return ids
    if not plan.partial:
        _refuse_missing(applied, set())
    return [i for i in ids if i not in applied]


def _within(plan: Plan, ids: list[str], claimed: set[str]) -> list[str]:
    """The ids claimed; any refused stops a unit that is not ``partial``."""
    if plan.partial:
        return [i for i in ids if i in claimed]
    _refuse_missing(ids, claimed)
    return ids


def _refuse_missing(wanted: Any, claimed: set[str]) -> None:
    """Raise DuplicateMessage when an id of ``wanted`` is not among the ``claimed`` ones."""
    missing = sorted(set(wanted) - claimed)
    if missing:
        raise DuplicateMessage(missing[0])


def handler_returned(rollback_only: bool, opened: bool = False, committed: bool = False,
                     ended: BaseException | None = None) -> None:
    """The checks once a handler returned outside a container-managed transaction.

    Without a transaction, and with a bean-managed one the handler never
    opened, rollback-only fails the delivery; a ``ctx.transaction()`` opened
    and not committed fails it too, even when the handler caught what ended it.
    """
    crash_point("in-handler")
    if opened:
        if not committed:
            raise ended or TransactionAborted("ctx.transaction() did not commit")
    elif rollback_only:
        raise RollbackOnly


def claims_first(store: Store | None) -> bool:
    """Claim dedup rows before the handlers run: a concurrent duplicate then waits before any work.

    On SQLite the first write takes the database's only write lock until the
    commit, so a claim made first would hold it through every handler (and
    the container's heartbeats, hand-back records and ``mdb port stop`` would
    wait on it): there the claim goes last, just before the commit.
    """
    return store is not None and store.dialect != "sqlite"


def ensure_open(session: Session, begun: SessionTransaction) -> None:
    """Raise :class:`TransactionAborted` when ``begun`` can no longer commit (step 7).

    Local checks, no round trip: SQLAlchemy's own state (a flush that failed
    inside the handler, a ``session.rollback()``), then the driver's: libpq's
    transaction status on PostgreSQL, and on SQLite whether the database is
    still inside the transaction (an ``ON CONFLICT ROLLBACK``, a full disk or
    a trigger's ``RAISE(ROLLBACK)`` end it, and later statements would then
    commit one by one).
    """
    if session.get_transaction() is not begun or not begun.is_active:
        raise TransactionAborted(
            "the session's transaction was ended inside the handler (a failed flush caught, "
            "session.rollback() or session.commit()): the container's unit of work cannot commit"
        )
    if _ended_by_database(session.connection()):
        raise TransactionAborted(
            "the database aborted the transaction after an error inside it that the handler "
            "caught: nothing of it can commit (wrap a statement that may fail in "
            "session.begin_nested(), a savepoint, to go on after its error)"
        )


def _ended_by_database(connection: Connection) -> bool:
    # The driver's own connection: sqlite3's or psycopg's, or aiosqlite's and psycopg's async ones
    # under an AsyncSession (each has the same ``info`` or ``in_transaction``).
    raw = connection.connection.driver_connection
    dialect = connection.dialect.name
    if dialect == "postgresql":
        info = getattr(raw, "info", None)
        return getattr(info, "transaction_status", None) == _PQTRANS_INERROR
    if dialect == "sqlite":  # the container's SQLite engine always opens an explicit BEGIN
        return getattr(raw, "in_transaction", True) is False
    return False


def check_open(session: Session) -> None:
    """:func:`ensure_open` on the session's current transaction (an ``AsyncSession``'s, in ``run_sync``)."""
    begun = session.get_transaction()
    if begun is None:
        raise TransactionAborted("the session's transaction was ended inside the handler")
    ensure_open(session, begun)
