"""The container's clock: the time every wait of the container reads, which a test may move on.

A redelivery delay, a message's expiry, a batch's linger, the outbox relay's
grace and the dedup retention are all measured against this clock, so
``mdbcontainer.testing.TestContainer.advance("30s")`` lets them pass without
sleeping. In production nothing moves it, and its functions are the standard
library's own: ``clock.time`` *is* ``time.time`` until a test calls
:func:`advance`, so a reader on the hot path pays one attribute lookup and no
extra call. Callers must therefore read ``clock.time()`` through the module,
never ``from .clock import time`` (that would keep the unmoved function).
"""

from __future__ import annotations

import threading
import time as _time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

_lock = threading.Lock()
_offset = 0.0  # seconds the clock runs ahead of the system's

time: Callable[[], float] = _time.time
"""Wall-clock seconds since the epoch, as ``time.time()``."""

monotonic: Callable[[], float] = _time.monotonic
"""Monotonic seconds, as ``time.monotonic()``."""


def _system_now() -> datetime:
    return datetime.now(UTC)


now: Callable[[], datetime] = _system_now
"""The aware UTC datetime now, as ``datetime.now(UTC)``."""


def offset() -> float:
    """How many seconds the clock runs ahead of the system's (0 unless a test advanced it)."""
    return _offset


def advance(seconds: float) -> None:
    """Move the clock ``seconds`` forward for every reader in this process (tests only)."""
    if seconds < 0:
        raise ValueError(f"the clock only moves forward, not by {seconds}s")
    with _lock:
        _set(_offset + seconds)


def reset() -> None:
    """Back to the system's clock (a test kit that advanced it calls this when it ends)."""
    with _lock:
        _set(0.0)


def _set(value: float) -> None:
    global _offset, time, monotonic, now
    _offset = value
    if not value:
        time, monotonic, now = _time.time, _time.monotonic, _system_now
        return
    shift = timedelta(seconds=value)
    time = lambda: _time.time() + value  # noqa: E731 - rebound as a whole, read through the module
    monotonic = lambda: _time.monotonic() + value  # noqa: E731
    now = lambda: datetime.now(UTC) + shift  # noqa: E731
