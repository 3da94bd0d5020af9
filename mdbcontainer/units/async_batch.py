"""Batch units of work for ``async def`` handlers: the steps of ``units/batch.py``, awaited.

A batched port with an async handler keeps the batch pipeline as it is (it
gathers, settles and falls back on the consumer's thread, one batch at a
time); only the unit of work of a batch, or of one message run alone, runs
on the consumer's own event loop, with an ``AsyncSession`` whose transaction
holds the batch's dedup rows, its handlers' work and its outbox rows: the
commit sequence of every unit (``units/sequence.py``), through the async
runner (``units/runner.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ..state.dedup import DuplicateMessage
from .async_single import AsyncResources, AsyncUnitOfWork
from .batch import (
    BatchItem,
    BatchOutcome,
    BatchRunner,
    Hold,
    _at_once,
    _BeanBatch,
    _failure,
    _fresh,
    _left,
    _Member,
    _no_move,
)
from .context import BatchContext, MessageContext
from .runner import AsyncRunner
from .sequence import commit_sequence
from .single import ClientAcknowledgment, Outcome

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession


class _AsyncBeanBatch(_BeanBatch):
    """BMT for an async batch handler: ``async with ctx.transaction()`` covers the batch."""

    sessions: Any = None

    def bean_transaction(self) -> Any:
        return self._atransaction()

    @asynccontextmanager
    async def _atransaction(self) -> AsyncIterator[AsyncSession]:
        self.opening()
        session = self.sessions()
        self.session = session
        try:
            async with AsyncRunner(self.port, self.resources, session, many=True).transaction(
                    commit_sequence(self._plan(), self.message_ids)) as turn:
                yield session
                turn.returned(self.rollback_only, self._sends)
            self.committed, self.pending = True, turn.pending
        except BaseException as exc:
            self.ended = exc
            raise
        finally:
            await session.close()
            self.session = None


class AsyncBatchRunner(BatchRunner):
    """Runs one batch of an async handler on ``loop`` (the consumer's), as ``BatchRunner`` does."""

    def __init__(self, *args: Any, loop: asyncio.AbstractEventLoop, units: AsyncResources,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop = loop
        self.units = units

    def run(self, items: list[BatchItem], *, hold: Hold = _at_once,
            client_ack: ClientAcknowledgment | None = None) -> BatchOutcome:
        if self.kind == "container":
            return self.loop.run_until_complete(self._container_async(items))
        if self.kind == "bean":
            return self.loop.run_until_complete(self._bean_async(items))
        return self._none(items, hold, client_ack)

    def one(self, unit: AsyncUnitOfWork, argument: Any, ctx: MessageContext) -> Outcome:
        """One message alone in its async unit of work (a per-message handler's fallback)."""
        return self.loop.run_until_complete(unit.arun(lambda: self.invoker.acall(argument, ctx)))

    async def _call_batch_async(self, items: list[BatchItem], indexes: list[int], unit: Any) -> None:
        ctx = BatchContext([items[i].message for i in indexes], self.port, unit)
        await self.invoker.acall([items[i].argument for i in indexes], ctx)

    def _call_batch(self, items: list[BatchItem], indexes: list[int], unit: Any) -> None:
        self.loop.run_until_complete(self._call_batch_async(items, indexes, unit))

    def _one(self, item: BatchItem) -> Outcome:
        unit = AsyncUnitOfWork(self.port, item.message.id, self.units, once_only=False,
                               move_copy=item.move_copy)
        return self.one(unit, item.argument, MessageContext(item.message, self.port, unit))

    async def _container_async(self, items: list[BatchItem]) -> BatchOutcome:
        assert self.units.sessions is not None
        first, _ = self._distinct(items)
        session = self.units.sessions()
        try:
            async with AsyncRunner(self.port, self.resources, session, many=True).transaction(
                    commit_sequence(self.plan, [items[i].message.id for i in first])) as turn:
                fresh = _fresh(items, first, turn.fresh)
                members = await self._call_members_async(items, fresh, session)
                turn.returned(*_left(members))
        except DuplicateMessage as exc:  # claimed meanwhile by a copy in flight elsewhere
            return BatchOutcome("conflict", exc)
        except Exception as exc:
            return _failure(exc)
        finally:
            await session.close()
        duplicates = sorted(set(range(len(items))) - set(fresh))
        return BatchOutcome("handled", handled=fresh, duplicates=duplicates, pending=turn.pending)

    async def _call_members_async(self, items: list[BatchItem], fresh: list[int],
                                  session: AsyncSession) -> list[_Member]:
        """The handlers of the batch one after another on its one session (it serves one at a time)."""
        members: list[_Member] = []
        shared: Any = session
        if self.batch_handler:
            members.append(_Member(self.port, "", self.resources, shared, _no_move))
            if fresh:
                await self._call_batch_async(items, fresh, members[0])
            return members
        for i in fresh:
            item = items[i]
            member = _Member(self.port, item.message.id, self.resources, shared, item.move_copy)
            members.append(member)
            await self.invoker.acall(item.argument, MessageContext(item.message, self.port, member))
        return members

    async def _bean_async(self, items: list[BatchItem]) -> BatchOutcome:
        first, again = self._distinct(items)
        unit = _AsyncBeanBatch(self.port, [items[i].message.id for i in first], self.resources,
                               once_only=self.once_only)
        unit.sessions = self.units.sessions
        try:
            await self._call_batch_async(items, first, unit)
            unit.returned()
        except DuplicateMessage as exc:
            return BatchOutcome("conflict", exc)
        except Exception as exc:
            return _failure(exc)
        return BatchOutcome("handled", handled=first, duplicates=again, pending=unit.pending,
                            direct=[(-1, send) for send in unit.after_tx])
