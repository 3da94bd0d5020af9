"""Publishing through the broker: one connection and channel, broker confirms, mandatory routing.

A single publish waits for its confirm; :meth:`Publisher.publish_many` sends a
list and awaits the confirms together (:class:`_ConfirmWindow` counts them).
``prepare`` turns a body and this package's properties into a transport message,
for a subscription's own publishes too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import kombu

from ..errors import PublishError, Unroutable
from ..support.failures import describe
from .connection import Broker, connection_errors
from .heartbeat import Heartbeat, using

log = logging.getLogger("mdbcontainer.broker")


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
        if self.broker.partitions:  # an ordered destination's partition, by the message's key
            exchange, routing_key = self.broker.keyed(exchange, routing_key, body, properties)
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
            self._window.confirmed_in_place()
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
                    exchange, routing_key = item.exchange, item.routing_key
                    if self.broker.partitions:
                        exchange, routing_key = self.broker.keyed(exchange, routing_key, item.body,
                                                                  item.properties)
                    send(message, exchange=exchange, routing_key=routing_key,
                         mandatory=item.mandatory)
                    if confirms:
                        window.sent()
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
                    for index in _returned_sends(items, self._returned):
                        errors[index] = self._unroutable(items[index].routing_key)
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
    """Publisher confirms in flight on one channel: the tags outstanding, and those nacked.

    RabbitMQ numbers a confirm channel's publishes 1, 2, ... and confirms
    them with ``basic.ack`` / ``basic.nack``, each possibly ``multiple``
    (covering every earlier tag still outstanding too). The confirms come in
    no set order: a publish that no queue takes (a topic nobody subscribes
    to) is confirmed at once, a persistent one on a quorum queue once the
    queue has it. So the window keeps the set of tags not yet confirmed; the
    highest tag confirmed says nothing of the earlier ones.
    """

    def __init__(self) -> None:
        self.published = 0  # the last tag handed out
        self.outstanding: set[int] = set()
        self._nacked: list[int] = []

    def sent(self) -> int:
        """A publish is on the wire: its tag, outstanding until the broker confirms it."""
        self.published += 1
        self.outstanding.add(self.published)
        return self.published

    def confirmed_in_place(self) -> None:
        """A publish whose confirm the caller awaited itself (py-amqp's ``basic_publish``)."""
        self.published += 1

    def acked(self, tag: int, multiple: bool) -> None:
        self._settle(int(tag), multiple)

    def nacked(self, tag: int, multiple: bool) -> None:
        self._nacked.extend(self._settle(int(tag), multiple))

    def _settle(self, tag: int, multiple: bool) -> list[int]:
        """Take the tags a confirm covers off the outstanding set; return them in order."""
        covered = sorted(t for t in self.outstanding if t <= tag) if multiple else (
            [tag] if tag in self.outstanding else [])
        self.outstanding.difference_update(covered)
        return covered

    def await_all(self, channel: Any) -> None:
        from amqp import spec

        while self.outstanding:
            channel.wait([spec.Basic.Ack, spec.Basic.Nack])

    def nacks_since(self, first: int) -> list[int]:
        nacked, self._nacked = sorted(t for t in self._nacked if t >= first), []
        return nacked


def _returned_sends(items: list[Publish], returned: list[tuple[str, str, Any, Any]]) -> list[int]:
    """The index of the send each return came from, by publish order.

    The broker returns messages in the order they were published, so each
    return belongs to the first send after the previous return's that has its
    exchange, routing key and message id. The id alone is not enough: two
    sends of one unit of work may share one (the same message to two queues),
    and blaming the wrong one would delete the unroutable send's outbox row
    as sent and relay the routable one again.
    """
    found: list[int] = []
    start = 0
    for exchange, routing_key, _exc, message_id in returned:
        for index in range(start, len(items)):
            item = items[index]
            if (item.exchange, item.routing_key, item.properties.get("message_id")) == (
                    exchange, routing_key, message_id):
                found.append(index)
                start = index + 1
                break
    return found


def prepare(channel: Any, body: bytes, properties: dict[str, Any]) -> Any:
    """A transport message from a body and this package's property dict."""
    props = dict(properties)
    headers = props.pop("headers", None) or {}
    content_type = props.pop("content_type", "application/json")
    priority = props.pop("priority", None)
    encoding = props.pop("content_encoding", None) or "utf-8"
    return channel.prepare_message(body, priority, content_type, encoding, headers, props)

