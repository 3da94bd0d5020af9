"""The kombu transport ``embedded://PATH``: what kombu asks of a transport.

The channel does the work; the transport declares capabilities (so callers
read them instead of guessing) and classifies SQLite's errors for kombu's
retry logic.
"""

from __future__ import annotations

import sqlite3

from kombu.transport import virtual

from .channel import Channel
from .payload import Payload
from .routing import EXCHANGE_TYPES


class Transport(virtual.Transport):
    """kombu transport ``embedded://PATH``: a broker in one SQLite file."""

    Channel = Channel

    #: virtual transports poll; an empty poll is one indexed read.
    polling_interval = 0.05
    can_parse_url = True
    driver_type = "sqlite"
    driver_name = "sqlite3"

    #: "database is locked" past the busy timeout, I/O errors: transient,
    #: so kombu's ensure()/reconnect logic retries them.
    connection_errors = (  # type: ignore[assignment]
        *virtual.Transport.connection_errors,
        sqlite3.OperationalError,
    )
    channel_errors = (  # type: ignore[assignment]
        *virtual.Transport.channel_errors,
        sqlite3.IntegrityError,
    )

    implements = virtual.Transport.implements.extend(
        asynchronous=False,
        exchange_type=EXCHANGE_TYPES,
        heartbeats=False,
    )

    def driver_version(self) -> str:
        return sqlite3.sqlite_version

    def _reject_inbound_message(self, raw_message: Payload) -> None:
        """A message fetched for a queue whose consumer just went: hand it back.

        kombu would reject-requeue it, which here counts a failed delivery.
        """
        for channel in self.channels:
            if channel:
                channel.hand_back(raw_message["properties"]["delivery_tag"])
                return
