"""Per-key lanes of an ordered port: which waiting delivery may start next (no I/O, no clock).

A key has at most one delivery in flight; its others wait in arrival order.
A key is *ready* when it has a waiting delivery, none in flight and is not
held; ready keys start in the order they became ready, so no key waits behind
another key's backlog. See docs/guides/ordered-ports.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Unkeyed:
    """The key of a message without one: a key of its own, equal to nothing else (no order)."""

    __slots__ = ()


class Lanes(Generic[T]):
    """Waiting items by key, one key in flight at a time, held keys kept aside."""

    def __init__(self) -> None:
        self._queued: dict[Hashable, deque[T]] = {}
        self._busy: set[Hashable] = set()
        self._held: set[Hashable] = set()
        self._ready: deque[Hashable] = deque()
        self.waiting = 0

    def add(self, key: Hashable, item: T) -> None:
        """``item`` arrived for ``key``: after the key's others."""
        lane = self._queued.get(key)
        if lane is None:
            lane = self._queued[key] = deque()
        lane.append(item)
        self.waiting += 1
        if len(lane) == 1 and key not in self._busy and key not in self._held:
            self._ready.append(key)

    def front(self, key: Hashable, item: T) -> None:
        """``item`` goes first for ``key`` (a failed delivery run again, a replayed message)."""
        lane = self._queued.get(key)
        if lane is None:
            lane = self._queued[key] = deque()
        lane.appendleft(item)
        self.waiting += 1
        if len(lane) == 1 and key not in self._busy and key not in self._held:
            self._ready.append(key)

    def take(self) -> tuple[Hashable, T] | None:
        """The next item that may start (its key turns busy), or None."""
        while self._ready:
            key = self._ready.popleft()
            lane = self._queued.get(key)
            if not lane or key in self._busy or key in self._held:
                continue  # released and held again, or emptied by a hand-back: look further
            item = lane.popleft()
            if not lane:
                del self._queued[key]
            self.waiting -= 1
            self._busy.add(key)
            return key, item
        return None

    def done(self, key: Hashable) -> None:
        """The key's delivery in flight ended: its next one may start (unless the key is held)."""
        self._busy.discard(key)
        if key in self._queued and key not in self._held:
            self._ready.append(key)

    def hold(self, key: Hashable) -> None:
        """Keep ``key``'s deliveries waiting until :meth:`release`."""
        self._held.add(key)

    def release(self, key: Hashable) -> None:
        self._held.discard(key)
        if key in self._queued and key not in self._busy:
            self._ready.append(key)

    def busy(self, key: Hashable) -> bool:
        return key in self._busy

    def waiting_for(self, key: Hashable) -> int:
        lane = self._queued.get(key)
        return len(lane) if lane else 0

    def drain(self) -> list[T]:
        """Every waiting item, each key's in order (a hand-back); the lanes are empty after."""
        items = [item for lane in self._queued.values() for item in lane]
        self._queued.clear()
        self._ready.clear()
        self.waiting = 0
        return items

    def clear(self) -> None:
        """The channel is gone: forget the waiting items and what was in flight (holds stay)."""
        self.drain()
        self._busy.clear()
