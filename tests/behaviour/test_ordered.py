"""Ordered ports (CONTRACT section 16, docs/guides/ordered-ports.md) as a user sees them.

Each key's committed effects must come in publish order and once, with
concurrency across keys, through failures, kills, a closed connection and
partitions shared by several ``mdb run`` processes.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import mdb, wait_for
from tests.conftest import Backend, mdb_here, on_embedded, one_line_error, rabbitmqctl

pytestmark = pytest.mark.slow


def bodies(keys: int, per_key: int, *, seed: int = 7, fail_every: int = 0, sleep: float = 0.0,
           prefix: str = "k") -> list[dict[str, Any]]:
    """``keys`` x ``per_key`` bodies, keys interleaved at random, each key's seq rising."""
    rng = random.Random(seed)
    pending = {f"{prefix}{k}": 0 for k in range(keys)}
    out = []
    while pending:
        key = rng.choice(sorted(pending))
        seq = pending[key]
        body: dict[str, Any] = {"key": key, "seq": seq, "sleep": round(rng.uniform(0, sleep), 4)}
        if fail_every and rng.randrange(fail_every) == 0:
            body["fail_once"] = True
        out.append(body)
        pending[key] += 1
        if pending[key] == per_key:
            del pending[key]
    return out


def publish(backend: Backend, settings: Path, destination: str, items: list[dict[str, Any]],
            *, header: bool = False) -> None:
    with backend.producer(settings) as producer:
        for body in items:
            headers = {"JMSXGroupID": body["key"]} if header else None
            producer.send(destination, body, message_id=f"{body['key']}-{body['seq']}", headers=headers)


def committed(backend: Backend, port: str) -> dict[str, list[int]]:
    """Each key's committed seqs, in commit order (the effects rows' ids)."""
    table = backend.metadata.tables[f"{backend.schema}.effects" if backend.schema else "effects"]
    with backend.engine.connect() as conn:
        rows = conn.execute(table.select().where(table.c.port == port).order_by(table.c.id)).all()
    keys: dict[str, list[int]] = defaultdict(list)
    for row in rows:
        keys[row.message_id.rsplit("-", 1)[0]].append(row.n)
    return dict(keys)


def assert_in_order(backend: Backend, port: str, keys: int, per_key: int, prefix: str = "k") -> None:
    seqs = committed(backend, port)
    assert sorted(seqs) == sorted(f"{prefix}{k}" for k in range(keys))
    for key, got in seqs.items():
        assert got == list(range(per_key)), f"key {key}: committed {got}"


def settled(backend: Backend, port: str, total: int) -> Any:
    return lambda: sum(len(s) for s in committed(backend, port).values()) >= total


def ordered_port(queue: str, **port: Any) -> dict[str, Any]:
    return {"destination": queue, "order_by": "body:key", "concurrency": 8, "max_retries": 1000,
            **port}


def test_each_key_commits_in_publish_order_once_with_failures(backend: Backend) -> None:
    """20 keys x 50, concurrency 8, random sleeps, 1 in 20 failing once: each key in order, once.

    (The issue's 20 x 100 halved to keep the test to seconds; benchmarks/ordered.py runs more.)"""
    queue = backend.q("PAY")
    settings = backend.write(ports={"Ordered": ordered_port(queue)}, queues={queue: {}})
    items = bodies(20, 50, fail_every=20, sleep=0.004)
    publish(backend, settings, queue, items)
    with backend.container(settings):
        wait_for(settled(backend, "Ordered", len(items)), 120, interval=0.5, what="every message")
    assert_in_order(backend, "Ordered", 20, 50)
    failed = [b for b in items if b.get("fail_once")]
    assert failed
    attempts = [a for a in backend.attempts("Ordered")]
    for body in failed[:5]:  # a failed message ran again, then its key went on
        mid = f"{body['key']}-{body['seq']}"
        assert [a[3] for a in attempts if a[1] == mid] == [0, 1]


def poison_run(backend: Backend, on_backout: str, poison: dict[str, Any]) -> tuple[Path, str]:
    """Keys k0..k3 of 8 messages each; k0's seq 2 is poison (threshold 3, a delay of 1s)."""
    queue = backend.q("POISON")
    settings = backend.write(ports={"Ordered": ordered_port(queue, concurrency=4, on_backout=on_backout)},
                             queues={queue: {"backout_threshold": 3, "redelivery_delay": "1s"}})
    items = bodies(4, 8, sleep=0.002)
    for body in items:
        if (body["key"], body["seq"]) == ("k0", 2):
            body.update(poison)
    publish(backend, settings, queue, items)
    return settings, queue


def handled_between(backend: Backend, first: float, last: float) -> list[str]:
    times = []
    for line in backend.log.read_text().splitlines():
        _port, mid, _action, _count, at = line.split("\t")
        if not mid.startswith("k0-") and first < float(at) < last:
            times.append(mid)
    return times


def test_a_poison_message_holds_its_key_while_the_others_flow_then_continue(backend: Backend) -> None:
    settings, _queue = poison_run(backend, "continue", {"poison": True})
    with backend.container(settings):
        wait_for(settled(backend, "Ordered", 31), 60, interval=0.3, what="every good message")
    seqs = committed(backend, "Ordered")
    assert seqs["k0"] == [0, 1, 3, 4, 5, 6, 7], "after the backout the key went on, in order"
    assert all(seqs[k] == list(range(8)) for k in ("k1", "k2", "k3"))
    times = backend.attempt_times("k0-2")
    assert len(times) == 3 and times[1] - times[0] >= 0.9 and times[2] - times[1] >= 0.9
    assert handled_between(backend, times[0], times[2]), "the other keys flowed meanwhile"
    dead = backend.probe(settings).take_all(backend.q("DLQ"))
    assert [d.properties["message_id"] for d in dead] == ["k0-2"]


# Holding and releasing a key is the port's (its row, the CLI, the console); the backout that
# starts it crosses each broker in test_a_poison_message_holds_its_key..., on both backends.
@on_embedded
def test_hold_keeps_the_key_until_mdb_port_release(backend: Backend) -> None:
    settings, _queue = poison_run(backend, "hold", {"poison": True})
    with backend.container(settings) as container:
        def held() -> list[dict[str, Any]]:
            return (container.port_state("Ordered") or {}).get("held") or []

        wait_for(lambda: held() and settled(backend, "Ordered", 26)(), 60, interval=0.3,
                 what="the key held, the others handled")
        assert committed(backend, "Ordered")["k0"] == [0, 1]
        assert held() == [{"key": "k0", "message_id": "k0-2", "waiting": 5}]
        shown = mdb("ports", settings=settings, env=backend.env)
        assert "Ordered held key k0: message k0-2 backed out, 5 waiting" in shown.stdout, shown.stdout
        from tests.behaviour.helpers import console, request

        with console(backend, settings) as base:
            status, _headers, page = request(base, "GET", "/ports/rows")
        assert status == 200 and "held key k0: message k0-2 backed out, 5 waiting" in page, page
        result = mdb("port", "release", "Ordered", "k0", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(settled(backend, "Ordered", 31), 30, interval=0.3, what="the key released")
        # the port's row is written every control_interval: it may still show the key a moment
        wait_for(lambda: not held(), 10, interval=0.2, what="mdb ports to show no held key")
        again = mdb("port", "release", "Ordered", "k0", settings=settings, env=backend.env)
        assert "key 'k0' is not held" in one_line_error(again, 1)
    assert committed(backend, "Ordered")["k0"] == [0, 1, 3, 4, 5, 6, 7]


# The release on the replayed message's arrival is the port's; replaying on each broker is
# tests/behaviour/test_dlq.py's, on both backends.
@on_embedded
def test_a_replay_of_the_backed_out_message_releases_its_key_and_comes_first(backend: Backend) -> None:
    flag = backend.tmp / "poisoned"
    flag.touch()
    settings, _queue = poison_run(backend, "hold", {"poison_flag": str(flag)})
    with backend.container(settings) as container:
        wait_for(lambda: (container.port_state("Ordered") or {}).get("held")
                 and settled(backend, "Ordered", 26)(), 60, interval=0.3, what="the key held")
        flag.unlink()  # the poison is fixed; the operator replays it
        result = mdb("dlq", "replay", "k0-2", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(settled(backend, "Ordered", 32), 30, interval=0.3, what="the key released by the replay")
    assert committed(backend, "Ordered")["k0"] == list(range(8))


def test_order_and_once_hold_through_two_kills_and_a_closed_connection(backend: Backend) -> None:
    """The handler SIGKILLs its container twice (restarted each time); on RabbitMQ an operator
    also closes the consumer's connection: every key still commits in publish order, once."""
    queue = backend.q("KILLED")
    settings = backend.write(ports={"Ordered": ordered_port(queue)}, queues={queue: {}})
    items = bodies(20, 20, sleep=0.004)
    flags = [backend.tmp / "killed-1", backend.tmp / "killed-2"]
    items[100]["kill_flag"], items[250]["kill_flag"] = str(flags[0]), str(flags[1])
    publish(backend, settings, queue, items)
    container = backend.container(settings)
    try:
        for flag in flags:
            # Not waiting for its ports to start: the kill may come before a poll of them sees it.
            container.start(wait=False)
            wait_for(lambda f=flag: f.exists() and not container.alive(), 60, what=f"{flag.name}")
            container.wait_exit()
        container.start()
        if backend.kind == "rabbitmq":
            from tests.behaviour.helpers import consumer_connection

            wait_for(settled(backend, "Ordered", 300), 60, interval=0.05, what="300 handled")
            rabbitmqctl("close_connection", consumer_connection(queue), "closed by a test operator")
        wait_for(settled(backend, "Ordered", len(items)), 90, interval=0.3, what="every message")
        assert container.terminate() == 0
    finally:
        container.__exit__(*sys.exc_info())
    assert_in_order(backend, "Ordered", 20, 20)
    assert backend.effects("Ordered").most_common(1)[0][1] == 1, "each message once"
    killed = [a for a in backend.attempts("Ordered") if a[1] == f"{items[100]['key']}-{items[100]['seq']}"]
    assert [a[3] for a in killed] == [0, 1], "the kill counted one failed delivery"


def runs(backend: Backend) -> list[tuple[str, int, float, float]]:
    """(message id, pid, began, ended) of every handler call that returned, in the order logged."""
    path = Path(f"{backend.log}.pids")
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        mid, pid, began, ended = line.split("\t")
        out.append((mid, int(pid), float(began), float(ended)))
    return out


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_partitions_are_shared_by_the_fleet_one_process_each_and_move_when_it_dies(rabbit: Backend) -> None:
    """partitions = 4, three mdb run: each partition has one consumer; kill it, another takes over."""
    queue = rabbit.q("PARTS")
    rabbit.queues.update(f"{queue}.p{i}" for i in range(4))
    settings = rabbit.write(ports={"Ordered": ordered_port(queue, partitions=4)}, queues={queue: {}})
    fleet = [rabbit.container(settings, log_path=rabbit.tmp / f"run-{i}.log") for i in range(3)]
    try:
        for container in fleet:
            container.start()
        items = bodies(40, 12, sleep=0.01)
        publish(rabbit, settings, queue, items)
        wait_for(settled(rabbit, "Ordered", 150), 60, interval=0.05, what="150 handled")
        pids = {pid for _mid, pid, _b, _e in runs(rabbit)}
        holder = next(c for c in fleet if c.pid in pids)
        holder.kill()
        killed_at = time.time()
        wait_for(settled(rabbit, "Ordered", len(items)), 60, interval=0.3, what="every message")
    finally:
        for container in fleet:
            container.__exit__(*sys.exc_info())
    assert_in_order(rabbit, "Ordered", 40, 12)
    assert rabbit.effects("Ordered").most_common(1)[0][1] == 1, "each message once"
    after = [(b, pid) for _mid, pid, b, _e in runs(rabbit) if b > killed_at]
    assert after and min(b for b, _ in after) - killed_at < 10, "another process took over within seconds"
    assert holder.pid not in {pid for _b, pid in after}
    by_key: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for mid, pid, began, ended in runs(rabbit):
        by_key[mid.rsplit("-", 1)[0]].append((began, ended, pid))
    for key, calls in by_key.items():  # one at a time, whichever process ran them
        calls.sort()
        for (_b1, end1, _p1), (begin2, _e2, _p2) in itertools.pairwise(calls):
            assert begin2 >= end1 - 0.001, f"key {key}: two calls at once"
    # The broker's queues: the consistent-hash exchange and four single-active-consumer partitions.
    listed = rabbitmqctl("list_queues", "name", "arguments", "--quiet", "--no-table-headers")
    for i in range(4):
        assert any(line.startswith(f"{queue}.p{i}\t") and "x-single-active-consumer" in line
                   for line in listed.splitlines())


def test_partitions_on_the_embedded_broker_are_a_settings_error(embedded: Backend) -> None:
    queue = embedded.q("PARTS")
    settings = embedded.write(ports={"Ordered": ordered_port(queue, partitions=4)}, queues={queue: {}})
    result = mdb("run", settings=settings, env=embedded.env)
    line = one_line_error(result, 2)
    assert "ports.Ordered.partitions" in line and "embedded broker" in line


# The kinds of port share the lanes; the order each broker delivers in is
# test_each_key_commits_in_publish_order_once_with_failures's, on both backends.
@on_embedded
@pytest.mark.parametrize("port, extra", [
    ("OrderedAsync", {}),
    ("OrderedBatch", {"batch_size": 10}),
    ("Ordered", {"order_by": "JMSXGroupID", "transaction": "bean"}),
])
def test_async_batch_and_bean_ports_keep_each_keys_order(backend: Backend, port: str,
                                                         extra: dict[str, Any]) -> None:
    """The same order checks on an async port, a batch port, and a BMT port keyed by JMSXGroupID."""
    queue = backend.q("KINDS")
    settings = backend.write(ports={port: ordered_port(queue, **extra)}, queues={queue: {}})
    items = bodies(10, 20, fail_every=15, sleep=0.004, seed=11)
    publish(backend, settings, queue, items, header=extra.get("order_by") == "JMSXGroupID")
    with backend.container(settings):
        wait_for(settled(backend, port, len(items)), 90, interval=0.3, what="every message")
    assert_in_order(backend, port, 10, 20)
    assert backend.effects(port).most_common(1)[0][1] == 1, "each message once"
    failed = [f"{b['key']}-{b['seq']}" for b in items if b.get("fail_once")]
    assert failed and all(any(a[1] == mid and a[3] == 1 for a in backend.attempts(port))
                          for mid in failed), "each failed message ran again"


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_mdb_check_tells_whether_the_broker_has_the_consistent_hash_plugin(rabbit: Backend) -> None:
    from mdbcontainer.wire.connection import Broker
    from mdbcontainer.wire.partitions import plugin_missing

    queue = rabbit.q("CHECKED")
    settings = rabbit.write(ports={"Ordered": ordered_port(queue, partitions=2)}, queues={queue: {}})
    result = mdb_here("check", settings=settings, env=rabbit.env)
    assert result.returncode == 0, result.stderr
    assert "rabbitmq_consistent_hash_exchange" not in result.stderr, "this broker has the plugin"
    conn = Broker(rabbit.settings(settings)).connect_once()
    try:  # what mdb check reads when a broker lacks an exchange type
        assert plugin_missing(conn.channel(), f"mdb.test.{rabbit.tag}", kind="x-no-such-type")
    finally:
        conn.release()


@pytest.mark.rabbitmq
@pytest.mark.postgres
def test_producers_and_ctx_send_route_an_ordered_destination_by_key(rabbit: Backend) -> None:
    """Producer.send and a handler's ctx.send (through the outbox) publish to the partitions:
    every message of one key on one partition."""
    source, dest = rabbit.q("SRC"), rabbit.q("ROUTED")
    parts = [f"{dest}.p{i}" for i in range(3)]
    rabbit.queues.update(parts)
    settings = rabbit.write(
        ports={"Work": {"destination": source},
               "Ordered": {"destination": dest, "order_by": "body:n", "partitions": 3}},
        queues={source: {}, dest: {}}, listeners=["tests.apps.work", "tests.apps.ordered"])
    probe = rabbit.probe(settings)
    with rabbit.producer(settings) as producer:
        for i in range(6):
            producer.send(dest, {"n": "same", "i": i})
    counts = [probe.count(q) for q in parts]
    assert sorted(counts) == [0, 0, 6], counts
    with rabbit.container(settings, ports=["Work"]):
        with rabbit.producer(settings) as producer:
            for i in range(5):
                producer.send(source, {"n": i, "action": "send", "to": dest}, message_id=f"s-{i}")
        wait_for(lambda: sum(probe.count(q) for q in parts) == 11, 30, what="the sends routed")
    got = {d.properties["message_id"] for q in parts for d in probe.take_all(q)}
    assert {f"s-{i}.out" for i in range(5)} <= got


def test_a_graceful_stop_hands_back_a_message_waiting_out_its_delay_and_the_order_holds(
        backend: Backend) -> None:
    """k0's first message fails and waits 60s in the container; SIGTERM: the container exits 0
    at once, handing it back; the next container runs it before the key's later messages."""
    queue = backend.q("STOPPED")
    settings = backend.write(ports={"Ordered": ordered_port(queue, concurrency=2)},
                             queues={queue: {"redelivery_delay": "60s"}})
    items = bodies(2, 5)
    for body in items:
        if (body["key"], body["seq"]) == ("k0", 0):
            body["fail_once"] = True
    publish(backend, settings, queue, items)
    container = backend.container(settings)
    try:
        container.start()
        wait_for(lambda: committed(backend, "Ordered").get("k1") == list(range(5)), 60,
                 interval=0.2, what="k1 handled while k0 waits")
        assert "k0" not in committed(backend, "Ordered")
        assert container.terminate(timeout=30) == 0
        container.start()
        wait_for(settled(backend, "Ordered", 10), 60, interval=0.2, what="k0 after the restart")
    finally:
        container.__exit__(*sys.exc_info())
    assert committed(backend, "Ordered")["k0"] == list(range(5))
    assert [a[3] for a in backend.attempts("Ordered") if a[1] == "k0-0"] == [0, 1]
