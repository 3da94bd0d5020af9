"""A delivery as the seam hands it over (``wire.delivery``), on both brokers, in the test's process.

Messages held without acknowledgment go back in their order when the channel
closes, and only the one removed leaves; a copy for another queue keeps body,
id and properties but never the expiration, so a message kept for a person
does not vanish from a backout queue.
"""

from __future__ import annotations

from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publisher
from mdbcontainer.wire.queues import QueueSession
from tests.conftest import Backend


def _queue_with(backend: Backend, ids: list[str], **properties: object) -> tuple[Broker, str]:
    queue = backend.q("Q")
    broker = Broker(backend.settings(backend.write(ports={}, queues={queue: {}})))
    with Publisher(broker) as publisher:
        exchange, key, mandatory = publisher.route(queue)
        for mid in ids:
            publisher.publish(exchange=exchange, routing_key=key, body=mid.encode(), mandatory=mandatory,
                              properties={"message_id": mid, "content_type": "text/plain", **properties})
    return broker, queue


def test_held_messages_go_back_in_their_order_but_the_one_removed(backend: Backend) -> None:
    broker, queue = _queue_with(backend, ["m-1", "m-2", "m-3"])
    with QueueSession(broker) as session:
        held = session.hold(queue)
        taken = held.take_all()
        assert [d.message_id for d in taken] == ["m-1", "m-2", "m-3"]
        held.remove(taken[1])
    with QueueSession(broker) as session:
        assert [d.message_id for d in session.take(queue)] == ["m-1", "m-3"]


def test_a_copy_keeps_body_id_and_properties_and_drops_the_expiration(backend: Backend) -> None:
    broker, queue = _queue_with(backend, ["m-1"], expiration="600000", priority=7, correlation_id="c-9",
                                headers={"app": "kept"})
    with QueueSession(broker) as session:
        [delivery] = session.hold(queue).take_all()
        copy = delivery.copy_to("ELSEWHERE", {"x-extra": 1})
        replaced = delivery.copy_to("ELSEWHERE", {"only": 1}, replace=True)
    assert (copy.destination, copy.body) == ("ELSEWHERE", b"m-1")
    assert {k: copy.properties[k] for k in ("message_id", "priority", "correlation_id", "content_type")} == {
        "message_id": "m-1", "priority": 7, "correlation_id": "c-9", "content_type": "text/plain"}
    assert "expiration" not in copy.properties
    assert copy.properties["headers"]["app"] == "kept" and copy.properties["headers"]["x-extra"] == 1
    assert replaced.properties["headers"] == {"only": 1}
