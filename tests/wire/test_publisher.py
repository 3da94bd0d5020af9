"""The publisher's confirm window and returns: every tag confirmed, each return blamed on its send.

RabbitMQ confirms a publish that no queue takes (a topic nobody subscribes to)
at once, and a persistent one on a quorum queue only once the queue has it:
the acks arrive out of publish order, some ``multiple``. ``publish_many``
returns only when every one of its tags is settled, and a returned message is
attributed to the send it came from by publish order, even when two sends of
one unit of work share a message id.
"""

from __future__ import annotations

from typing import Any

import pytest

from mdbcontainer.errors import Unroutable
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publish, Publisher, _ConfirmWindow
from tests.conftest import Backend

# -- the window alone --------------------------------------------------------------------------


class _Scripted:
    """A channel whose every wait hands the window the next confirm of a script, as py-amqp would."""

    def __init__(self, window: _ConfirmWindow, script: list[tuple[int, bool, bool]]) -> None:
        self.window = window
        self.script = list(script)

    def wait(self, _methods: Any, timeout: float | None = None) -> None:
        assert self.script, "await_all waits for a confirm the broker will never send"
        tag, multiple, ack = self.script.pop(0)
        (self.window.acked if ack else self.window.nacked)(tag, multiple)


def _settle(published: int, script: list[tuple[int, bool, bool]]) -> tuple[_ConfirmWindow, list[Any]]:
    """A window with ``published`` tags in flight, awaited over ``script``; the confirms left over."""
    window = _ConfirmWindow()
    for _ in range(published):
        window.sent()
    channel = _Scripted(window, script)
    window.await_all(channel)
    return window, channel.script


def test_await_all_waits_for_earlier_tags_after_a_later_one_is_acked() -> None:
    _window, left = _settle(3, [(3, False, True), (1, False, True), (2, False, True)])
    assert left == [], "an ack of tag 3 alone leaves 1 and 2 unconfirmed: await_all waits for them"


def test_a_multiple_ack_settles_every_tag_up_to_it_and_no_later_one() -> None:
    _window, left = _settle(5, [(5, False, True), (3, True, True), (4, False, True)])
    assert left == [], "5 alone, then 1-3 together: 4 is still to come"
    _window, left = _settle(3, [(3, True, True), (3, False, True)])
    assert left == [(3, False, True)], "one multiple ack of the highest tag settles all three"


def test_a_nack_names_exactly_the_tags_it_covers() -> None:
    window, left = _settle(6, [(2, False, True), (4, True, False), (6, False, False), (5, False, True)])
    assert left == []
    assert window.nacks_since(1) == [1, 3, 4, 6], "multiple nack of 4 covers 1, 3, 4, not the acked 2"


# -- against RabbitMQ ----------------------------------------------------------------------------


class _Confirms:
    """Every confirm the channel received, in arrival order: (tag, multiple, ack)."""

    def __init__(self, channel: Any) -> None:
        self.seen: list[tuple[int, bool, bool]] = []
        channel.events["basic_ack"].add(lambda tag, multiple: self.seen.append((tag, multiple, True)))
        channel.events["basic_nack"].add(lambda tag, multiple: self.seen.append((tag, multiple, False)))

    def settled(self) -> set[int]:
        done: set[int] = set()
        for tag, multiple, _ack in self.seen:
            done.update(range(1, tag + 1) if multiple else (tag,))
        return done


@pytest.mark.rabbitmq
def test_publish_many_returns_only_when_every_tag_is_confirmed_not_the_highest(rabbit: Backend) -> None:
    """Persistent sends to a quorum queue, then a topic publish nobody subscribes to: the topic's
    ack (the highest tag) comes first; every earlier tag must still be confirmed before the return."""
    queue, topic = rabbit.q("QUORUM"), f"events.{rabbit.tag}"
    settings = rabbit.write(ports={"Work": {"destination": queue}},
                            queues={queue: {"quorum": True}}, topics={topic: {}})
    publisher = Publisher(Broker(rabbit.settings(settings)))
    try:
        to_queue = publisher.route(queue)
        to_topic = publisher.route(topic)
        confirms = _Confirms(publisher.channel)
        for round_ in range(5):
            items = [Publish(*to_queue[:2], b'{"n": 1}', {"message_id": f"q-{round_}-{i}",
                                                          "delivery_mode": 2}, to_queue[2])
                     for i in range(40)]
            items.append(Publish(*to_topic[:2], b"{}", {"message_id": f"t-{round_}"}, to_topic[2]))
            assert publisher.publish_many(items) == [None] * len(items)
            published = publisher._window.published
            unconfirmed = set(range(1, published + 1)) - confirms.settled()
            assert not unconfirmed, (f"round {round_}: publish_many returned with tags {sorted(unconfirmed)} "
                                     f"unconfirmed (confirms in arrival order: {confirms.seen[-5:]})")
    finally:
        publisher.close()
    assert rabbit.probe(settings).count(queue) == 200


@pytest.mark.rabbitmq
def test_a_returned_send_is_blamed_on_itself_when_two_sends_share_a_message_id(rabbit: Backend) -> None:
    """One unit of work sends one message id twice: to a queue that takes it, and to one deleted since
    the publisher declared it (returned). Only the second is unroutable, whichever comes first."""
    kept, gone = rabbit.q("KEPT"), rabbit.q("GONE")
    settings = rabbit.write(ports={"Work": {"destination": kept}})
    publisher = Publisher(Broker(rabbit.settings(settings)))
    try:
        routes = {name: publisher.route(name) for name in (kept, gone)}
        publisher.channel.queue_delete(queue=gone)

        def send(name: str) -> Publish:
            exchange, routing_key, mandatory = routes[name]
            return Publish(exchange, routing_key, b'{"n": 1}', {"message_id": "shared"}, mandatory)

        first = publisher.publish_many([send(gone), send(kept)])
        publisher.route(gone)  # declared again after the return
        publisher.channel.queue_delete(queue=gone)
        second = publisher.publish_many([send(kept), send(gone)])
    finally:
        publisher.close()
    assert [type(e) for e in first] == [Unroutable, type(None)], first
    assert [type(e) for e in second] == [type(None), Unroutable], second
    assert rabbit.probe(settings).count(kept) == 2
