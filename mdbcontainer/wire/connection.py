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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kombu
import tenacity
from amqp.exceptions import AccessRefused, NotAllowed
from kombu.exceptions import OperationalError as KombuOperationalError

from ..errors import BrokerUnavailable, QueueUnavailable
from ..settings import EMBEDDED_DEFAULT_FILE, Settings, broker_urls, mask_url
from ..support.failures import describe
from ..support.retry import DEFAULT as RETRY
from ..support.tracing import tracing_for
from .delays import wait_queues

log = logging.getLogger("mdbcontainer.broker")

EMBEDDED = "embedded://"


@dataclass(frozen=True)
class Capabilities:
    """What the transport provides natively; the container emulates or refuses the rest."""

    name: str
    publisher_confirms: bool
    redelivered_flag: bool
    channel_transactions: bool
    exclusive_queues: bool


RABBITMQ = Capabilities("rabbitmq", True, True, True, True)
EMBEDDED_CAPS = Capabilities("embedded", False, True, False, False)


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


# What RabbitMQ says when a queue's node is down or its quorum has no leader yet.
_NODE_DOWN = ("down or inaccessible", "home node", "nodedown", "noproc", "timeout", "timed out")


def node_down(exc: BaseException) -> bool:
    """A channel error that names an unavailable cluster node, not a wrong request.

    ``404 NOT_FOUND - home node 'rabbit@h2' of durable queue 'Q' in vhost '/' is
    down or inaccessible`` is not a missing queue: the queue comes back with
    its node. The text is all RabbitMQ gives to tell the two apart.
    """
    import amqp

    if not isinstance(exc, amqp.exceptions.AMQPError):
        return False
    if isinstance(exc, amqp.exceptions.PreconditionFailed | amqp.exceptions.AccessRefused):
        return False  # a request the broker refuses (its text may name an x-...-timeout argument)
    text = str(exc).lower()
    return any(marker in text for marker in _NODE_DOWN)


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
        self.is_embedded = self.url.startswith(EMBEDDED)
        self.capabilities = EMBEDDED_CAPS if self.is_embedded else RABBITMQ
        self._waits: dict[str, dict[str, Any]] | None = None  # wait queue -> arguments, when asked
        self.tracing = tracing_for(settings)  # every publish and delivery through this broker

    @property
    def embedded_path(self) -> str:
        """The embedded broker's SQLite file (its default when the URL names none)."""
        return self.url[len(EMBEDDED):] or EMBEDDED_DEFAULT_FILE

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
        if self.is_embedded:
            from .. import embedded

            path = Path(self.embedded_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            return kombu.Connection(hostname=str(path), transport=embedded.Transport)
        options: dict[str, Any] = {}
        if confirms and self.capabilities.publisher_confirms:
            options["confirm_publish"] = True
        beat = self.heartbeat if heartbeat else 0
        if beat and hasattr(socket, "TCP_USER_TIMEOUT"):
            options["socket_settings"] = {socket.TCP_USER_TIMEOUT: 2 * beat * 1000}
        url = self.urls[self._node if node is None else node]
        return kombu.Connection(
            url,
            connect_timeout=timeout,
            transport_options=options,
            heartbeat=beat,
            ssl=self._ssl(url),
        )

    def _ssl(self, url: str) -> Any:
        c = self.settings.container
        if not url.startswith("amqps://"):
            return None
        if not (c.ssl_ca or c.ssl_cert):
            return True
        import ssl

        context = ssl.create_default_context(cafile=c.ssl_ca)
        if c.ssl_cert:
            context.load_cert_chain(c.ssl_cert, c.ssl_key)
        return context

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

    def queue_arguments(self, name: str) -> dict[str, Any]:
        """The declare arguments of queue ``name``: none unless its settings ask."""
        q = self.settings.queue(name)
        args: dict[str, Any] = {}
        if q.max_priority:
            args["x-max-priority"] = q.max_priority
        if q.quorum:
            args["x-queue-type"] = "quorum"
        if q.expiry_queue:
            args["x-dead-letter-exchange"] = ""
            args["x-dead-letter-routing-key"] = q.expiry_queue
        return args

    def declare_queue(self, channel: Any, name: str) -> None:
        """Declare durable queue ``name`` with its settings' arguments (and its expiry queue)."""
        expiry = self.settings.queue(name).expiry_queue
        if expiry:
            self._declare(channel, expiry)
        self._declare(channel, name)

    def _declare(self, channel: Any, name: str) -> None:
        """Declare queue ``name``, then the queues its failed messages wait on (delays.py), if any."""
        self._declare_with(channel, name, self.queue_arguments(name))
        for wait, arguments in wait_queues(name, self.settings.queue(name)).items():
            self._declare_with(channel, wait, arguments)

    def wait_queue_arguments(self, name: str) -> dict[str, Any] | None:
        """The declare arguments of ``name`` if it is a wait queue of a queue the settings name."""
        if self._waits is None:
            self._waits = {wait: args for queue, q in self.settings.queues.items()
                           for wait, args in wait_queues(queue, q).items()}
        return self._waits.get(name)

    def _declare_with(self, channel: Any, name: str, arguments: dict[str, Any]) -> None:
        def declare() -> None:
            channel.queue_declare(queue=name, durable=True, auto_delete=False, arguments=arguments or None)

        if not self.is_embedded:
            try:
                declare()
            except Exception as exc:
                if node_down(exc):
                    raise QueueUnavailable(f"queue {name!r} is unavailable: {describe(exc)}") from exc
                raise
            return
        # The embedded transport's race on a first declare from two processes: try again.
        tenacity.Retrying(stop=tenacity.stop_after_attempt(5), reraise=True,
                          wait=tenacity.wait_incrementing(0.05, 0.05))(declare)

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


def _worth_retrying(exc: BaseException) -> bool:
    """A lost or refused connection, but not a refused login (retrying cannot fix it)."""
    return isinstance(exc, connection_errors()) and not broker_refused(exc)


def broker_refused(exc: BaseException) -> bool:
    """The broker refused the URL's user, password (ACCESS_REFUSED) or vhost (NOT_ALLOWED)."""
    refusals = (AccessRefused, NotAllowed)
    return isinstance(exc, refusals) or isinstance(exc.__cause__, refusals)
