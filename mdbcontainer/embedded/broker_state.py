"""The broker's state in one SQLite connection: :class:`BrokerState`.

Each concept adds its operations in its own module (queue_rows, routing,
messages, claims, browse); the BrokerState is all of them on one connection, one
per kombu channel.
"""

from __future__ import annotations

from .browse import BrowseStore
from .claims import ClaimStore
from .messages import MessageStore


class BrokerState(MessageStore, ClaimStore, BrowseStore):
    """Broker operations on one SQLite connection (one per kombu channel).

    Every public method holds a lock, because kombu lets other threads ack
    while the consuming thread polls on the same channel.
    """
