"""Backout queues for people (``operations.dlq``), in process on both brokers: browse, replay, purge.

Browsing leaves every message in its place. A replay resets the message's
durable count, sends a copy back without the container's headers, and only
then removes the original; a message a handler moved (``ctx.move_to``) has its
dedup row forgotten so the replay reaches the handler, one the container
backed out keeps it. What is not selected stays where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from mdbcontainer.errors import DlqError
from mdbcontainer.operations import dlq
from mdbcontainer.pipeline.backout import backout_headers
from mdbcontainer.settings import Settings
from mdbcontainer.state.counts import DeliveryCounter
from mdbcontainer.state.dedup import Dedup
from mdbcontainer.state.store import Store
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.headers import PREFIX, REASON_INVALID, REASON_THRESHOLD
from mdbcontainer.wire.publisher import Publisher
from mdbcontainer.wire.queues import QueueSession
from tests.conftest import Backend


@dataclass
class Dlq:
    settings: Settings
    broker: Broker
    queue: str  # the port's queue the messages failed on
    dlq: str

    def back_out(self, message_id: str, reason: str = REASON_THRESHOLD, body: bytes = b'{"n": 1}',
                 **headers: Any) -> None:
        """Put a message on the backout queue as the pipeline moves one there."""
        failure = backout_headers({"app": "kept", **headers}, reason=reason, destination=self.queue,
                                  port="Orders", count=5, exception="ValueError: boom")
        with Publisher(self.broker) as publisher:
            publisher.publish(exchange="", routing_key=self.dlq, body=body, mandatory=True, properties={
                "message_id": message_id, "content_type": "application/json", "headers": failure})

    def taken(self, queue: str) -> list[Any]:
        with QueueSession(self.broker) as session:
            return session.take(queue)

    def depth(self, queue: str) -> int:
        with QueueSession(self.broker) as session:
            return session.status(queue).messages


@pytest.fixture
def setup(backend: Backend) -> Dlq:
    queue = backend.q("ORDERS")
    settings = backend.settings(backend.write(ports={}, queues={queue: {}}))
    broker = Broker(settings)
    with QueueSession(broker) as session:
        session.declare(queue)
        session.declare(settings.container.dead_letter_queue)
    return Dlq(settings, broker, queue, settings.container.dead_letter_queue)


def test_browsing_a_backout_queue_shows_each_failure_and_leaves_every_message(setup: Dlq) -> None:
    for mid in ("m-1", "m-2", "m-3"):
        setup.back_out(mid)
    first = dlq.browse(setup.settings)
    assert [d.id for d in first] == ["m-1", "m-2", "m-3"], "in queue order"
    assert [d.id for d in dlq.browse(setup.settings)] == ["m-1", "m-2", "m-3"], "all stay"
    assert setup.depth(setup.dlq) == 3
    shown = first[0].to_json()
    assert (shown["original_destination"], shown["port"], shown["reason"], shown["redelivery_count"]) == (
        setup.queue, "Orders", REASON_THRESHOLD, 5)
    assert first[0].summary() == "ValueError: boom"
    page, total = dlq.browse_page(setup.settings, limit=2)
    assert ([d.id for d in page], total) == (["m-1", "m-2"], 3)


def test_a_replay_sends_back_the_message_as_it_was_sent_and_its_count_starts_again(
        setup: Dlq, store: Store) -> None:
    counter = DeliveryCounter(store)
    for _ in range(5):
        counter.fail(setup.queue, "m-1", "ValueError: boom")
    setup.back_out("m-1")
    setup.back_out("m-2")
    result = dlq.replay(setup.settings, ["m-1", "nope"])
    assert (result.replayed, result.missing, result.problems) == (1, ["nope"], [])
    [back] = setup.taken(setup.queue)
    assert back.message_id == "m-1" and back.body == b'{"n": 1}'
    assert back.headers.get("app") == "kept"
    assert not [k for k in back.headers if k.startswith(PREFIX)], "none of the container's headers"
    assert counter.failures(setup.queue, "m-1") == 0, "a replayed message gets its threshold again"
    assert [d.id for d in dlq.browse(setup.settings)] == ["m-2"], "what was not selected stays"


def test_a_replay_forgets_the_dedup_row_of_a_moved_message_and_keeps_a_backed_out_ones(
        setup: Dlq, store: Store) -> None:
    """``ctx.move_to`` commits (its row with it); a backed-out message never did: a row found is a replay's."""
    dedup = Dedup(store)
    with store.sessions() as session, session.begin():
        dedup.claim_many(session, "Orders", ["moved", "backed-out"])
    setup.back_out("moved", reason="needs-review")
    setup.back_out("backed-out", reason=REASON_THRESHOLD)
    assert dlq.replay(setup.settings, [], replay_all=True).replayed == 2
    assert not dedup.seen("Orders", "moved"), "the handler sees the replayed copy"
    assert dedup.seen("Orders", "backed-out"), "an earlier interrupted replay's copy absorbs this one"
    assert sorted(m.message_id for m in setup.taken(setup.queue)) == ["backed-out", "moved"]


def test_a_replay_to_another_queue_and_of_an_invalid_body_is_said(backend: Backend, setup: Dlq) -> None:
    fixed = backend.q("FIXED")
    with QueueSession(setup.broker) as session:
        session.declare(fixed)
    setup.back_out("bad", reason=REASON_INVALID, body=b"{not json")
    result = dlq.replay(setup.settings, ["bad"], to=fixed)
    assert result.invalid == ["bad"], "back to the same handler it would fail again: the CLI warns"
    assert [m.message_id for m in setup.taken(fixed)] == ["bad"]
    assert setup.depth(setup.queue) == 0


def test_a_message_that_names_no_destination_stays_on_the_backout_queue(setup: Dlq) -> None:
    with Publisher(setup.broker) as publisher:
        publisher.publish(exchange="", routing_key=setup.dlq, body=b"{}", mandatory=True,
                          properties={"message_id": "nowhere", "content_type": "application/json"})
    result = dlq.replay(setup.settings, ["nowhere"])
    assert result.replayed == 0
    assert result.problems == [f"message 'nowhere' on {setup.dlq} has no x-mdb-original-destination header: use --to"]
    assert setup.depth(setup.dlq) == 1


def test_a_purge_empties_the_backout_queue_and_finding_a_message_gone_is_a_dlq_error(setup: Dlq) -> None:
    setup.back_out("m-1")
    setup.back_out("m-2")
    [found] = dlq.find(setup.settings, "m-2")
    assert found.id == "m-2" and found.queue == setup.dlq
    assert dlq.purge(setup.settings) == (setup.dlq, 2)
    with pytest.raises(DlqError, match="message 'm-2' not found"):
        dlq.find(setup.settings, "m-2")
