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

from sqlalchemy import exc as sa_exc

from ..errors import TransactionError
from ..state.dedup import Dedup, DuplicateMessage
from ..state.outbox import Outbox, Pending
from ..support.crash import crash_point
from ..support.outgoing import Outgoing

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, SessionTransaction

    from ..state.store import Store

Kind = Literal["handled", "duplicate", "failed", "infrastructure"]
_SQLITE_ERROR = 1  # the primary result code of a statement SQLite cannot run
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"
_PQTRANS_INERROR = 3  # libpq's transaction status after an error inside it (psycopg, psycopg2)


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


def ensure_open(session: Session, begun: SessionTransaction) -> None:
    """Raise :class:`TransactionAborted` when ``begun`` can no longer commit.

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


def claims_first(store: Store | None) -> bool:
    """Claim dedup rows before the handlers run: a concurrent duplicate then waits before any work.

    On SQLite the first write takes the database's only write lock until the
    commit, so a claim made first would hold it through every handler (and
    the container's heartbeats, hand-back records and ``mdb port stop`` would
    wait on it): there the claim goes last, just before the commit.
    """
    return store is not None and store.dialect != "sqlite"


@dataclass
class Outcome:
    """What became of a delivery's unit of work."""

    kind: Kind
    error: BaseException | None = None
    pending: list[Pending] = field(default_factory=list)
    direct: list[Outgoing] = field(default_factory=list)


def is_infrastructure(exc: BaseException) -> bool:
    """A lost or refused database connection: retried, never counted against the message.

    Except a session the server ended because the handler left its transaction
    idle past ``database_timeout`` (SQLSTATE 25P03): the connection is gone, but
    the handler caused it, as a statement timeout; waited out as an outage, that
    message would be retried forever, never counted.
    """
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if sqlstate == IDLE_IN_TRANSACTION_TIMEOUT:
        return False
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if _sqlite_statement_error(exc):
        return False
    if isinstance(sqlstate, str) and sqlstate:
        return _transient_sqlstate(sqlstate)
    return isinstance(
        exc,
        sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.DisconnectionError
        | sa_exc.TimeoutError,
    )


# What PostgreSQL says, before any SQLSTATE reaches the client, when the login itself is wrong
# (libpq reports a failed startup as text only): 3D000, 28000, 28P01.
_REFUSED_AT_LOGIN = ("does not exist", "password authentication failed", "no pg_hba.conf entry",
                     "is not permitted to log in", "no password supplied")


def database_refused(exc: BaseException) -> bool:
    """The database refused the settings themselves: a missing database or role, a wrong password.

    An outage while running (a role locked for a moment is waited out like any
    refused connection), but at start a configuration error: waiting cannot
    create a database, so ``mdb check`` and ``mdb run`` exit 2 on it.
    """
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate == "3D000" or sqlstate.startswith("28")
    if not isinstance(exc, sa_exc.OperationalError):
        return False
    text = str(getattr(exc, "orig", exc))
    said_by_server = "FATAL" in text or "fe_sendauth" in text  # not a statement's own error
    return said_by_server and any(marker in text for marker in _REFUSED_AT_LOGIN)


def _transient_sqlstate(sqlstate: str) -> bool:
    """PostgreSQL errors that are the server's state, not the message's: waited out, not counted.

    Connection exceptions (08), a login refused (28) or a database missing (3D),
    insufficient resources (53), serialization failures and deadlocks (40,
    which pass on retry) and the server shutting down (57P01-57P03). A
    statement or lock timeout (57014, 55P03) is not among them: a message
    whose query always times out is a failed delivery, counted and in the end
    backed out, instead of being retried forever uncounted.
    """
    return sqlstate[:2] in {"08", "28", "3D", "53", "40"} or sqlstate in {"57P01", "57P02", "57P03"}


def _sqlite_statement_error(exc: BaseException) -> bool:
    """SQLite's SQLITE_ERROR: the statement itself is wrong (a missing table, a syntax error).

    SQLite raises it as OperationalError, the class of a locked or unreadable
    database; waited out as an outage, a handler's bad SQL would loop forever,
    never counted and never backed out.
    """
    code = getattr(getattr(exc, "orig", None), "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == _SQLITE_ERROR


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

    @property
    def _claim_first(self) -> bool:
        """Claim the dedup row first, except on SQLite (see :func:`claims_first`)."""
        return self.once_only and claims_first(self.resources.store)

    @property
    def _claim_last(self) -> bool:
        return self.once_only and not self._claim_first

    def _already_applied(self) -> bool:
        """Claim-last stores: a duplicate whose row committed earlier never reaches the handler.

        A short read outside the transaction; only two copies in flight at once
        can both run the handler there (the second's work is rolled back).
        """
        dedup = self.resources.dedup
        return self._claim_last and dedup is not None and dedup.seen(self.port, self.message_id)

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
            crash_point("in-handler")
            if self.rollback_only:
                raise RollbackOnly
        except Exception as exc:
            return failure(exc)
        return Outcome("handled", direct=list(self._sends))


class ContainerManaged(UnitOfWork):
    """CMT: dedup claim, handler, outbox and commit in one transaction the container owns."""

    def run(self, call: Callable[..., None], *args: Any) -> Outcome:
        store, outbox = self.resources.store, self.resources.outbox
        assert store is not None and outbox is not None
        if self._already_applied():
            return Outcome("duplicate")
        session = self.session = store.session()
        try:
            with session.begin() as begun:
                if self._claim_first and not self._claim(session):
                    session.rollback()
                    return Outcome("duplicate")
                call(*args)
                crash_point("in-handler")
                if self.rollback_only:
                    raise RollbackOnly
                ensure_open(session, begun)
                if self._claim_last and not self._claim(session):
                    session.rollback()
                    return Outcome("duplicate")
                pending = outbox.write(session, self.port, self._sends)
            crash_point("after-commit")
            return Outcome("handled", pending=pending)
        except Exception as exc:
            return failure(exc)
        finally:
            session.close()
            self.session = None

    def _claim(self, session: Session) -> bool:
        assert self.resources.dedup is not None
        return self.resources.dedup.claim(session, self.port, self.message_id)


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
        store, outbox = self.resources.store, self.resources.outbox
        assert store is not None and outbox is not None
        if self._opened:
            raise TransactionError(f"port {self.port!r}: ctx.transaction() is once per delivery")
        self._opened = True
        session = self.session = store.session()
        try:
            if self._already_applied():
                raise DuplicateMessage(self.message_id)
            with session.begin() as begun:
                if self._claim_first and not self._claim(session):
                    raise DuplicateMessage(self.message_id)
                yield session
                if self.rollback_only:
                    raise RollbackOnly
                ensure_open(session, begun)
                if self._claim_last and not self._claim(session):
                    raise DuplicateMessage(self.message_id)
                self._pending = outbox.write(session, self.port, self._sends)
            self._committed = True
            crash_point("after-commit")
        except BaseException as exc:
            self._ended = exc
            raise
        finally:
            session.close()
            self.session = None

    def bean_transaction(self) -> Any:
        return self._transaction()

    def _claim(self, session: Session) -> bool:
        assert self.resources.dedup is not None
        return self.resources.dedup.claim(session, self.port, self.message_id)

    def run(self, call: Callable[..., None], *args: Any) -> Outcome:
        try:
            call(*args)
            crash_point("in-handler")
            if self.rollback_only and not self._opened:
                raise RollbackOnly
            if self._opened and not self._committed:  # the handler caught what ended it
                raise self._ended or TransactionAborted("ctx.transaction() did not commit")
        except DuplicateMessage:
            return Outcome("duplicate")
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
