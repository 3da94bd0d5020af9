"""Heartbeats, database timeouts and cluster URLs (README: Running in production).

The network faults themselves (silent cuts between test hosts) are in
test_hosts.py and test_cluster.py; these tests pin what one container on the
machine's services must do: keep a connection alive however long a handler
runs, count a transaction left idle past ``database_timeout`` as a failed
delivery, fail over between the URLs of ``broker_url`` with every password
masked, and warn about a classic backout queue behind a quorum queue.
"""

from __future__ import annotations

import threading
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import amqp
import pytest
from amqp import spec
from amqp.method_framing import frame_writer

from mdbcontainer.errors import SettingsError
from mdbcontainer.settings import mask_url, settings_from_dict
from mdbcontainer.testing import headers_of, wait_for, write_settings
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publisher
from tests.conftest import RABBITMQ_URL, Backend, mdb_here


def test_heartbeat_is_whole_seconds_rounded_up_and_zero_turns_it_off() -> None:
    def heartbeat(value: str) -> float:
        settings = settings_from_dict({"container": {"heartbeat": value}})
        return settings.container.heartbeat.total_seconds()

    assert settings_from_dict({}).container.heartbeat.total_seconds() == 30
    assert settings_from_dict({}).container.database_timeout.total_seconds() == 30
    assert heartbeat("1500ms") == 2
    assert heartbeat("0s") == 0
    with pytest.raises(SettingsError, match=r"container.database_timeout: must be at least '1s'"):
        settings_from_dict({"container": {"database_timeout": "500ms"}})


def test_several_broker_urls_name_one_cluster_and_every_password_is_masked() -> None:
    urls = "amqp://app:first-secret@h1:5672//;amqp://app:second-secret@h2:5672//"
    assert settings_from_dict({"container": {"broker_url": urls}}).container.broker_url == urls
    masked = mask_url(urls)
    assert "secret" not in masked and masked.count("app:***@") == 2
    with pytest.raises(SettingsError, match=r"container.broker_url: several URLs .* embedded://"):
        settings_from_dict({"container": {"broker_url": "amqp://h1//;embedded://x.db"}})


@pytest.mark.rabbitmq
def test_an_idle_publisher_keeps_its_connection_through_heartbeats() -> None:
    """Nobody publishes for three heartbeats: the connection is still the same one after.

    The broker closes a connection that negotiated heartbeats and sends none
    for two of them; the publisher's heartbeat thread sends them (and reads the
    broker's) while its owner is idle.
    """
    queue = f"hb-{time.monotonic_ns()}"  # named in the settings: only such queues are declared
    settings = settings_from_dict({"container": {"broker_url": RABBITMQ_URL, "heartbeat": "1s"},
                                   "queues": {queue: {}}})
    publisher = Publisher(Broker(settings), heartbeat=True)
    try:
        channel = publisher.channel
        assert publisher._conn is not None and publisher._conn.connection.heartbeat == 1
        time.sleep(3.5)
        exchange, key, mandatory = publisher.route(queue)
        publisher.publish(exchange=exchange, routing_key=key, body=b"{}", properties={},
                          mandatory=mandatory)
        assert publisher.channel is channel, "the publisher had to reconnect"
        channel.queue_delete(queue=queue)
    finally:
        publisher.close()


@pytest.mark.slow
@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_handler_longer_than_two_heartbeats_keeps_its_connection(rabbit: Backend) -> None:
    """heartbeat = 1s, a handler sleeping 3.5s, no dedup: handled once, no reconnection."""
    queue = rabbit.q("SLOW")
    settings = rabbit.write(ports={"Work": {"destination": queue, "transaction": "none"}},
                            heartbeat="1s")
    with rabbit.container(settings) as container, rabbit.producer(settings) as producer:
        producer.send(queue, {"action": "sleep", "seconds": 3.5}, message_id="slow-1")
        producer.send(queue, {"action": "ok"}, message_id="after-1")
        wait_for(lambda: len(rabbit.attempts()) >= 2, 20, what="both messages handled")
        time.sleep(2.5)  # time for a redelivery, had the connection been closed under the handler
        assert [a[1] for a in rabbit.attempts()] == ["slow-1", "after-1"], rabbit.attempts()
        assert rabbit.probe(settings).count(queue) == 0
        output = container.output()
    assert "unavailable" not in output and "heartbeat" not in output, output


@pytest.mark.slow
@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_a_transaction_left_idle_past_database_timeout_is_a_failed_delivery(rabbit: Backend) -> None:
    """The server ends the session (SQLSTATE 25P03): counted and backed out, never retried for ever."""
    queue = rabbit.q("IDLE")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 5}},
        queues={queue: {"backout_threshold": 2}},
        database_timeout="1s",
    )
    with rabbit.container(settings), rabbit.producer(settings) as producer:
        producer.send(queue, {"action": "sleep", "seconds": 2}, message_id="idle-1")
        probe = rabbit.probe(settings)
        wait_for(lambda: probe.count(rabbit.q("DLQ")) == 1, 30, what="the backout")
    [moved] = probe.take_all(rabbit.q("DLQ"))
    assert headers_of(moved)["x-mdb-redelivery-count"] == 2
    assert "idle-in-transaction" in headers_of(moved)["x-mdb-exception"]
    assert [a[1] for a in rabbit.attempts()] == ["idle-1", "idle-1"]
    assert rabbit.effects() == {}


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_the_container_fails_over_to_the_next_url(rabbit: Backend) -> None:
    """The first node refuses; the container consumes from the second, and logs no password."""
    queue = rabbit.q("FAILOVER")
    dead = "amqp://guest:dead-node-secret@127.0.0.1:1//"
    settings = rabbit.write(ports={"Work": {"destination": queue}},
                            broker_url=f"{dead};{RABBITMQ_URL}")
    with rabbit.container(settings) as container, rabbit.producer(settings) as producer:
        producer.send(queue, {"action": "ok", "n": 1}, message_id="fo-1")
        wait_for(lambda: rabbit.effects() == {"fo-1": 1}, 20, what="the message applied")
        output = container.output()
    assert "failed over to amqp://guest:***@127.0.0.1:5672//" in output, output
    assert "dead-node-secret" not in output


def test_check_warns_when_a_quorum_queue_backs_out_to_a_classic_queue(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "s.toml", {
        "container": {"listeners": ["tests.apps.work"], "database_url": f"sqlite:///{tmp_path}/d",
                      "dead_letter_queue": "DLQ"},
        "queues": {"WORK": {"quorum": True}},
        "ports": {"Work": {"destination": "WORK", "max_retries": 5}},
    })
    result = mdb_here("check", settings=path)
    assert result.returncode == 0, result.stderr
    assert "quorum queue 'WORK' backs out to 'DLQ', a classic queue" in result.stderr
    path.write_text(path.read_text() + '\n[queues.DLQ]\nquorum = true\n')
    result = mdb_here("check", settings=path)
    assert result.returncode == 0, result.stderr
    assert "classic queue" not in result.stderr


def test_a_queue_on_a_node_that_is_down_is_an_outage_not_a_refusal() -> None:
    """RabbitMQ's words are all there is to tell a node that is down from a wrong request."""
    from amqp.exceptions import NotFound, PreconditionFailed

    from mdbcontainer.wire.connection import node_down

    down = NotFound("NOT_FOUND - home node 'rabbit@mq2' of durable queue 'Q' in vhost '/' is down "
                    "or inaccessible", (50, 10), "Queue.declare")
    missing = NotFound("NOT_FOUND - no queue 'Q' in vhost '/'", (50, 10), "Queue.declare")
    refused = PreconditionFailed("PRECONDITION_FAILED - inequivalent arg 'x-consumer-timeout'",
                                 (50, 10), "Queue.declare")
    assert node_down(down)
    assert not node_down(missing) and not node_down(refused)


def test_the_installed_py_amqp_serializes_frame_writes_from_several_threads() -> None:
    """The heartbeat thread writes while the consumer acknowledges or publishes, outside the lock.

    That is safe only because py-amqp's frame writer takes a lock of its own
    (5.4.2 and later; 5.3 shares one buffer unlocked): pyproject.toml requires
    it, and the installed one must have it.
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    [wanted] = [Requirement(r) for r in pyproject["project"]["dependencies"]
                if Requirement(r).name == "amqp"]
    assert not wanted.specifier.contains(Version("5.3.1")), wanted
    assert wanted.specifier.contains(amqp.__version__), amqp.__version__

    inside = 0
    most = 0
    count = threading.Lock()

    def write(_data: bytes) -> None:
        nonlocal inside, most
        with count:
            inside += 1
            most = max(most, inside)
        time.sleep(0.005)
        with count:
            inside -= 1

    connection = SimpleNamespace(frame_max=131072, bytes_sent=0)
    write_frame = frame_writer(connection, SimpleNamespace(write=write))

    def acks() -> None:
        for tag in range(10):
            write_frame(1, 1, spec.Basic.Ack, tag.to_bytes(8, "big") + b"\0", None)

    threads = [threading.Thread(target=acks) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert connection.bytes_sent == 40
    assert most == 1, "two threads wrote frames at once"
