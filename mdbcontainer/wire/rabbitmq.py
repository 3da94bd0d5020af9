"""RabbitMQ through py-amqp: the transport the container was built on.

Its consumers read their frames in bulk (``frames.py``: one ``recv`` for many
deliveries, where py-amqp takes nine), heartbeats are AMQP's (``heartbeat.py``),
and publishes wait for the broker's confirms (``publisher.py``). Everything
else is the default :class:`~mdbcontainer.wire.transport.Transport`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import kombu

from ..errors import QueueUnavailable
from ..support.failures import describe
from .transport import Capabilities, Transport

RABBITMQ = Capabilities("rabbitmq", True, True, True, True)


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


class RabbitMQTransport(Transport):
    """``amqp://`` and ``amqps://``: one or several nodes of a cluster."""

    schemes = ("amqp", "amqps", "pyamqp")
    capabilities = RABBITMQ

    def connection(self, url: str, *, confirms: bool, heartbeat: int, timeout: float,
                   polling_interval: float | None) -> kombu.Connection:
        """py-amqp's connection; its TCP user timeout is two heartbeats (see Broker.connection)."""
        options: dict[str, Any] = {}
        if confirms:
            options["confirm_publish"] = True
        if heartbeat and hasattr(socket, "TCP_USER_TIMEOUT"):
            options["socket_settings"] = {socket.TCP_USER_TIMEOUT: 2 * heartbeat * 1000}
        return kombu.Connection(url, connect_timeout=timeout, transport_options=options,
                                heartbeat=heartbeat, ssl=self._ssl(url))

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

    def declare(self, declare: Callable[[], None], name: str) -> None:
        """A declare refused because the queue's node is down is an unavailable queue, not a bug."""
        try:
            declare()
        except Exception as exc:
            if node_down(exc):
                raise QueueUnavailable(f"queue {name!r} is unavailable: {describe(exc)}") from exc
            raise
