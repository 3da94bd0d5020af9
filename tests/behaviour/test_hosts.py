"""Containers on other hosts, behind links that go silent (README: Running in production).

A container runs on a test host (a network namespace, see tests/chaos/hosts.py)
and holds prefetched deliveries, one of them in its handler with its dedup
claim uncommitted, when its link goes silent: no FIN, no RST, packets vanish.
With ``heartbeat = 2s`` and ``database_timeout = 4s``:

- the broker finds the container's connection dead after two to three
  heartbeats without a frame (6s at most) and requeues what it held;
- PostgreSQL ends the container's session once it has been idle in its
  transaction for ``database_timeout`` (4s), which releases the dedup claim
  that a container on the host waits for;

so a container on the host has the held deliveries within 3 * heartbeat
(the larger of the two bounds), and every one of them applied, once. When the
link returns, the cut-off container reconnects by itself. The partitions of
the database alone and of the broker alone are here too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from mdbcontainer.testing import ContainerProcess, wait_for
from tests.chaos.hosts import TestHost, available
from tests.conftest import Backend

# One xdist group with the other tests that build hosts or nodes: one at a time on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.postgres, pytest.mark.xdist_group("hosts")]

HEARTBEAT = 2
DATABASE_TIMEOUT = 4
# The broker's detection of a silent peer: two heartbeats without a frame, checked once a heartbeat.
BROKER_BOUND = 3 * HEARTBEAT
SLACK = 3.0  # a container's start-up, its reconnect backoff, the control row's refresh


@pytest.fixture
def host() -> Iterator[TestHost]:
    why = available()
    if why:
        if os.environ.get("MDB_REQUIRE_SERVICES"):
            pytest.fail(why)
        pytest.skip(why)
    test_host = TestHost().create()
    try:
        yield test_host
    finally:
        test_host.remove()


def settings_pair(rabbit: Backend, host: TestHost, queue: str) -> tuple[Path, Path]:
    """The same container settings on the test host (through its links) and on this machine."""
    common = {
        "ports": {"Work": {"destination": queue, "prefetch": 10, "max_retries": 10}},
        "heartbeat": f"{HEARTBEAT}s",
        "database_timeout": f"{DATABASE_TIMEOUT}s",
    }
    remote = rabbit.write(
        "remote.toml", **common,
        broker_url=f"amqp://guest:guest@{host.address('broker')}:5672//",
        database_url=f"postgresql+psycopg://postgres@{host.address('database')}:5432/test",
    )
    return remote, rabbit.write("local.toml", **common)


def send_held(rabbit: Backend, settings: Path, queue: str, count: int) -> list[str]:
    """Messages whose handler takes a second: the remote container prefetches them all."""
    ids = [f"held-{i}" for i in range(count)]
    with rabbit.producer(settings) as producer:
        for i, message_id in enumerate(ids):
            producer.send(queue, {"action": "sleep", "seconds": 1, "n": i}, message_id=message_id)
    return ids


def settled(container: ContainerProcess) -> int:
    """Deliveries the container has settled: handled, or found applied already."""
    row = container.port_state("Work") or {}
    return int(row.get("handled", 0)) + int(row.get("duplicate_skipped", 0))


def first_log_time(container: ContainerProcess, text: str) -> float:
    """When ``text`` first appeared in the container's log (epoch seconds)."""
    line = wait_for(lambda: next((line for line in container.output().splitlines() if text in line),
                                 None), 20, what=f"{text!r} in the log")
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def recovers(rabbit: Backend, settings: Path, queue: str, container: ContainerProcess) -> None:
    """The cut-off container consumes again, on its own, once its links are back."""
    container.wait_started(30)
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"action": "ok", "n": 100}, message_id="after-heal")
    wait_for(lambda: rabbit.effects().get("after-heal") == 1, 20, what="the cut-off container to consume")


def applied_once(rabbit: Backend, ids: list[str]) -> None:
    effects = rabbit.effects()
    assert {mid: effects.get(mid) for mid in ids} == dict.fromkeys(ids, 1), effects
    assert max(effects.values()) == 1, effects


def test_a_silent_cut_hands_the_held_deliveries_to_a_container_on_the_host(
        rabbit: Backend, host: TestHost) -> None:
    queue = rabbit.q("CUT")
    remote_path, local_path = settings_pair(rabbit, host, queue)
    with rabbit.container(remote_path, prefix=host.prefix) as remote:
        ids = send_held(rabbit, local_path, queue, 5)
        wait_for(rabbit.attempts, 15, what="the first delivery in its handler")
        host.cut()
        cut_at = time.time()
        with rabbit.container(local_path) as local:
            wait_for(lambda: settled(local) >= len(ids), BROKER_BOUND + len(ids) + SLACK,
                     what="the held deliveries taken over")
            done_at = time.time()
            first = min(t for mid in ids for t in rabbit.attempt_times(mid) if t > cut_at)
            print(f"\ntakeover after a silent cut: first held delivery in a handler on the "
                  f"host {first - cut_at:.1f}s after the cut, all {len(ids)} settled after "
                  f"{done_at - cut_at:.1f}s")
            assert first - cut_at <= max(BROKER_BOUND, DATABASE_TIMEOUT) + SLACK
            applied_once(rabbit, ids)
            local.terminate()
        host.heal()
        recovers(rabbit, remote_path, queue, remote)
    applied_once(rabbit, [*ids, "after-heal"])
    assert rabbit.probe(local_path).count(rabbit.q("DLQ")) == 0


def test_a_database_partition_is_an_outage_found_within_database_timeout(
        rabbit: Backend, host: TestHost) -> None:
    """Broker reachable, database silent: the container notices in time and counts nothing."""
    queue = rabbit.q("DBCUT")
    remote_path, local_path = settings_pair(rabbit, host, queue)
    with rabbit.container(remote_path, prefix=host.prefix) as remote:
        ids = send_held(rabbit, local_path, queue, 3)
        wait_for(rabbit.attempts, 15, what="the first delivery in its handler")
        host.cut("database")
        cut_at = time.time()
        noticed = first_log_time(remote, "database unavailable") - cut_at
        print(f"\ndatabase partition noticed after {noticed:.1f}s")
        assert noticed <= DATABASE_TIMEOUT + SLACK
        # Healed once every connection of the cut-off container has failed: one still open
        # would read the server's news that it ended the idle transaction (25P03, counted).
        time.sleep(max(0.0, cut_at + DATABASE_TIMEOUT + 2 - time.time()))
        host.heal()
        wait_for(lambda: all(rabbit.effects().get(mid) for mid in ids), 30,
                 what="the held deliveries applied after the partition")
        recovers(rabbit, remote_path, queue, remote)
        row = remote.port_state("Work") or {}
        assert (row.get("failed"), row.get("backed_out")) == (0, 0), row
    applied_once(rabbit, [*ids, "after-heal"])
    assert {a[3] for a in rabbit.attempts()} == {0}, f"counted: {rabbit.attempts()}"


def test_a_broker_partition_hands_the_held_deliveries_over_once(
        rabbit: Backend, host: TestHost) -> None:
    """Database reachable, broker silent: the work committed remotely is not done twice."""
    queue = rabbit.q("MQCUT")
    remote_path, local_path = settings_pair(rabbit, host, queue)
    with rabbit.container(remote_path, prefix=host.prefix) as remote:
        ids = send_held(rabbit, local_path, queue, 4)
        wait_for(rabbit.attempts, 15, what="the first delivery in its handler")
        host.cut("broker")
        cut_at = time.time()
        with rabbit.container(local_path) as local:
            wait_for(lambda: settled(local) >= len(ids), BROKER_BOUND + len(ids) + SLACK,
                     what="the held deliveries taken over")
            print(f"\nbroker partition: held deliveries settled on the host "
                  f"{time.time() - cut_at:.1f}s after the cut")
            local.terminate()
        host.heal()
        recovers(rabbit, remote_path, queue, remote)
    applied_once(rabbit, [*ids, "after-heal"])
    assert rabbit.probe(local_path).count(rabbit.q("DLQ")) == 0
