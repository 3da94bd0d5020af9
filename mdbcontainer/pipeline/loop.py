"""What a consumer's event loop needs besides its tasks: SQLite's write gate, the blocking watchdog.

See docs/architecture.md, "Async handlers".
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from ..handlers.registry import HandlerSpec
from ..support.logs import fields

log = logging.getLogger("mdbcontainer.pipeline")

BLOCKED = 1.0  # a loop that has not come round for this long is blocked: a WARNING names the handler
TICK = 0.1


class _Open:
    """The gate on PostgreSQL: no wait, and no generator made per delivery."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


_OPEN = _Open()


class WriteGate:
    """SQLite has one writer: no synchronous write on the loop's thread while a task's
    transaction is open (it could hold the write lock across an await, and the blocked loop
    would never let it commit).

    Transactions are the many readers of this gate, the loop's synchronous writes (step 8,
    a redelivery's count, a hand-back) the writers, given precedence so they never starve.
    On PostgreSQL (row locks) the gate is open.
    """

    def __init__(self, closed: bool) -> None:
        self.closed = closed
        self._open = 0
        self._writers = 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def transaction(self) -> AbstractAsyncContextManager[None]:
        return self._transaction() if self.closed else _OPEN

    def writing(self, needed: bool = True) -> AbstractAsyncContextManager[None]:
        return self._writing() if self.closed and needed else _OPEN

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[None]:
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self._writers == 0)
            self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0:
                async with cond:
                    cond.notify_all()

    @asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        cond = self._condition()
        self._writers += 1
        try:
            async with cond:
                await cond.wait_for(lambda: self._open == 0)
            yield
        finally:
            self._writers -= 1
            if self._writers == 0:
                async with cond:
                    cond.notify_all()


class Watchdog:
    """Warns when the port's handler blocks its event loop (a synchronous call in an async def).

    A ticker task marks the loop's progress; a thread looks every tenth of a
    second, and when the loop is more than :data:`BLOCKED` late it reads the
    loop thread's stack: with the handler on it, one WARNING per block names it.
    """

    def __init__(self, port: str, spec: HandlerSpec) -> None:
        self.port = port
        self.name = spec.name if not spec.is_bean else f"{spec.name}.on_message"
        self.code = spec.code
        self.ticked = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop_thread = 0

    async def ticking(self) -> None:
        while True:
            self.ticked = time.monotonic()
            await asyncio.sleep(TICK)

    def start(self, loop_thread: int) -> None:
        self._loop_thread = loop_thread
        self._stop.clear()
        self.ticked = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name=f"mdb-{self.port}-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(1.0)

    def _watch(self) -> None:
        warned = False
        while not self._stop.wait(TICK):
            late = time.monotonic() - self.ticked
            if late <= BLOCKED:
                warned = False
            elif not warned and self._handler_running():
                warned = True
                log.warning("port %s: handler %s blocked the event loop for %.1fs (a synchronous "
                            "call inside an async def?): every other delivery of the port waits",
                            self.port, self.name, late,
                            extra=fields(port=self.port, outcome="blocked", duration=round(late, 3)))

    def _handler_running(self) -> bool:
        frame = sys._current_frames().get(self._loop_thread)
        while frame is not None:
            if frame.f_code is self.code:
                return True
            frame = frame.f_back
        return False
