"""Partitions of an ordered destination (README "Ordered ports"): one key, one queue, one consumer.

``partitions = N`` on an ordered port turns its destination ``DEST`` into a
consistent-hash exchange called ``DEST`` (RabbitMQ's
``rabbitmq_consistent_hash_exchange`` plugin) with N durable queues
``DEST.p0`` ... bound to it, each with single active consumer. A producer
publishes to the exchange with the message's key as routing key, so every
message of a key lands on the same partition, and the broker lets one
consumer of the fleet at a time read each partition: when it dies, the next
one waiting takes the partition over, with its unacknowledged messages back
in their place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SettingsError
from ..settings import Settings
from ..support.ordering import OrderKey

EXCHANGE_TYPE = "x-consistent-hash"
PLUGIN = "rabbitmq_consistent_hash_exchange"
_WEIGHT = "1"  # every partition's share of the hash ring: equal


@dataclass(frozen=True)
class Partitioned:
    """An ordered destination spread over ``count`` queues by the key of its port."""

    destination: str
    count: int
    key: OrderKey

    @property
    def queues(self) -> list[str]:
        return [f"{self.destination}.p{i}" for i in range(self.count)]

    def routing_key(self, body: bytes, properties: Mapping[str, Any]) -> str:
        """The key of the message, else its id: a message without a key lands anywhere."""
        key = self.key.of(properties.get("headers"), body)
        return key if key is not None else str(properties.get("message_id") or "")

    def declare(self, channel: Any, arguments: dict[str, Any]) -> None:
        """The exchange and its partitions, each queue with the destination's own arguments.

        A broker without the plugin refuses the exchange type: a settings error naming the fix
        (the broker closes the connection with 503, which would otherwise read as an outage).
        """
        try:
            channel.exchange_declare(exchange=self.destination, type=EXCHANGE_TYPE, durable=True,
                                     auto_delete=False)
        except Exception as exc:
            if _unknown_type(exc):
                raise SettingsError(missing_text(self.destination, self.count)) from exc
            raise
        queue_arguments = {**arguments, "x-single-active-consumer": True}
        for queue in self.queues:
            channel.queue_declare(queue=queue, durable=True, auto_delete=False,
                                  arguments=queue_arguments)
            channel.queue_bind(queue=queue, exchange=self.destination, routing_key=_WEIGHT)


def partitioned(settings: Settings) -> dict[str, Partitioned]:
    """The partitioned destinations the settings' ``[ports]`` tables name, by destination.

    Read from the file, not the decorators: a producer (``mdb send``, ``Producer``)
    routes by it without importing the listeners.
    """
    found: dict[str, Partitioned] = {}
    for table in settings.ports.values():
        if table.destination and table.partitions and table.order_by:
            found[table.destination] = Partitioned(table.destination, table.partitions,
                                                   OrderKey(table.order_by))
    return found


def missing_text(destination: str, count: int) -> str:
    return (f"destination {destination!r} (partitions = {count}) needs RabbitMQ's {PLUGIN} plugin, "
            f"which the broker lacks: rabbitmq-plugins enable {PLUGIN}")


def _unknown_type(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "exchange type" in text and ("invalid" in text or "unknown" in text)


def plugin_missing(channel: Any, probe: str, kind: str = EXCHANGE_TYPE) -> bool:
    """Whether the broker refuses exchanges of type ``kind``; the probe exchange is deleted.

    A refusal closes the connection (503): the caller's connection is spent after True.
    """
    try:
        channel.exchange_declare(exchange=probe, type=kind, durable=False, auto_delete=True)
    except Exception as exc:
        if _unknown_type(exc):
            return True
        raise
    channel.exchange_delete(exchange=probe)
    return False
