"""A RabbitMQ cluster losing the node that leads the work queue (README: Running in production).

Three nodes started by the test (tests/chaos/cluster.py), the container
connected with ``broker_url`` naming all three separated by ``;``, quorum
queues for the work, the backout queue and a durable subscription. Under
load, the node leading the work queue is killed with SIGKILL: the container
fails over to another node, nothing is lost, nothing is applied twice, and the
durable subscription and the backout queue keep working. A classic queue that
lived on the dead node cannot be declared until the node is back: its port
waits that out as an outage (it used to stop for good), and consumes
again once the node has been restarted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import kombu
import pytest

from mdbcontainer.errors import PublishError
from mdbcontainer.sending.producer import Producer
from mdbcontainer.testing import headers_of, wait_for
from tests.chaos.cluster import Cluster, available
from tests.conftest import Backend

# Three Erlang VMs boot and join first (half a minute or more on two busy cores).
# One xdist group with the other tests that build hosts or nodes: one at a time on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.timeout(300),
              pytest.mark.xdist_group("hosts")]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    why = available()
    if why:
        if os.environ.get("MDB_REQUIRE_SERVICES"):
            pytest.fail(why)
        pytest.skip(why)
    nodes = Cluster()
    try:
        yield nodes.start()
    finally:
        nodes.remove()


def send(producer: Producer, destination: str, ids: list[str], action: str = "ok",
         patience: float = 0.0) -> None:
    """Publish ``ids`` with confirms; for ``patience`` seconds a nacked one is published again.

    Right after its leader dies a quorum queue has none for a moment and the
    broker nacks what it cannot enqueue: a producer sends it again, as this one
    does (seen once in CI: the first send after the kill nacked).
    """
    for message_id in ids:
        deadline = time.monotonic() + patience
        while True:
            try:
                producer.send(destination, {"action": action, "seconds": 0.01}, message_id=message_id)
                break
            except PublishError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def test_the_container_fails_over_when_the_queue_leader_is_killed(
        rabbit: Backend, cluster: Cluster) -> None:
    work, dlq, topic, classic = "WORK", "DLQ", "EVENTS", "CLASSIC"
    subscription = "cluster-client.sub"
    settings = rabbit.write(
        ports={
            "Work": {"destination": work, "max_retries": 10, "prefetch": 20},
            "Downstream": {"topic": topic, "client_id": "cluster-client", "subscription": "sub",
                           "durable": True, "max_retries": 10},
            "Bean": {"destination": classic, "max_retries": 10, "prefetch": 1},
        },
        queues={work: {"quorum": True, "backout_threshold": 2}, dlq: {"quorum": True},
                subscription: {"quorum": True}},
        topics={topic: {}},
        broker_url=cluster.broker_url, dead_letter_queue=dlq, heartbeat="2s",
    )
    # Declared through node 1 first: it leads the quorum queues and holds the classic one.
    with kombu.Connection(cluster.nodes[0].url) as conn:
        channel = conn.channel()
        for queue in (work, dlq):
            channel.queue_declare(queue=queue, durable=True, auto_delete=False,
                                  arguments={"x-queue-type": "quorum"})
        channel.queue_declare(queue=classic, durable=True, auto_delete=False)
    before = [f"w-{i}" for i in range(300)]
    classic_ids = [f"c-{i}" for i in range(8)]  # 1.5s each, one at a time: some wait on the node
    events = [f"e-{i}" for i in range(40)]
    after = [f"w-{i}" for i in range(300, 340)]
    with rabbit.container(settings) as container:
        with rabbit.producer(settings) as producer:
            send(producer, work, before, action="sleep")
            send(producer, topic, events[:20])
            for message_id in classic_ids:
                producer.send(classic, {"action": "sleep", "seconds": 1.5}, message_id=message_id)
        wait_for(lambda: len(rabbit.effects("Work")) >= 60, 30, what="the work under way")
        leader = cluster.leader(work)
        assert leader is cluster.nodes[0]
        cluster.kill(leader)
        killed_at = time.time()
        assert len(rabbit.effects("Bean")) < len(classic_ids), "the classic queue emptied too soon"
        with rabbit.producer(settings) as producer:  # a new connection: fails over too
            send(producer, work, ["poison"], action="fail", patience=30)
            send(producer, work, after, patience=30)
            send(producer, topic, events[20:], patience=30)
        probe = rabbit.probe(settings)
        wait_for(lambda: len(rabbit.effects("Work")) == len(before) + len(after)
                 and len(rabbit.effects("Downstream")) == len(events)
                 and probe.count(dlq) == 1, 60, interval=0.5, what="every message applied")
        resumed = min(float(line.split("\t")[4]) for line in rabbit.log.read_text().splitlines()
                      if float(line.split("\t")[4]) > killed_at)
        print(f"\nfailover after SIGKILL of {leader.name} (leader of {work}): next handler call "
              f"{resumed - killed_at:.1f}s later")
        assert len(rabbit.effects("Bean")) < len(classic_ids), "consumed while its node was down"
        time.sleep(3)  # its port retries the declare meanwhile: an outage, not a stop
        assert "home node" in container.output()
        cluster.restart(leader)
        wait_for(lambda: len(rabbit.effects("Bean")) == len(classic_ids), 60, interval=0.5,
                 what="the classic queue consumed once its node is back")
        assert container.alive()
        states = {row["port"]: row["state"] for row in container.rows()}
        output = container.output()
    assert states == {"Work": "started", "Downstream": "started", "Bean": "started"}, (
        states, output[-3000:])
    assert rabbit.effects("Bean") == dict.fromkeys(classic_ids, 1)
    assert rabbit.effects("Work") == dict.fromkeys(before + after, 1)
    assert rabbit.effects("Downstream") == dict.fromkeys(events, 1)
    [moved] = probe.take_all(dlq)
    assert moved.properties["message_id"] == "poison"
    assert headers_of(moved)["x-mdb-redelivery-count"] == 2
    assert "consumer error" not in output and "maximum retries" not in output, output[-3000:]
