"""Units of work for ``async def`` handlers: the same steps as ``transactions.py``, awaited.

Each class is the async twin of a synchronous unit and keeps its order of
steps (claim, handler, "did it commit" check, outbox rows, commit), running
the very same synchronous helpers (``Dedup.claim``, ``Outbox.write``,
:func:`transactions.ensure_open`) on the ``AsyncSession``'s connection
through ``AsyncSession.run_sync``. So the guarantee is written once; only
the waiting differs.

A task cancelled at shutdown (``asyncio.CancelledError``) rolls its
transaction back on its way out and is not an outcome: the pipeline hands the
message back uncounted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TransactionError
from ..state.dedup import DuplicateMessage
from ..state.outbox import Pending
from ..support.crash import crash_point
from ..support.outgoing import Outgoing
from .single import (
    Outcome,
    RollbackOnly,
    TransactionAborted,
    TransactionResources,
    UnitOfWork,
    _failure,
    ensure_open,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
    from sqlalchemy.orm import Session

Handler = Callable[[], Awaitable[None]]


@dataclass
class AsyncResources(TransactionResources):
    """The synchronous resources, and the ``AsyncSession`` factory of one event loop."""

    sessions: async_sessionmaker[AsyncSession] | None = None


class AsyncUnitOfWork(UnitOfWork):
    """No transaction: the handler is awaited; sends leave after it returns."""

    resources: AsyncResources

    async def arun(self, call: Handler) -> Outcome:
        try:
            await call()
            crash_point("in-handler")
            if self.rollback_only:
                raise RollbackOnly
        except Exception as exc:
            return _failure(exc)
        return Outcome("handled", direct=list(self._sends))

    def _session(self) -> AsyncSession:
        sessions = self.resources.sessions
        assert sessions is not None
        return sessions()

    def _claim(self, session: Session) -> bool:
        assert self.resources.dedup is not None
        return self.resources.dedup.claim(session, self.port, self.message_id)


def _check_open(session: Session) -> None:
    """:func:`ensure_open` on the session's current transaction (run inside ``run_sync``)."""
    begun = session.get_transaction()
    if begun is None:
        raise TransactionAborted("the session's transaction was ended inside the handler")
    ensure_open(session, begun)


class AsyncContainerManaged(AsyncUnitOfWork):
    """CMT: dedup claim, awaited handler, outbox and commit in one transaction the container owns."""

    async def arun(self, call: Handler) -> Outcome:
        outbox = self.resources.outbox
        assert outbox is not None
        if self._already_applied():
            return Outcome("duplicate")
        session = self._session()
        self.session = session  # type: ignore[assignment]  # ctx.session: an AsyncSession here
        try:
            async with session.begin():
                if self._claim_first and not await session.run_sync(self._claim):
                    raise DuplicateMessage(self.message_id)  # rolls back: no work, no row
                await call()
                crash_point("in-handler")
                if self.rollback_only:
                    raise RollbackOnly
                await session.run_sync(_check_open)
                if self._claim_last and not await session.run_sync(self._claim):
                    raise DuplicateMessage(self.message_id)
                pending = await session.run_sync(outbox.write, self.port, self._sends)
            crash_point("after-commit")
            return Outcome("handled", pending=pending)
        except DuplicateMessage:
            return Outcome("duplicate")
        except Exception as exc:
            return _failure(exc)
        finally:
            await session.close()
            self.session = None


class AsyncBeanManaged(AsyncUnitOfWork):
    """BMT: ``async with ctx.transaction() as session``, once per delivery, dedup mark inside."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened = False
        self._committed = False
        self._ended: BaseException | None = None
        self._pending: list[Pending] = []
        self._after_tx: list[Outgoing] = []

    def send(self, message: Outgoing) -> None:
        (self._sends if self.session is not None else self._after_tx).append(message)

    def move_to(self, queue: str, reason: str) -> None:
        self.send(self._move_copy(queue, reason))

    def bean_transaction(self) -> Any:
        return self._transaction()

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncSession]:
        outbox = self.resources.outbox
        assert outbox is not None
        if self._opened:
            raise TransactionError(f"port {self.port!r}: ctx.transaction() is once per delivery")
        self._opened = True
        session = self._session()
        self.session = session  # type: ignore[assignment]
        try:
            if self._already_applied():
                raise DuplicateMessage(self.message_id)
            async with session.begin():
                if self._claim_first and not await session.run_sync(self._claim):
                    raise DuplicateMessage(self.message_id)
                yield session
                if self.rollback_only:
                    raise RollbackOnly
                await session.run_sync(_check_open)
                if self._claim_last and not await session.run_sync(self._claim):
                    raise DuplicateMessage(self.message_id)
                self._pending = await session.run_sync(outbox.write, self.port, self._sends)
            self._committed = True
            crash_point("after-commit")
        except BaseException as exc:
            self._ended = exc
            raise
        finally:
            await session.close()
            self.session = None

    async def arun(self, call: Handler) -> Outcome:
        try:
            await call()
            crash_point("in-handler")
            if self.rollback_only and not self._opened:
                raise RollbackOnly
            if self._opened and not self._committed:  # the handler caught what ended it
                raise self._ended or TransactionAborted("ctx.transaction() did not commit")
        except DuplicateMessage:
            return Outcome("duplicate")
        except Exception as exc:
            return _failure(exc)
        return Outcome("handled", pending=self._pending, direct=self._after_tx)


def async_resources(units: TransactionResources, tasks: int, transactional: bool) -> AsyncResources:
    """The synchronous resources with an ``AsyncSession`` factory for one event loop of ``tasks``
    tasks (none without a transaction: no engine is made)."""
    from sqlalchemy.ext.asyncio import async_sessionmaker

    sessions = None
    if transactional and units.store is not None:
        sessions = async_sessionmaker(units.store.async_engine(tasks), expire_on_commit=False)
    return AsyncResources(units.store, units.dedup, units.outbox, sessions)


async def dispose(resources: AsyncResources | None) -> None:
    """Close the async engine's connections (on the loop that opened them)."""
    sessions = resources.sessions if resources is not None else None
    if sessions is not None:
        await sessions.kw["bind"].dispose()


def async_unit_class(transaction: str, attribute: str) -> type[AsyncUnitOfWork]:
    """The async unit of work for a port's ``transaction`` and ``transaction_attribute``."""
    if transaction == "bean":
        return AsyncBeanManaged
    if transaction == "container" and attribute != "NotSupported":
        return AsyncContainerManaged
    return AsyncUnitOfWork
