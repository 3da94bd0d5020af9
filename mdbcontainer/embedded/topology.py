"""The channel's declarations: exchanges, queues and bindings, in the file.

kombu's virtual Channel keeps these in process memory; here each call goes
to the :class:`~mdbcontainer.embedded.broker_state.BrokerState`, so a queue declared or
bound by one process is there for every other.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from amqp.exceptions import ChannelError
from amqp.protocol import queue_declare_ok_t
from kombu.transport import virtual

from .broker_state import BrokerState
from .errors import EXCHANGE_DECLARE, QUEUE_DECLARE, not_found


class TopologyChannel(virtual.Channel):
    """The declaring half of :class:`~mdbcontainer.embedded.channel.Channel`.

    The Channel sets these attributes when it opens; they are declared here
    because the declarations use them.
    """

    _store: BrokerState | None
    #: This channel's claim token: the owner of its exclusive queues.
    _token: str
    #: Exclusive queues this channel declared, dropped when it closes.
    _exclusive: set[str]

    @property
    def store(self) -> BrokerState:
        if self._store is None:
            raise ChannelError("embedded broker: channel is closed")
        return self._store

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        kind = type or "direct"
        name = exchange or f"amq.{kind}"
        if passive:
            if not self.store.has_exchange(name):
                raise not_found("exchange", name, EXCHANGE_DECLARE)
            return
        self.store.declare_exchange(name, kind, durable, auto_delete, arguments)

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self.store.delete_exchange(exchange, if_unused=if_unused)

    def queue_declare(
        self,
        queue: str | None = None,
        passive: bool = False,
        arguments: dict[str, Any] | None = None,
        exclusive: bool = False,
        auto_delete: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Declare (persistently) or check a queue, like AMQP queue.declare."""
        name = queue or f"amq.gen-{uuid.uuid4()}"
        if passive:
            if not self.store.has_queue(name):
                raise not_found("queue", name, QUEUE_DECLARE)
        else:
            owner = self._token if exclusive else None
            self.store.declare_queue(name, arguments, owner, auto_delete)
            if exclusive:
                self._exclusive.add(name)
        return queue_declare_ok_t(name, self.store.size(name), self.store.consumer_count(name))

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> int:
        self._exclusive.discard(queue)
        return self.store.delete_queue(queue, if_empty=if_empty)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.store.bind(queue, exchange or "amq.direct", routing_key or "", arguments)

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.store.unbind(queue, exchange or "amq.direct", routing_key or "")

    def list_bindings(self) -> Iterator[tuple[str, str, str]]:
        return iter(self.store.bindings())

    def get_exchanges(self) -> list[str]:
        return self.store.exchanges()

    def get_table(self, exchange: str) -> list[tuple[str, None, str]]:
        return [(key, None, queue) for queue, _, key in self.store.bindings(exchange)]

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        with self.store.lock:
            kind = self.store.exchange_type(exchange)
        return self.exchange_types[kind or default]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        with self.store.lock:
            return self.store.route(exchange, routing_key, None)
