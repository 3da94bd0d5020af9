"""The transport interface: what the wire asks of a broker, and what each broker declares it can do.

One module per transport sits beside this one: ``rabbitmq.py`` (py-amqp, with
the bulk frame reader of ``frames.py``), ``embedded.py`` (the SQLite broker of
``mdbcontainer.embedded``) and ``sqs.py`` (Amazon SQS through boto3). Each is a
:class:`Transport`: it builds the kombu connection the rest of the wire uses
(connect, declare, publish, consume, acknowledge, requeue: kombu's channel API,
which every transport speaks), and it declares its :class:`Capabilities`, so
that the :class:`~mdbcontainer.wire.connection.Broker`, the subscription and
the operations read a flag instead of asking which broker they run on. What a
transport lacks and a setting needs is refused at start (:meth:`Transport.refusals`):
one line naming the setting and the transport, exit 2.

docs/architecture.md ("How to add a transport") walks through a fourth.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import kombu

    from ..settings import PortSettings, Settings


@dataclass(frozen=True)
class Capabilities:
    """What the transport provides natively; the container emulates or refuses the rest."""

    name: str
    publisher_confirms: bool
    redelivered_flag: bool
    channel_transactions: bool
    exclusive_queues: bool
    # A queue's unacknowledged messages can be counted beside its ready ones (the embedded
    # broker's file holds both; RabbitMQ's passive declare counts the ready ones only).
    counts_unacknowledged: bool = False
    # AMQP heartbeats keep the connection (and find it dead): a heartbeat thread runs beside it.
    heartbeats: bool = True
    # The broker lives in a file of this host: an exclusive consumer is a file lock beside it,
    # its TTL queues are expired by this process's clock, and a login cannot be refused.
    local_file: bool = False
    # A failed message's redelivery delay is kept by the broker on the message itself (SQS's
    # visibility timeout): no wait queues; ``Delivery.postpone`` moves it.
    postpones: bool = False
    # Topics (exchanges, bindings, durable subscriptions), priorities, per-message TTLs.
    topics: bool = True
    priorities: bool = True
    # Requests with a reply queue of their own (``mdb request``).
    replies: bool = True
    # Consistent-hash partitions of ordered destinations.
    partitions: bool = True
    # A queue declared again with other arguments is refused (RabbitMQ's PRECONDITION_FAILED).
    strict_redeclare: bool = True


class Transport:
    """One broker kind behind the wire. Subclasses set :attr:`capabilities` and build connections."""

    #: The URL schemes (before ``://``) this transport serves.
    schemes: tuple[str, ...] = ()
    capabilities: Capabilities

    def __init__(self, settings: Settings, url: str) -> None:
        self.settings = settings
        self.url = url

    def connection(self, url: str, *, confirms: bool, heartbeat: int, timeout: float,
                   polling_interval: float | None) -> kombu.Connection:
        """A new, not yet connected kombu connection to ``url`` (one node of ``broker_url``)."""
        raise NotImplementedError

    def declare(self, declare: Callable[[], None], name: str) -> None:
        """Run one queue declaration (``declare``), translating the transport's transient refusals."""
        declare()

    def refusals(self, settings: Settings, ports: Mapping[str, PortSettings]) -> list[str]:
        """Settings that need what this transport lacks: each ``key: why``, naming the transport."""
        return _refused(settings, ports, self.capabilities)

    def implied_order_key(self, destination: str | None) -> str | None:
        """The header that keys ``destination``'s order when the port sets no ``order_by``.

        None by default: a queue orders nothing by itself. A transport whose
        queues carry a key of their own (SQS FIFO message groups) names the
        header it delivers that key in, and such a port is ordered by it.
        """
        return None

    def prepare_test_queue(self, channel: Any, name: str) -> None:
        """Hook for test kits: nothing by default."""


def _refused(settings: Settings, ports: Mapping[str, PortSettings], caps: Capabilities) -> list[str]:
    """The keys a transport without a capability refuses (see :class:`Capabilities`)."""
    name = caps.name
    out: list[str] = []
    if not caps.topics:
        for topic in settings.topics:
            out.append(f"topics.{topic}: {name} has no topics (exchanges and subscriptions)")
        for port, p in ports.items():
            if p.topic:
                out.append(f"ports.{port}.topic: {name} has no topics or durable subscriptions")
    if not caps.priorities:
        for queue, q in settings.queues.items():
            if q.max_priority:
                out.append(f"queues.{queue}.max_priority: {name} has no message priorities")
            if q.quorum:
                out.append(f"queues.{queue}.quorum: {name} has no quorum queues (it replicates itself)")
            if q.expiry_queue:
                out.append(f"queues.{queue}.expiry_queue: {name} has no per-message expiry")
    if not caps.partitions:
        for port, p in ports.items():
            if p.partitions:
                out.append(f"ports.{port}.partitions: {name} has no consistent-hash exchange")
    return out


def settled_tags(qos: Any, delivery_tag: Any, multiple: bool) -> list[Any]:
    """The tags one acknowledgment settles on a kombu virtual channel (embedded, SQS).

    With ``multiple``, AMQP's meaning: every tag delivered up to and including
    ``delivery_tag``, in the order kombu's QoS keeps them; a tag it no longer
    holds settles itself only.
    """
    if multiple:
        qos._flush()
        pending = list(qos._delivered)
        if delivery_tag in pending:
            return pending[: pending.index(delivery_tag) + 1]
    return [delivery_tag]
