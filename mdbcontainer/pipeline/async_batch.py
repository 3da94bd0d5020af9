"""The batch pipeline of a port whose batch (or per-message) handler is ``async def``.

The batch path as it is (``pipeline/batch.py``: it gathers, settles and falls
back on the consumer's thread, one batch at a time); only its units of work,
a batch's or one message's run alone, are awaited on the consumer's own event
loop (``units/async_batch.py``). See docs/architecture.md, "Async handlers".
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from ..message import Message
from ..units.async_batch import AsyncBatchRunner
from ..units.async_single import AsyncUnitOfWork, async_resources, async_unit_class, dispose
from ..units.context import MessageContext
from ..units.single import Outcome
from .attempt import Attempt
from .batch import BatchPipeline
from .single import ConsumerView, PortView


class AsyncBatchPipeline(BatchPipeline):
    """A batched port with an async handler: the batch path as it is, its units of work awaited
    on the consumer's own event loop (one batch at a time; see docs/architecture.md)."""

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        super().__init__(port, consumer)
        self.loop = asyncio.new_event_loop()
        self.async_unit = async_unit_class(self.settings.transaction, self.settings.transaction_attribute)
        self.units = async_resources(self.resources.units, 1, self.async_unit is not AsyncUnitOfWork)
        self.runner = AsyncBatchRunner(port.name, self.resources.units, self.invoker,
                                       transaction=self.settings.transaction,
                                       attribute=self.settings.transaction_attribute,
                                       once_only=self.once_only, loop=self.loop, units=self.units)
        self.overlap = False  # its units of work run on the consumer's event loop

    def _run(self, attempt: Attempt, message: Message) -> Outcome:
        if self.invoker.spec.batch:  # a list of one, through the runner
            return super()._run(attempt, message)
        unit = self.async_unit(self.port.name, message.id, self.units, once_only=self.once_only,
                               move_copy=self._mover(attempt.delivery))
        return self.async_runner.one(unit, attempt.argument, MessageContext(message, self.port.name, unit))

    @property
    def async_runner(self) -> AsyncBatchRunner:
        assert isinstance(self.runner, AsyncBatchRunner)
        return self.runner

    def close(self) -> None:
        self.loop.run_until_complete(self.invoker.adiscard())
        with suppress(Exception):
            self.loop.run_until_complete(dispose(self.units))
        self.loop.close()
