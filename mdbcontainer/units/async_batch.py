"""Batch units of work for ``async def`` handlers: ``batches.py``'s steps, awaited.

A batched port with an async handler keeps the batch pipeline as it is (it
gathers, settles and falls back on the consumer's thread, one batch at a
time); only the unit of work of a batch, or of one message run alone, runs
on the consumer's own event loop, with an ``AsyncSession`` whose transaction
holds the batch's dedup rows, its handlers' work and its outbox rows. The
claims, the outbox rows and the "did it commit" check are the synchronous
helpers, run through ``AsyncSession.run_sync``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ..errors import TransactionError
from ..state.dedup import DuplicateMessage
from ..support.crash import crash_point
from .async_single import AsyncResources, AsyncUnitOfWork, _check_open
from .batch import (
    BatchItem,
    BatchOutcome,
    BatchRunner,
    Hold,
    _at_once,
    _BeanBatch,
    _failure,
    _Member,
    _no_duplicates,
    _no_move,
)
from .context import BatchContext, MessageContext
from .single import ClientAcknowledgment, Outcome, RollbackOnly, TransactionAborted, claims_first

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession


class _AsyncBeanBatch(_BeanBatch):
    """BMT for an async batch handler: ``async with ctx.transaction()`` covers the batch."""

    sessions: Any = None

    def bean_transaction(self) -> Any:
        return self._atransaction()

    @asynccontextmanager
    async def _atransaction(self) -> AsyncIterator[AsyncSession]:
        store, outbox, dedup = self.resources.store, self.resources.outbox, self.resources.dedup
        assert store is not None and outbox is not None and dedup is not None
        if self.opened:
            raise TransactionError(f"port {self.port!r}: ctx.transaction() is once per batch")
        self.opened = True
        first = self.once_only and claims_first(store)
        session = self.sessions()
        self.session = session
        try:
            if self.once_only and not first:  # SQLite: a short read, the claim goes last
                _no_duplicates(dedup.seen_many(self.port, self.message_ids), set())
            async with session.begin():
                if first:
                    claimed = await session.run_sync(dedup.claim_many, self.port, self.message_ids)
                    _no_duplicates(self.message_ids, claimed)
                yield session
                if self.rollback_only:
                    raise RollbackOnly
                await session.run_sync(_check_open)
                if self.once_only and not first:
                    claimed = await session.run_sync(dedup.claim_many, self.port, self.message_ids)
                    _no_duplicates(self.message_ids, claimed)
                self.pending = await session.run_sync(outbox.write, self.port, self._sends)
                crash_point("before-commit")
            self.committed = True
            crash_point("after-commit")
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
        store, outbox, dedup = self.resources.store, self.resources.outbox, self.resources.dedup
        assert store is not None and outbox is not None and dedup is not None
        assert self.units.sessions is not None
        first, _ = self._distinct(items)
        ids = {i: items[i].message.id for i in first}
        claim_first = self.once_only and claims_first(store)
        fresh = first
        if self.once_only and not claim_first:  # SQLite: a short read, the claim goes last
            seen = dedup.seen_many(self.port, list(ids.values()))
            fresh = [i for i in first if ids[i] not in seen]
        session = self.units.sessions()
        try:
            async with session.begin():
                if claim_first:
                    claimed = await session.run_sync(dedup.claim_many, self.port, list(ids.values()))
                    fresh = [i for i in first if ids[i] in claimed]
                members = await self._call_members_async(items, fresh, session)
                crash_point("in-handler")
                if any(member.rollback_only for member in members):
                    raise RollbackOnly
                await session.run_sync(_check_open)
                if self.once_only and not claim_first and fresh:
                    wanted = [ids[i] for i in fresh]
                    _no_duplicates(wanted, await session.run_sync(dedup.claim_many, self.port, wanted))
                sends = [s for m in members for s in m.sends]
                pending = await session.run_sync(outbox.write, self.port, sends)
                crash_point("before-commit")
            crash_point("after-commit")
        except DuplicateMessage as exc:  # claimed meanwhile by a copy in flight elsewhere
            return BatchOutcome("conflict", exc)
        except Exception as exc:
            return _failure(exc)
        finally:
            await session.close()
        duplicates = sorted(set(range(len(items))) - set(fresh))
        return BatchOutcome("handled", handled=fresh, duplicates=duplicates, pending=pending)

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
            crash_point("in-handler")
            if unit.rollback_only and not unit.opened:
                raise RollbackOnly
            if unit.opened and not unit.committed:  # the handler caught what ended it
                raise unit.ended or TransactionAborted("ctx.transaction() did not commit")
        except DuplicateMessage as exc:
            return BatchOutcome("conflict", exc)
        except Exception as exc:
            return _failure(exc)
        return BatchOutcome("handled", handled=first, duplicates=again, pending=unit.pending,
                            direct=[(-1, send) for send in unit.after_tx])
