"""Embedded broker: a kombu virtual transport stored in one SQLite file.

Why not kombu's ``sqla+sqlite`` transport: it never deletes fetched rows, it
strands the messages of a killed process, it requeues rejected messages at
the tail and it keeps exchange bindings in process memory.  This transport
keeps the whole broker (queues, exchanges, bindings, messages) in the
database file, so any process that opens the same file sees the same broker,
and it behaves like a RabbitMQ classic queue where it matters to the
container:

* a delivery *claims* its row; ``ack`` deletes it; ``reject(requeue=True)``,
  ``recover`` and closing the channel unclaim it, so it keeps its place at the
  head of the queue and comes back with ``redelivered=True``;
* a claim names its owner process (host, pid, process start time); claims of
  a process that died are released when a channel opens and every few
  seconds while consuming, so a SIGKILL loses nothing;
* every delivery carries ``x-delivery-count`` (previous counted deliveries,
  as RabbitMQ quorum queues do), which survives crashes;
* direct, topic and fanout exchanges with bindings shared by all processes,
  ``x-max-priority``, per-message and per-queue TTL and dead-lettering.

Usage::

    import mdbcontainer.embedded
    kombu.Connection("embedded:///abs/path/broker.db")
    kombu.Connection(hostname="broker.db", transport=mdbcontainer.embedded.Transport)

The modules, in the order a message meets them:

* ``transport`` / ``channel`` / ``topology``: what kombu sees;
* ``broker_state``: the broker state on one connection, made of ``queue_rows``
  (queues and their consumers; named apart from ``wire.queues``, what tools do
  to a queue, and from ``state.store``, the container's database), ``routing``
  (exchanges, bindings, topic matching), ``messages`` (publish, claim, settle,
  TTL and dead-lettering), ``claims`` (owners, liveness, releasing the claims
  of the dead) and ``browse``;
* ``schema`` (tables, connection set-up), ``payload`` (the stored message
  and the headers the broker adds), ``errors`` (RabbitMQ's replies).
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from .broker_state import BrokerState as BrokerState

# The function, not the submodule of the same name, is the public ``browse``.
from .browse import browse
from .channel import DEFAULT_RECLAIM_INTERVAL as DEFAULT_RECLAIM_INTERVAL
from .channel import Channel
from .channel import logger as logger
from .claims import channel_token as channel_token
from .claims import owner_alive as owner_alive
from .claims import owner_token as owner_token
from .errors import NoRoute
from .payload import DELIVERY_COUNT_HEADER as DELIVERY_COUNT_HEADER
from .payload import Payload as Payload
from .payload import dumps as dumps
from .payload import loads as loads
from .routing import EXCHANGE_TYPES as EXCHANGE_TYPES
from .routing import topic_matches
from .schema import DEFAULT_BUSY_TIMEOUT as DEFAULT_BUSY_TIMEOUT
from .schema import MIN_SQLITE as MIN_SQLITE
from .schema import SCHEMA_VERSION as SCHEMA_VERSION
from .schema import SYNCHRONOUS_MODES as SYNCHRONOUS_MODES
from .schema import db_path
from .transport import Transport

__all__ = [
    "Channel",
    "NoRoute",
    "Transport",
    "browse",
    "db_path",
    "topic_matches",
]

# kombu resolves a URL scheme only through TRANSPORT_ALIASES, and refuses
# dotted module paths coming from URLs; registering the alias when this
# package is imported is what makes ``Connection("embedded:///path")`` work.
# It is this package's only import-time side effect.
TRANSPORT_ALIASES["embedded"] = "mdbcontainer.embedded:Transport"
