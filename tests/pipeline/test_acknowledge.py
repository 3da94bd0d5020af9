"""Acknowledgment modes (``pipeline.acknowledge``) in the test's process, on the embedded broker.

``client``: the broker hears only what the handler acknowledged, and what is
unacknowledged when the port stops goes back to the queue without counting
as a failure. ``dups_ok``: acknowledgments are lazy but flushed at the stop,
so nothing handled comes back. A once-only port backs out a message it cannot
identify before its handler sees it, and leaves no handled message unacknowledged
while it waits for the next (its acknowledgments coalesce); when its channel goes,
deliveries that still arrive are left to the broker's requeue, not run, so no
coalesced acknowledgment covers a delivery whose outcome never reached the broker.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from mdbcontainer.state.counts import Attempt, DeliveryCounter
from mdbcontainer.testing import wait_for
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.headers import BACKOUT_REASON, REASON_MISSING_ID
from mdbcontainer.wire.publisher import Publisher
from tests.apps import inproc
from tests.conftest import Backend, rabbitmqctl
from tests.inprocess import attempts, effects_in, running_on, send


def test_client_mode_acknowledges_what_the_handler_acknowledged_and_hands_the_rest_back_uncounted(
        embedded: Backend) -> None:
    with running_on(embedded, transaction="none", port_keys={"acknowledge": "client"}) as run:
        send(embedded, run, "acked", acknowledge=True)
        wait_for(lambda: run.port.stats.handled == 1, what="the acknowledged message handled")
        send(embedded, run, "kept", n=1)  # handled, never acknowledged
        wait_for(lambda: run.port.stats.handled == 2, what="the second message handled")
        assert embedded.probe(run.settings).count(run.queue) == 0, "held by its consumer meanwhile"
        counter: DeliveryCounter = run.port.counter
    assert embedded.probe(run.settings).count(run.queue) == 1, "back on its queue at the stop"
    assert counter.open(run.queue, "kept") == Attempt(0, None), "a hand-back is no failure"
    assert attempts("acked") == [0] and attempts("kept") == [0]


def test_dups_ok_flushes_its_lazy_acknowledgments_at_the_stop(embedded: Backend) -> None:
    with running_on(embedded, transaction="none", port_keys={"acknowledge": "dups_ok"}) as run:
        for i in range(3):  # fewer than its batch: acknowledged by the clock or at the stop
            send(embedded, run, f"lazy-{i}", n=i)
        wait_for(lambda: run.port.stats.handled == 3, what="the three handled")
    assert embedded.probe(run.settings).count(run.queue) == 0, "nothing handled comes back"
    assert [attempts(f"lazy-{i}") for i in range(3)] == [[0], [0], [0]]


def test_a_once_only_port_backs_out_a_message_without_an_id_before_its_handler(embedded: Backend) -> None:
    with running_on(embedded, transaction="container") as run:
        with Publisher(Broker(embedded.settings(run.settings))) as publisher:
            publisher.publish(exchange="", routing_key=run.queue, body=b'{"n": 1}', mandatory=True,
                              properties={"content_type": "application/json"})
        wait_for(lambda: run.port.stats.backed_out == 1, what="the message backed out")
        [moved] = embedded.probe(run.settings).take_all(embedded.q("DLQ"))
    assert moved.headers[BACKOUT_REASON] == REASON_MISSING_ID
    assert json.loads(moved.body) == {"n": 1}
    assert run.port.stats.handled == 0 and effects_in(embedded, "") == 0


def unsettled(queue: str) -> int:
    """Messages of ``queue`` ready or delivered and not yet acknowledged (``rabbitmqctl list_queues``)."""
    out = rabbitmqctl("list_queues", "name", "messages", "--quiet", "--no-table-headers", timeout=30)
    rows = [line.split("\t") for line in out.splitlines() if "\t" in line]
    return sum(int(row[1]) for row in rows if row[0] == queue)


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_once_only_port_acknowledges_every_handled_message_before_it_waits_for_more(
        rabbit: Backend) -> None:
    """Its acknowledgments of deliveries that came together leave together (one ``basic.ack``
    with ``multiple``), but none stays owed while the port waits for the next delivery."""
    # Bean-managed: once-only, and the handler of tests/apps/inproc.py writes no row (the business
    # tables of a PostgreSQL backend live in its schema, which this process's handler does not name).
    with running_on(rabbit, transaction="bean", port_keys={"prefetch": 20}) as run:
        with rabbit.producer(run.settings) as producer:
            for n in range(4):  # fewer than a run of acknowledgments (half the prefetch)
                producer.send(run.queue, {"n": n}, message_id=f"together-{n}")
        wait_for(lambda: run.port.stats.handled == 4, what="the four handled")
        wait_for(lambda: unsettled(run.queue) == 0, 20, interval=0.3, what="all four acknowledged")
        assert run.port.stats.failed == 0 and attempts("together-3") == [0]


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_delivery_whose_wait_copy_was_cut_off_comes_back_though_later_ones_were_handled(
        rabbit: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker closes the port's publisher connection as a failed message's copy leaves to wait
    (the chaos run's broker fault): the copy is not sent and the consumer's channel closes. The
    deliveries behind it that arrive meanwhile must not be run there: their coalesced
    acknowledgment (``basic.ack`` with ``multiple``) would take the failed one with it, and the
    message would be on no queue at all."""
    original = Publisher._publish
    cut: list[int] = []

    def cut_off(self: Publisher, **publish: Any) -> None:
        if ".wait." in publish["routing_key"] and not cut:
            time.sleep(0.3)  # the deliveries behind it are in the consumer's socket by now
            cut.append(self._conn.connection.sock.getsockname()[1])  # type: ignore[union-attr]
            rabbitmqctl("eval", "[rabbit_networking:close_connection(proplists:get_value(pid, I), "
                        "\"test\") || I <- rabbit_networking:connection_info_all([pid, peer_port]), "
                        f"proplists:get_value(peer_port, I) =:= {cut[0]}].")
        original(self, **publish)

    monkeypatch.setattr(Publisher, "_publish", cut_off)
    inproc.FAIL_FIRST["cut-poison"] = 100
    keys = {"backout_threshold": 2, "redelivery_delay": "100ms"}
    with running_on(rabbit, transaction="bean", port_keys={"prefetch": 20}, **keys) as run:
        rabbit.queues.update({f"{run.queue}.wait.100ms"})  # removed with the test's queues
        with rabbit.producer(run.settings) as producer:
            producer.send(run.queue, {"n": 0}, message_id="cut-poison")
            for n in range(1, 9):
                producer.send(run.queue, {"n": n}, message_id=f"cut-{n}")
        wait_for(lambda: run.port.stats.backed_out == 1, what="the failing message backed out")
        wait_for(lambda: run.port.stats.handled == 8, what="the eight behind it handled")
    assert cut, "the publisher's connection was closed under the copy"
    [moved] = rabbit.probe(run.settings).take_all(rabbit.q("DLQ"))
    assert moved.properties["message_id"] == "cut-poison"
    assert [len(attempts(f"cut-{n}")) for n in range(1, 9)] == [1] * 8
