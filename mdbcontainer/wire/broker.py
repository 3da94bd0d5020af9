"""The narrow seam over kombu: connect, declare, consume, publish with confirms.

Port and pipeline code talk to this module and to ``delivery.py`` (the
received message and its acknowledgment) only. Transport quirks stay here,
and what a transport can do is declared in :class:`Capabilities` rather than
guessed at each use (the embedded transport confirms nothing because its
publish is a committed insert, and has no channel transactions).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kombu
import tenacity
from amqp.exceptions import AccessRefused, NotAllowed
from kombu.exceptions import OperationalError as KombuOperationalError

from ..errors import BrokerUnavailable, PublishError, QueueUnavailable, Unroutable
from ..settings import EMBEDDED_DEFAULT_FILE, Settings, broker_urls, mask_url
from ..support.failures import describe as describe  # also importable from here, as before
from ..support.retry import DEFAULT as RETRY
from ..support.tracing import tracing_for
from .delays import wait_queues
from .delivery import Delivery
from .frames import read_until_method
from .heartbeat import Heartbeat, outside, using
from .ownership import OwnerLock, in_use

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


class Publisher:
    """One connection and channel that publishes with broker confirms and mandatory routing.

    ``heartbeat``: a long-lived publisher of the container, kept alive (and
    found dead) by AMQP heartbeats between its publishes.
    """

    def __init__(self, broker: Broker, *, timeout: float | None = None,
                 heartbeat: bool = False) -> None:
        self.broker = broker
        self._timeout = timeout
        self._heartbeat = heartbeat
        self._beat: Heartbeat | None = None
        self._conn: kombu.Connection | None = None
        self._channel: Any = None
        self._returned: list[Any] = []
        self._declared: set[str] = set()
        self._window = _ConfirmWindow()

    @property
    def channel(self) -> Any:
        if self._channel is None:
            self._conn = self.broker.connect(confirms=True, timeout=self._timeout,
                                             heartbeat=self._heartbeat)
            self._channel = self._conn.channel()
            self._window = _ConfirmWindow()
            events = getattr(self._channel, "events", None)
            if events is not None:
                events["basic_return"].add(self._on_return)
                events["basic_ack"].add(self._window.acked)
                events["basic_nack"].add(self._window.nacked)
            self._beat = Heartbeat.start_for(self._conn, "publisher", owner_drains=False)
        return self._channel

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        properties = getattr(message, "properties", None) or {}
        self._returned.append((exchange, routing_key, exc, properties.get("message_id")))

    def resolve(self, destination: str) -> tuple[str, str, bool]:
        """Declare a destination once per publisher and return its route.

        A declare the broker refuses (a queue that exists with other arguments)
        means the message cannot be published: PublishError, and the channel the
        broker closed is dropped.
        """
        channel = self.channel
        try:
            with using(self._beat):
                route = self.broker.declare_destination(channel, destination)
        except connection_errors():
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise PublishError(
                f"publish to {destination!r} refused: cannot declare it: {describe(exc)}"
            ) from exc
        self._declared.add(destination)
        return route

    def route(self, destination: str) -> tuple[str, str, bool]:
        """The route of a destination, declared once per publisher."""
        if destination in self._declared:
            return self.broker.route(destination)
        return self.resolve(destination)

    def reply_route(self, queue: str) -> tuple[str, str, bool]:
        """The route of a reply: ``reply_to`` as it is, never declared, not mandatory.

        The queue belongs to the requester (an exclusive temporary queue that a
        declare from another connection would be refused on). If the requester
        has gone, its queue went with it and the broker drops the late reply.
        """
        return "", queue, False

    def publish(
        self,
        *,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: dict[str, Any],
        mandatory: bool,
    ) -> None:
        """Publish and wait for the broker's confirm; raise PublishError unless it took the message."""
        with self.broker.tracing.publishing(exchange, routing_key, body, properties) as traced:
            self._publish(exchange=exchange, routing_key=routing_key, body=body, properties=traced,
                          mandatory=mandatory)

    def _publish(self, *, exchange: str, routing_key: str, body: bytes, properties: dict[str, Any],
                 mandatory: bool) -> None:
        channel = self.channel
        message = prepare(channel, body, properties)
        self._returned.clear()
        try:
            with using(self._beat):  # waits for the confirm: reads the connection
                channel.basic_publish(message, exchange=exchange, routing_key=routing_key,
                                      mandatory=mandatory)
        except connection_errors():
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise PublishError(f"publish to {exchange or routing_key!r} failed: {describe(exc)}") from exc
        if self.broker.capabilities.publisher_confirms:  # basic_publish waited for its confirm
            self._window.published += 1
            self._window.confirmed = self._window.published
        if self._returned:
            self._declared.discard(routing_key)  # deleted since declared? the next route declares it
            raise Unroutable(
                f"queue {routing_key!r} does not exist: nothing was sent (a queue is created by "
                "the port that reads it, or when the settings name it under [queues])"
            )

    def publish_many(self, items: list[Publish], *,
                     after_first: Callable[[], None] | None = None) -> list[PublishError | None]:
        """Publish every item, then await their confirms together: one round trip, not one each.

        Returns, per item, None when the broker took it, or the PublishError
        that says why not (returned unroutable, or nacked). A lost connection
        raises: then nothing is known of any item. ``after_first`` runs once
        the first item is on the wire (a crash point for tests).
        """
        if not items:
            return []
        with self.broker.tracing.publishing_many(items) as traced:
            return traced.settle(self._publish_many(traced.items, after_first))

    def _publish_many(self, items: list[Publish],
                      after_first: Callable[[], None] | None) -> list[PublishError | None]:
        channel = self.channel
        self._returned.clear()
        raw: Any = getattr(channel, "_basic_publish", None)  # py-amqp's publish without the wait
        confirms = self.broker.capabilities.publisher_confirms and raw is not None
        send: Any = raw if confirms else channel.basic_publish
        errors: list[PublishError | None] = [None] * len(items)
        window = self._window
        try:
            with using(self._beat):  # waits for the confirms: reads the connection
                if confirms and not channel._confirm_selected:
                    channel._confirm_selected = True  # py-amqp's own flag: basic_publish skips it later
                    channel.confirm_select()
                first_tag = window.published + 1
                for index, item in enumerate(items):
                    message = prepare(channel, item.body, item.properties)
                    returned = len(self._returned)
                    send(message, exchange=item.exchange, routing_key=item.routing_key,
                         mandatory=item.mandatory)
                    if confirms:
                        window.published += 1
                    elif len(self._returned) > returned:  # the embedded broker returns at once
                        errors[index] = self._unroutable(item.routing_key)
                    if index == 0 and after_first is not None:
                        after_first()
                if confirms:
                    window.await_all(channel)
                    for tag in window.nacks_since(first_tag):
                        nacked = items[tag - first_tag].routing_key
                        errors[tag - first_tag] = PublishError(
                            f"the broker did not confirm the message for {nacked!r}")
                    by_id = {item.properties.get("message_id"): i for i, item in enumerate(items)}
                    for _exchange, routing_key, _exc, message_id in self._returned:
                        index = by_id.get(message_id, -1)
                        if index >= 0:
                            errors[index] = self._unroutable(routing_key)
        except connection_errors():
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise PublishError(f"publish of {len(items)} message(s) failed: {describe(exc)}") from exc
        return errors

    def depth(self, queue: str) -> int | None:
        """Messages ready on ``queue`` (a passive declare), or None when it does not exist."""
        channel = self.channel
        try:
            with using(self._beat):
                return int(channel.queue_declare(queue=queue, passive=True).message_count)
        except connection_errors():
            self.close()
            raise
        except Exception as exc:  # NOT_FOUND closes the channel: open a new one next time
            self.close()
            log.debug("queue %s not measured: %s", queue, describe(exc))
            return None

    def _unroutable(self, routing_key: str) -> Unroutable:
        self._declared.discard(routing_key)  # deleted since declared? the next route declares it
        return Unroutable(f"no queue took the message for {routing_key!r} (mandatory publish returned)")

    def close(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.stop()
        self._declared.clear()
        if conn is not None:
            with suppress(Exception):
                conn.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Publish:
    """One message for :meth:`Publisher.publish_many`: its route, body and properties."""

    exchange: str
    routing_key: str
    body: bytes
    properties: dict[str, Any]
    mandatory: bool


class _ConfirmWindow:
    """Publisher confirms in flight on one channel: tags published, confirmed, and nacked.

    RabbitMQ numbers a confirm channel's publishes 1, 2, ... and confirms
    them with ``basic.ack`` / ``basic.nack``, each possibly ``multiple``
    (covering every earlier tag too).
    """

    def __init__(self) -> None:
        self.published = 0
        self.confirmed = 0
        self._nacked: list[int] = []

    def acked(self, tag: int, multiple: bool) -> None:
        self.confirmed = max(self.confirmed, int(tag))

    def nacked(self, tag: int, multiple: bool) -> None:
        low = self.confirmed + 1 if multiple else int(tag)
        self._nacked.extend(range(low, int(tag) + 1))
        self.confirmed = max(self.confirmed, int(tag))

    def await_all(self, channel: Any) -> None:
        from amqp import spec

        while self.confirmed < self.published:
            channel.wait([spec.Basic.Ack, spec.Basic.Nack])

    def nacks_since(self, first: int) -> list[int]:
        nacked, self._nacked = [t for t in self._nacked if t >= first], []
        return nacked


def prepare(channel: Any, body: bytes, properties: dict[str, Any]) -> Any:
    """A transport message from a body and this package's property dict."""
    props = dict(properties)
    headers = props.pop("headers", None) or {}
    content_type = props.pop("content_type", "application/json")
    priority = props.pop("priority", None)
    encoding = props.pop("content_encoding", None) or "utf-8"
    return channel.prepare_message(body, priority, content_type, encoding, headers, props)


class _ExclusiveQueue(kombu.Queue):  # type: ignore[misc]
    """A queue consumed with AMQP ``exclusive``: the broker refuses every other consumer."""

    def consume(self, consumer_tag: str = "", callback: Any = None, no_ack: Any = None,
                nowait: bool = False, on_cancel: Any = None) -> Any:
        return self.channel.basic_consume(
            queue=self.name, no_ack=self.no_ack if no_ack is None else no_ack,
            consumer_tag=consumer_tag or "", callback=callback, nowait=nowait,
            arguments=self.consumer_arguments, on_cancel=on_cancel, exclusive=True,
        )


class Subscription:
    """One consumer: its own connection, channel, prefetch and queue (README: Processes and threads).

    ``exclusive``: the one active subscriber of a durable subscription (a second
    one gets SubscriptionInUse). ``transacted``: the channel is in AMQP
    transaction mode before it consumes, so its publishes and acknowledgments
    take effect at :meth:`commit`.
    """

    def __init__(
        self,
        broker: Broker,
        queue: str,
        prefetch: int,
        on_message: Callable[[Delivery], None],
        declare: Callable[[Any], str],
        *,
        exclusive: bool = False,
        transacted: bool = False,
    ) -> None:
        self.broker = broker
        self.queue = queue
        self.prefetch = prefetch
        self.on_message = on_message
        self._declare = declare
        self.exclusive = exclusive
        self.transacted = transacted
        self.conn: kombu.Connection | None = None
        self.channel: Any = None
        self._consumer: kombu.Consumer | None = None
        self._owner: OwnerLock | None = None
        self._beat: Heartbeat | None = None

    def open(self) -> None:
        """Connect, declare and start consuming (raises BrokerUnavailable or a connection error)."""
        self.conn = self.broker.connect_once(heartbeat=True)
        self.channel = self.conn.channel()
        # Bodies stay bytes: py-amqp would decode them by content_encoding, and
        # the pipeline would only encode them again (or fail on a bad encoding).
        self.channel.auto_decode = False
        self.queue = self._declare(self.channel)
        self.channel.basic_qos(0, self.prefetch, False)
        if self.transacted:
            self.channel.events["basic_return"].add(self._on_return)
            self.channel.tx_select()
        exclusive = self.exclusive and self.broker.capabilities.exclusive_queues
        if self.exclusive and self.broker.is_embedded:
            self._owner = OwnerLock.for_queue(self.broker.embedded_path, self.queue)
            self._owner.acquire()
        queue = (_ExclusiveQueue if exclusive else kombu.Queue)(self.queue, no_declare=True)
        self._consumer = kombu.Consumer(
            self.channel, queues=[queue], on_message=self._dispatch, auto_declare=False,
            accept=None,
        )
        try:
            self._consumer.consume()
        except AccessRefused as exc:
            raise in_use(self.queue, "consumed exclusively by another connection") from exc
        except Exception as exc:
            if node_down(exc):
                raise QueueUnavailable(f"queue {self.queue!r} is unavailable: {describe(exc)}") from exc
            raise
        self._beat = Heartbeat.start_for(self.conn, f"consumer of {self.queue}", owner_drains=True)

    def _dispatch(self, raw: Any) -> None:
        """Run the pipeline on one delivery; heartbeats go on from their thread meanwhile."""
        if self._beat is None:
            self.on_message(Delivery(raw))
        else:
            self._beat.away_for(self.on_message, Delivery(raw))

    def publish(self, *, exchange: str, routing_key: str, body: bytes,
                properties: dict[str, Any], mandatory: bool) -> None:
        """Publish on the consumer's own channel: with ``transacted``, it leaves at commit()."""
        with self.broker.tracing.publishing(exchange, routing_key, body, properties) as traced:
            self.channel.basic_publish(prepare(self.channel, body, traced), exchange=exchange,
                                       routing_key=routing_key, mandatory=mandatory)

    def commit(self) -> None:
        """AMQP tx.commit: this delivery's publishes and acknowledgments take effect together."""
        with using(self._beat):
            self.channel.tx_commit()

    def rollback(self) -> None:
        """AMQP tx.rollback: discard this delivery's publishes and acknowledgments."""
        with using(self._beat):
            self.channel.tx_rollback()

    def _on_return(self, exc: Any, exchange: str, routing_key: str, message: Any) -> None:
        # Every queue is declared before a transacted publish, so this is a queue
        # deleted in the meantime; the commit has already happened.
        log.error("transacted publish to %r returned unroutable: %s", exchange or routing_key, exc)

    @contextmanager
    def between_reads(self) -> Iterator[None]:
        """The owner works without reading (a lingered batch): heartbeats go on meanwhile."""
        with outside(self._beat):
            yield

    def drain(self, timeout: float) -> None:
        """Dispatch deliveries for up to ``timeout`` seconds (returns quietly on a quiet queue)."""
        conn = self.conn
        assert conn is not None
        try:  # once per delivery: plain calls, no context manager
            if self._beat is None:
                conn.drain_events(timeout=timeout)
            else:
                self._beat.read(read_until_method, conn.connection, timeout)
        except TimeoutError:  # socket.timeout is TimeoutError
            pass

    def drain_ready(self, limit: int = 1000) -> int:
        """Read what has already arrived, without waiting; return the frames read.

        For an event loop's consumer: py-amqp reads one frame per call (a message
        is three), so this reads until the socket has nothing more, and a frame
        cut in two is completed (py-amqp keeps the part it read).
        """
        assert self.conn is not None
        read = 0
        with using(self._beat), suppress(socket.timeout, TimeoutError):
            while read < limit:
                self.conn.drain_events(timeout=0)
                read += 1
        return read

    def fileno(self) -> int | None:
        """The socket an event loop can watch for deliveries (None: the transport polls)."""
        sock = getattr(getattr(getattr(self.conn, "connection", None), "transport", None), "sock", None)
        try:
            return sock.fileno() if sock is not None else None
        except OSError:
            return None

    def cancel(self) -> None:
        """Stop consuming; deliveries already sent before the cancel still reach ``on_message``."""
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            with suppress(Exception), using(self._beat):
                consumer.cancel()

    def close(self) -> None:
        """Close the connection: the broker requeues whatever is still unacknowledged."""
        self.cancel()
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.stop()
        conn, self.conn, self.channel = self.conn, None, None
        if conn is not None:
            with suppress(Exception):
                conn.close()
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()


def _read_until_method(amqp_conn: Any, timeout: float) -> None:
    """Read frames until a method frame came, or ``timeout`` is up.

    Not py-amqp's drain_events: it reads on until a method frame comes, each
    broker heartbeat starting its timeout again, so on a quiet queue it can hold
    the lock for ever and our own heartbeats stop (the broker then closes us).
    """
    deadline = time.monotonic() + timeout
    while not amqp_conn.blocking_read(timeout):
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return


def _worth_retrying(exc: BaseException) -> bool:
    """A lost or refused connection, but not a refused login (retrying cannot fix it)."""
    return isinstance(exc, connection_errors()) and not broker_refused(exc)


def broker_refused(exc: BaseException) -> bool:
    """The broker refused the URL's user, password (ACCESS_REFUSED) or vhost (NOT_ALLOWED)."""
    refusals = (AccessRefused, NotAllowed)
    return isinstance(exc, refusals) or isinstance(exc.__cause__, refusals)
