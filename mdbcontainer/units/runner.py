"""The runners of the commit sequence (``units/sequence.py``): its steps' I/O, and nothing else.

:class:`Runner` does them on a ``Session`` (``def`` handlers),
:class:`AsyncRunner` on an ``AsyncSession`` (``async def`` handlers), running
the same synchronous statements (``Dedup.claim``, ``Outbox.write``,
``ensure_open``) on its connection through ``run_sync``. ``many``: a batch's
runner claims with one statement for all its ids (``Dedup.claim_many``).

Each opens the transaction at ``BEGIN``, hands the unit its turn at
``HANDLE`` (the block of :meth:`Runner.transaction`: the unit calls its
handler there, or yields to a bean-managed handler's ``with`` block, and
reports what the handler left with :meth:`Turn.returned`), and commits at
``COMMIT`` by leaving the transaction's block; anything raised rolls back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..support.crash import crash_point
from .sequence import (
    BEGIN,
    CHECK,
    CLAIM,
    COMMIT,
    CRASH,
    HANDLE,
    READ,
    WRITE,
    Committed,
    Sequence,
    Step,
    check_open,
    ensure_open,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session, SessionTransaction

    from ..state.dedup import Dedup
    from ..state.outbox import Outbox, Pending
    from ..support.outgoing import Outgoing


class Tables(Protocol):
    """The container's tables a runner writes (met by ``units.single.TransactionResources``)."""

    @property
    def dedup(self) -> Dedup | None: ...

    @property
    def outbox(self) -> Outbox | None: ...


@dataclass(slots=True)
class Turn:
    """The unit's turn inside the transaction: the ids to handle, then what the handler left."""

    fresh: list[str]
    rollback_only: bool = False
    sends: list[Outgoing] = field(default_factory=list)
    pending: list[Pending] = field(default_factory=list)  # once committed: the outbox rows

    def returned(self, rollback_only: bool, sends: list[Outgoing]) -> None:
        """The handler(s) returned: with this rollback-only flag, these sends for the outbox."""
        self.rollback_only, self.sends = rollback_only, sends


class Runner:
    """Drives a commit sequence on one ``Session``."""

    def __init__(self, port: str, resources: Tables, session: Session, *,
                 many: bool = False) -> None:
        self.port = port
        self.resources = resources
        self.session = session
        self.many = many
        self._begun: SessionTransaction | None = None

    @contextmanager
    def transaction(self, steps: Sequence) -> Iterator[Turn]:
        """Up to the handler; the block is the unit's turn; then to the commit and after it."""
        self._until(steps, BEGIN)
        with self.session.begin() as begun:
            self._begun = begun
            turn = Turn(_ids(self._until(steps, HANDLE)))
            yield turn
            self._until(steps, COMMIT, (turn.rollback_only, turn.sends))
        committed = self._until(steps, None)
        assert isinstance(committed, Committed)
        turn.pending = committed.pending

    def _until(self, steps: Sequence, stop: str | None, reply: Any = None) -> Any:
        """Do the steps until one whose op is ``stop``: that step (or, at the end, the result)."""
        try:
            step = steps.send(reply)
            while step.op is not stop:
                step = steps.send(self._do(step))
        except StopIteration as done:
            return done.value
        return step

    def _do(self, step: Step) -> Any:
        op, dedup = step.op, self.resources.dedup
        if op is CRASH:
            crash_point(step.point)
        elif op is CHECK:
            assert self._begun is not None
            ensure_open(self.session, self._begun)
        elif op is WRITE:
            assert self.resources.outbox is not None and step.sends is not None
            return self.resources.outbox.write(self.session, self.port, step.sends)
        elif op is CLAIM:
            assert dedup is not None and step.ids is not None
            if self.many:
                return dedup.claim_many(self.session, self.port, step.ids)
            return set(step.ids) if dedup.claim(self.session, self.port, step.ids[0]) else set()
        elif op is READ:
            return _read(self, step)
        else:
            raise AssertionError(f"a step no runner knows: {op}")
        return None


class AsyncRunner:
    """Drives a commit sequence on one ``AsyncSession``: the same steps, awaited."""

    def __init__(self, port: str, resources: Tables, session: AsyncSession, *,
                 many: bool = False) -> None:
        self.port = port
        self.resources = resources
        self.session = session
        self.many = many

    @asynccontextmanager
    async def transaction(self, steps: Sequence) -> AsyncIterator[Turn]:
        """Up to the handler; the block is the unit's turn; then to the commit and after it."""
        await self._until(steps, BEGIN)
        async with self.session.begin():
            turn = Turn(_ids(await self._until(steps, HANDLE)))
            yield turn
            await self._until(steps, COMMIT, (turn.rollback_only, turn.sends))
        committed = await self._until(steps, None)
        assert isinstance(committed, Committed)
        turn.pending = committed.pending

    async def _until(self, steps: Sequence, stop: str | None, reply: Any = None) -> Any:
        try:
            step = steps.send(reply)
            while step.op is not stop:
                step = steps.send(await self._do(step))
        except StopIteration as done:
            return done.value
        return step

    async def _do(self, step: Step) -> Any:
        op, dedup, session = step.op, self.resources.dedup, self.session
        if op is CRASH:
            crash_point(step.point)
        elif op is CHECK:
            await session.run_sync(check_open)
        elif op is WRITE:
            assert self.resources.outbox is not None and step.sends is not None
            return await session.run_sync(self.resources.outbox.write, self.port, step.sends)
        elif op is CLAIM:
            assert dedup is not None and step.ids is not None
            if self.many:
                return await session.run_sync(dedup.claim_many, self.port, step.ids)
            claimed = await session.run_sync(dedup.claim, self.port, step.ids[0])
            return set(step.ids) if claimed else set()
        elif op is READ:
            return _read(self, step)
        else:
            raise AssertionError(f"a step no runner knows: {op}")
        return None


def _read(runner: Runner | AsyncRunner, step: Step) -> set[str]:
    """The ids of ``step`` applied already: a short read on the store's own connection."""
    dedup = runner.resources.dedup
    assert dedup is not None and step.ids is not None
    if runner.many:
        return dedup.seen_many(runner.port, step.ids)
    return set(step.ids) if dedup.seen(runner.port, step.ids[0]) else set()


def _ids(step: Any) -> list[str]:
    assert isinstance(step, Step) and step.ids is not None
    return step.ids
