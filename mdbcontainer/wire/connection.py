"""The narrow seam over kombu: connect (failing over between a cluster's nodes), declare.

Port and pipeline code talk to the wire only: this module (the :class:`Broker`,
its connections and topology), ``publisher.py`` (publish with confirms),
``subscription.py`` (one consumer) and ``delivery.py`` (the received message
and its acknowledgment). Transport quirks stay in the wire, and what a
transport can do is declared in :class:`Capabilities` rather than guessed at
each use (the embedded transport confirms nothing because its publish is a
committed insert, and has no channel transactions).
"""

from __future__ import annotations

import logging
import socket
from contextlib import suppress
from typing import Any

import kombu
import tenacity
from amqp.exceptions import AccessRefused, NotAllowed, PreconditionFailed
from kombu.exceptions import OperationalError as KombuOperationalError

from ..errors import BrokerUnavailable
from ..settings import Settings, broker_urls, mask_url
from ..support.failures import describe
from ..support.retry import DEFAULT as RETRY
from ..support.tracing import tracing_for
from .delays import wait_queues
from .embedded import EMBEDDED, EMBEDDED_CAPS, EmbeddedTransport
from .partitions import Partitioned, partitioned
from .rabbitmq import RABBITMQ, RabbitMQTransport, node_down
from .sqs import SQSTransport
from .transport import Capabilities, Transport

#: Every transport, by the URL schemes it serves (docs/architecture.md, "How to add a transport").
TRANSPORTS: tuple[type[Transport], ...] = (RabbitMQTransport, EmbeddedTransport, SQSTransport)

log = logging.getLogger("mdbcontainer.broker")

__all__ = ["EMBEDDED", "EMBEDDED_CAPS", "RABBITMQ", "TRANSPORTS", "Broker", "Capabilities", "Transport",
           "broker_refused", "connection_errors", "node_down", "transport_for"]


def connection_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the broker connection is gone: reconnect, never count against a message."""
    import amqp

    return (
        BrokerUnavailable,
        ConnectionError,
        OSError,
        socket.timeout,
        KombuOperationalError,
        amqp.exceptions.ConnectionError,
        amqp.exceptions.RecoverableConnectionError,
        amqp.exceptions.ConnectionForced,
    )


class Broker:
    """Builds kombu connections for the settings' broker URL and declares topology."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.url = settings.container.broker_url
        self.masked_url = mask_url(self.url)
        # The nodes of one cluster: a connection goes to the node that last took one,
        # and on to the next while a node refuses (kombu's own failover starts from
        # the first URL for every new connection object, and gives up after two).
        self.urls = broker_urls(self.url)
        self._node = 0
        self.heartbeat = int(settings.container.heartbeat.total_seconds())
        self.transport: Transport = transport_for(settings, self.urls[0])
        self.capabilities: Capabilities = self.transport.capabilities
        self._waits: dict[str, dict[str, Any]] | None = None  # wait queue -> arguments, when asked
        self.tracing = tracing_for(settings)  # every publish and delivery through this broker
        # The embedded transport's poll of an empty queue, in seconds (None: its own default).
        # mdbcontainer.testing polls more often: a test waits on every delivery.
        self.polling_interval: float | None = None
        # Ordered destinations spread over partitions: published to by key (partitions.py).
        # (None on the embedded broker, which refuses partitions at binding.)
        self.partitions: dict[str, Partitioned] = (
            partitioned(settings) if self.capabilities.partitions else {})

    @property
    def embedded_path(self) -> str:
        """The broker's file, on a transport that lives in one (``capabilities.local_file``)."""
        return str(getattr(self.transport, "path", ""))

    def route(self, destination: str) -> tuple[str, str, bool]:
        """(exchange, routing key, mandatory) of a destination, as the README's *Guarantees* name them.

        A topic named in the settings is its exchange, published with the topic's
        name as routing key and not mandatory (no subscriber drops it, as JMS does);
        anything else is a queue through the default exchange, mandatory.
        """
        if destination in self.settings.topics:
            return destination, destination, False
        return "", destination, True

    # -- connections -------------------------------------------------------

    def connection(self, *, confirms: bool = False, heartbeat: bool = False,
                   node: int | None = None) -> kombu.Connection:
        """A new, not yet connected kombu connection to one node (the current one by default).

        ``heartbeat``: negotiate ``[container] heartbeat``; only for connections
        that get a :class:`Heartbeat` to send and check them (a connection that
        negotiated heartbeats and sends none is closed by the broker). Its TCP
        user timeout is two heartbeats too: data of ours unacknowledged that long
        means a dead network, even while nobody reads the socket.
        """
        timeout = self.settings.container.connect_timeout.total_seconds()
        beat = self.heartbeat if heartbeat and self.capabilities.heartbeats else 0
        url = self.urls[self._node if node is None else node]
        return self.transport.connection(
            url, confirms=confirms and self.capabilities.publisher_confirms, heartbeat=beat,
            timeout=timeout, polling_interval=self.polling_interval)

    def connect_once(self, *, confirms: bool = False, heartbeat: bool = False) -> kombu.Connection:
        """One attempt on each node in turn (the caller's retry policy decides when to try again)."""
        start = self._node
        last: BaseException | None = None
        for step in range(len(self.urls)):
            node = (start + step) % len(self.urls)
            conn = self.connection(confirms=confirms, heartbeat=heartbeat, node=node)
            try:
                conn.connect()
            except (AccessRefused, NotAllowed) as exc:  # a wrong user, password or vhost
                with suppress(Exception):
                    conn.close()
                raise self._login_refused(exc) from exc
            except connection_errors() as exc:
                with suppress(Exception):
                    conn.close()
                last = exc
                if len(self.urls) > 1:
                    log.debug("broker node %s refused a connection: %s",
                              mask_url(self.urls[node]), describe(exc))
                continue
            except BaseException:
                with suppress(Exception):
                    conn.close()
                raise
            if node != self._node:
                log.info("broker connection failed over to %s", mask_url(self.urls[node]))
                self._node = node
            return conn
        assert last is not None
        raise last

    def _login_refused(self, exc: BaseException) -> BrokerUnavailable:
        """A refused login is an outage to wait out (``mdb run``) or exit 1 on (the CLI).

        py-amqp raises it as a channel error, which would otherwise escape as a
        traceback, or stop a port for the whole fleet as if a message had failed.
        """
        return BrokerUnavailable(f"broker {self.masked_url} refused the login: {describe(exc)}")

    def verify_login(self) -> BrokerUnavailable | None:
        """Connect once: raise a refused login or vhost, return (not raise) a broker that is away.

        ``mdb check`` and the start of ``mdb run`` tell the two apart: a wrong
        user, password or vhost is a configuration error no retry can fix; a
        broker that is down may come up, and ``mdb run`` waits for it.
        """
        try:
            self.connect_once().close()
        except BrokerUnavailable as exc:
            if broker_refused(exc):
                raise
            return exc
        except connection_errors() as exc:
            return BrokerUnavailable(f"broker {self.masked_url} not reachable: {describe(exc)}")
        return None

    def connect(self, *, confirms: bool = False, timeout: float | None = None,
                heartbeat: bool = False) -> kombu.Connection:
        """Connect within ``timeout`` (default ``connect_timeout``) or raise BrokerUnavailable."""
        limit = timeout if timeout is not None else self.settings.container.connect_timeout.total_seconds()
        retrying = RETRY.within(limit, retry=tenacity.retry_if_exception(_worth_retrying), maximum=0.5)
        try:
            conn: kombu.Connection = retrying(self.connect_once, confirms=confirms, heartbeat=heartbeat)
        except connection_errors() as exc:
            if not _worth_retrying(exc):  # a refused login says so itself
                raise
            raise BrokerUnavailable(
                f"broker {self.masked_url} not reachable within {limit:g}s: {describe(exc)}"
            ) from exc
        return conn

    # -- topology ----------------------------------------------------------

    def queue_arguments(self, name: str, *, dead_lettering: bool = True) -> dict[str, Any]:
        """The declare arguments of queue ``name``: none unless its settings ask.

        A quorum queue dead-letters what the broker itself gives up on (its
        ``delivery-limit``, which RabbitMQ 4 sets to 20 by default; an expiry) to
        the queue's backout queue, or to its expiry queue when it has one, with
        the broker's reason in ``x-death``: never dropped. At least once (RabbitMQ
        3.10 and later), which the broker allows with ``reject-publish`` only.
        ``dead_lettering=False``: the arguments a quorum queue had before that.
        """
        q = self.settings.queue(name)
        args: dict[str, Any] = {}
        if q.max_priority:
            args["x-max-priority"] = q.max_priority
        if q.quorum:
            args["x-queue-type"] = "quorum"
        target = q.expiry_queue
        if q.quorum and dead_lettering:
            target = target or self.settings.backout_queue_for(name)
        if target and target != name:
            args["x-dead-letter-exchange"] = ""
            args["x-dead-letter-routing-key"] = target
            if q.quorum and dead_lettering:
                args.update({"x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
        return args

    def declare_queue(self, channel: Any, name: str) -> None:
        """Declare durable queue ``name`` with its settings' arguments (and its expiry queue).

        A partitioned destination is its exchange and partition queues instead (partitions.py).
        """
        expiry = self.settings.queue(name).expiry_queue
        if expiry:
            self._declare(channel, expiry)
        part = self.partitions.get(name)
        if part is not None:
            part.declare(channel, self.queue_arguments(name))
            return
        self._declare(channel, name)

    def keyed(self, exchange: str, routing_key: str, body: bytes,
              properties: dict[str, Any]) -> tuple[str, str]:
        """The route of one message: to a partitioned destination, by its key; else as given."""
        part = self.partitions.get(routing_key) if not exchange else None
        if part is None:
            return exchange, routing_key
        return part.destination, part.routing_key(body, properties)

    def _declare(self, channel: Any, name: str) -> None:
        """Declare queue ``name``, then the queues its failed messages wait on (delays.py), if any."""
        arguments = self.queue_arguments(name)
        if "x-dead-letter-strategy" in arguments and self.capabilities.strict_redeclare:
            arguments = self._accepted(channel, name, arguments)
        self._declare_with(channel, name, arguments)
        if not self.capabilities.postpones:  # else a delay is the message's own (Delivery.postpone)
            for wait, arguments in wait_queues(name, self.settings.queue(name)).items():
                self._declare_with(channel, wait, arguments)

    def wait_queue_arguments(self, name: str) -> dict[str, Any] | None:
        """The declare arguments of ``name`` if it is a wait queue of a queue the settings name."""
        if self._waits is None:
            self._waits = {} if self.capabilities.postpones else {
                wait: args for queue, q in self.settings.queues.items()
                for wait, args in wait_queues(queue, q).items()}
        return self._waits.get(name)

    def _accepted(self, channel: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """``arguments``, unless quorum queue ``name`` exists from before its dead-lettering: then
        the arguments it has (the broker refuses others), and a WARNING saying how to add it.

        Tried on a channel of its own: a refused declare closes the channel it was sent on.
        """
        trial = channel.connection.channel()
        try:
            trial.queue_declare(queue=name, durable=True, auto_delete=False, arguments=arguments)
            return arguments
        except PreconditionFailed:
            target = arguments["x-dead-letter-routing-key"]
            log.warning("quorum queue %r was declared without dead-lettering: what the broker gives "
                        "up on (its delivery-limit) is dropped, not moved to %r. Add it with a "
                        "policy (dead-letter-exchange \"\", dead-letter-routing-key %s, "
                        "dead-letter-strategy at-least-once, overflow reject-publish), or delete "
                        "the empty queue to have it declared anew", name, target, target)
            return self.queue_arguments(name, dead_lettering=False)
        finally:
            with suppress(Exception):
                trial.close()

    def _declare_with(self, channel: Any, name: str, arguments: dict[str, Any]) -> None:
        def declare() -> None:
            channel.queue_declare(queue=name, durable=True, auto_delete=False, arguments=arguments or None)

        self.transport.declare(declare, name)

    def declare_topic(self, channel: Any, topic: str) -> None:
        channel.exchange_declare(exchange=topic, type="topic", durable=True, auto_delete=False)

    def declare_subscription(self, channel: Any, topic: str, queue: str, durable: bool) -> str:
        """Declare a subscription queue bound with ``#`` to the topic; return its name."""
        self.declare_topic(channel, topic)
        if durable:
            self._declare(channel, queue)
        else:
            ok = channel.queue_declare(
                queue=queue, durable=False, auto_delete=True, exclusive=False, arguments=None
            )
            queue = getattr(ok, "queue", queue) or queue
        channel.queue_bind(queue=queue, exchange=topic, routing_key="#")
        return queue

    def declare_destination(self, channel: Any, destination: str) -> tuple[str, str, bool]:
        """Declare a destination before a publish and return its :meth:`route`.

        A topic's exchange is declared (a publish to an exchange nobody declared
        is refused), and so is a queue the settings name. Any other queue is
        left as it is: if it does not exist, the mandatory publish fails rather
        than create a queue no port reads.
        """
        route = self.route(destination)
        if route[0]:
            self.declare_topic(channel, destination)
        elif self.settings.names_queue(destination):
            self.declare_queue(channel, destination)
        elif (arguments := self.wait_queue_arguments(destination)) is not None:
            self._declare_with(channel, destination, arguments)  # deleted by an operator? back again
        return route


def transport_for(settings: Settings, url: str) -> Transport:
    """The transport serving ``url``'s scheme (settings validation already refused any other)."""
    scheme = url.split("://", 1)[0].lower()
    kind = next((t for t in TRANSPORTS if scheme in t.schemes), RabbitMQTransport)
    return kind(settings, url)


def _worth_retrying(exc: BaseException) -> bool:
    """A lost or refused connection, but not a refused login (retrying cannot fix it)."""
    return isinstance(exc, connection_errors()) and not broker_refused(exc)


def broker_refused(exc: BaseException) -> bool:
    """The broker refused the URL's user, password (ACCESS_REFUSED) or vhost (NOT_ALLOWED)."""
    refusals = (AccessRefused, NotAllowed)
    return isinstance(exc, refusals) or isinstance(exc.__cause__, refusals)
