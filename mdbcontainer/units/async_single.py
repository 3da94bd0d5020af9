"""Units of work for ``async def`` handlers: the same steps as ``units/single.py``, awaited.

Each class is the async twin of a synchronous unit and runs the same commit
sequence (``units/sequence.py``) through the async runner (``units/runner.py``),
which runs the very same synchronous helpers (``Dedup.claim``, ``Outbox.write``,
``ensure_open``) on the ``AsyncSession``'s connection through
``AsyncSession.run_sync``. So the guarantee is written once; only the waiting
differs.

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
from ..support.outgoing import Outgoing
from .runner import AsyncRunner
from .sequence import commit_sequence, handler_returned
from .single import Outcome, TransactionResources, UnitOfWork, _failure

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

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
            handler_returned(self.rollback_only)
        except Exception as exc:
            return _failure(exc)
        return Outcome("handled", direct=list(self._sends))

    def _session(self) -> AsyncSession:
        sessions = self.resources.sessions
        assert sessions is not None
        return sessions()


class AsyncContainerManaged(AsyncUnitOfWork):
    """CMT: dedup claim, awaited handler, outbox and commit in one transaction the container owns."""

    async def arun(self, call: Handler) -> Outcome:
        session = self._session()
        self.session = session  # type: ignore[assignment]  # ctx.session: an AsyncSession here
        try:
            async with AsyncRunner(self.port, self.resources, session).transaction(
                    commit_sequence(self._plan(), [self.message_id])) as turn:
                await call()
                turn.returned(self.rollback_only, self._sends)
            return Outcome("handled", pending=turn.pending)
        except DuplicateMessage:
            return Outcome("duplicate_skipped")
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
        if self._opened:
            raise TransactionError(f"port {self.port!r}: ctx.transaction() is once per delivery")
        self._opened = True
        session = self._session()
        self.session = session  # type: ignore[assignment]
        try:
            async with AsyncRunner(self.port, self.resources, session).transaction(
                    commit_sequence(self._plan(bean=True), [self.message_id])) as turn:
                yield session
                turn.returned(self.rollback_only, self._sends)
            self._committed, self._pending = True, turn.pending
        except BaseException as exc:
            self._ended = exc
            raise
        finally:
            await session.close()
            self.session = None

    async def arun(self, call: Handler) -> Outcome:
        try:
            await call()
            handler_returned(self.rollback_only, self._opened, self._committed, self._ended)
        except DuplicateMessage:
            return Outcome("duplicate_skipped")
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
