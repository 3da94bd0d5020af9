"""Redelivery delays kept by the broker (README "Redelivery delays"): a failed message waits on a
wait queue, the port goes on with the next messages, and nothing is lost or applied twice."""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.settings import QueueSettings
from mdbcontainer.testing import mdb, wait_for
from mdbcontainer.wire.delays import wait_queues
from tests.conftest import Backend, delayed_settings, rabbitmqctl

pytestmark = pytest.mark.slow


def seen(backend: Backend) -> list[dict[str, Any]]:
    """What the Delayed handler saw, one entry per attempt."""
    path = Path(f"{backend.log}.delayed")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_one_failing_message_does_not_hold_fifty_good_ones_behind_it(backend: Backend) -> None:
    queue = backend.q("LINE")
    settings = delayed_settings(backend, queue, {"prefetch": 1}, redelivery_delay="8s",
                                backout_threshold=3)
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 0, "fail": 1}, message_id="slow")
        for n in range(1, 51):
            producer.send(queue, {"n": n}, message_id=f"good-{n}")
    with backend.container(settings):
        wait_for(lambda: len(backend.effects()) == 51, timeout=60, what="every message handled")
    times = {entry["id"]: [] for entry in seen(backend)}
    for entry in seen(backend):
        times[entry["id"]].append(entry["at"])
    first, second = times["slow"]
    last_good = max(t for mid, ts in times.items() if mid != "slow" for t in ts)
    assert last_good < second, "the fifty good messages ran while the failed one waited"
    assert last_good - first < 7.0, "none of them waited for the failed message's delay"
    assert 7.0 <= second - first < 8.0 + 3.0, "the failed message came back after its 8 s"
    assert backend.effects() == {mid: 1 for mid in times}


def test_attempts_are_spaced_by_the_backoff_and_the_port_keeps_consuming(backend: Backend) -> None:
    queue = backend.q("SPACED")
    settings = delayed_settings(backend, queue, redelivery_delay="1s", redelivery_backoff=2.0,
                                redelivery_delay_max="3s", backout_threshold=5)
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 4}, message_id="spaced")
    with backend.container(settings) as container:
        wait_for(lambda: container.port_state("Delayed")["failed"] >= 1, what="the first failure")
        with backend.producer(settings) as producer:  # sent while the failed message waits
            producer.send(queue, {"n": 2}, message_id="meanwhile")
        wait_for(lambda: "meanwhile" in backend.effects(), timeout=3, what="a message sent meanwhile")
        wait_for(lambda: "spaced" in backend.effects(), timeout=30, what="the fifth attempt")
    times = backend.attempt_times("spaced")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert [a[3] for a in backend.attempts() if a[1] == "spaced"] == [0, 1, 2, 3, 4]
    for gap, expected in zip(gaps, [1.0, 2.0, 3.0, 3.0], strict=True):  # 1 s, 2 s, then capped
        assert expected - 0.2 <= gap < expected + 1.5, gaps


def test_a_message_comes_back_as_it_was_and_is_backed_out_with_its_last_failure(
    backend: Backend,
) -> None:
    queue = backend.q("ASWAS")
    settings = delayed_settings(backend, queue, redelivery_delay="300ms", backout_threshold=3,
                                max_priority=9)
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 9}, message_id="poison", priority=7,
                      headers={"tenant": "acme"})
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="the backout")
    attempts = seen(backend)
    assert [a["count"] for a in attempts] == [0, 1, 2]
    for attempt in attempts:
        assert attempt["priority"] == 7
        assert attempt["headers"].get("tenant") == "acme"
        assert not [h for h in attempt["headers"] if h.startswith("x-mdb-")], attempt["headers"]
    [dead] = backend.probe(settings).take_all(backend.q("DLQ"))
    headers = dict(dead.headers)
    assert headers["x-mdb-redelivery-count"] == 3
    assert "fails delivery 3" in headers["x-mdb-exception"]
    assert headers["tenant"] == "acme" and dead.properties["priority"] == 7


def test_a_message_that_expires_while_it_waits_is_expired_never_redelivered(backend: Backend) -> None:
    queue = backend.q("SHORTLIVED")
    settings = delayed_settings(backend, queue, redelivery_delay="7s")
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "fail": 1}, message_id="brief", ttl="3s")
        wait_for(lambda: container.port_state("Delayed")["expired"] == 1, timeout=20,
                 what="the expiry of the waiting message")
        time.sleep(4)  # past the 7 s wait: nothing comes back
    assert [a[3] for a in backend.attempts()] == [0], "one delivery, never one after its time"
    assert backend.effects() == {}


def test_waiting_messages_show_in_mdb_ports(backend: Backend) -> None:
    queue = backend.q("SHOWN")
    settings = delayed_settings(backend, queue, redelivery_delay="1m")
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 1}, message_id="w1")
        producer.send(queue, {"n": 2, "fail": 1}, message_id="w2")
        producer.send(queue, {"n": 3}, message_id="ok")

    def waiting() -> int:
        result = mdb("ports", "--json", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        rows = [r for r in json.loads(result.stdout) if r["port"] == "Delayed"]
        return int(rows[0]["waiting"]) if rows else -1

    with backend.container(settings) as container:
        # Polled on the port's row (the one mdb ports reads), not an mdb process per poll.
        wait_for(lambda: (container.port_state("Delayed") or {}).get("waiting") == 2, timeout=30,
                 what="two waiting messages in the port's row")
        assert waiting() == 2, "mdb ports --json shows them"
        table = mdb("ports", settings=settings, env={**backend.env, "COLUMNS": "250"})
        header, row = table.stdout.splitlines()[:2]
        end = header.index("waiting") + len("waiting")  # a right-aligned column
        assert row[:end].split()[-1] == "2", table.stdout
        watch = mdb("ports", "--watch", "--iterations", "1", settings=settings,
                    env={**backend.env, "COLUMNS": "250"})
        assert watch.returncode == 0, watch.stderr
        header = next(line for line in watch.stdout.splitlines() if line.startswith("container "))
        row = next(line for line in watch.stdout.splitlines() if " Delayed " in line)
        end = header.index("waiting") + len("waiting")
        assert row[:end].split()[-1] == "2", f"--watch shows them too:\n{watch.stdout}"
    assert backend.probe(settings).count(f"{queue}.wait.1m") == 2


def test_a_crash_before_the_move_of_a_message_back_from_its_wait_loses_nothing(
    backend: Backend,
) -> None:
    """Its second failure is counted, then SIGKILL before its move: the broker redelivers the copy
    that came back, which is then the only one and must run (it is no stale extra copy)."""
    queue = backend.q("LAST")
    settings = delayed_settings(backend, queue, redelivery_delay="2s")
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 2}, message_id="last-copy")
    first = backend.container(settings)
    first.env.update({"MDB_CRASH_AT": "before-wait:2", "MDB_CRASH_ONCE_FILE": str(backend.tmp / "x")})
    with first.start(wait=False):
        assert first.wait_exit(60) != 0, "killed itself before the second move"
    with backend.container(settings, log_path=backend.tmp / "second.log"):
        wait_for(lambda: "last-copy" in backend.effects(), timeout=30, what="the message")
    assert [a[3] for a in backend.attempts()] == [0, 1, 2]
    assert backend.effects() == {"last-copy": 1}


@pytest.mark.parametrize("crash", ["while it waits", "between the move and the ack"])
def test_a_crash_loses_no_waiting_message_and_applies_none_twice(backend: Backend, crash: str) -> None:
    queue = backend.q("CRASH")
    settings = delayed_settings(backend, queue, redelivery_delay="3s")
    wait = f"{queue}.wait.3s"
    env = {}
    if crash != "while it waits":  # SIGKILL after the copy is confirmed, before the original's ack
        env = {"MDB_CRASH_AT": "mid-wait", "MDB_CRASH_ONCE_FILE": str(backend.tmp / "crashed")}
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 1}, message_id="survivor")
    first = backend.container(settings)
    first.env.update(env)
    with first.start(wait=False):
        probe = backend.probe(settings)
        wait_for(lambda: probe.exists(wait) and probe.count(wait) == 1, what="the message waiting")
        if crash == "while it waits":
            first.kill()
        assert first.wait_exit(30) != 0, "SIGKILL"
    with backend.container(settings, log_path=backend.tmp / "second.log") as second:
        wait_for(lambda: "survivor" in backend.effects(), timeout=30, what="the waiting message")
        if crash != "while it waits":  # the original came back at once; its copy comes after 3 s
            wait_for(lambda: second.port_state("Delayed")["duplicate_skipped"] == 1, timeout=20,
                     what="the extra copy absorbed by the dedup table")
        wait_for(lambda: probe.count(wait) == 0 and probe.count(queue) == 0, timeout=15,
                 what="no copy left behind")
    assert backend.effects() == {"survivor": 1}, "applied once"
    counts = [a[3] for a in backend.attempts()]
    assert counts == [0, 1], "the crash counted no second failure; the extra copy never ran"


def test_an_extra_copy_left_by_a_crash_neither_runs_nor_backs_out_twice(backend: Backend) -> None:
    """SIGKILL after the copy is confirmed, before the original's ack: the original comes back at
    once and fails again, so the copy that comes back later is stale and is acknowledged unrun."""
    queue = backend.q("STALE")
    settings = delayed_settings(backend, queue, redelivery_delay="5s", backout_threshold=3)
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 99}, message_id="poison")
    first = backend.container(settings)
    first.env.update({"MDB_CRASH_AT": "mid-wait", "MDB_CRASH_ONCE_FILE": str(backend.tmp / "crashed")})
    with first.start(wait=False):
        assert first.wait_exit(60) != 0, "killed itself at the crash point"
    dlq = backend.q("DLQ")
    with backend.container(settings, log_path=backend.tmp / "second.log") as second:
        probe = backend.probe(settings)
        wait_for(lambda: probe.count(dlq) == 1, timeout=40, what="the backout")
        wait_for(lambda: second.port_state("Delayed")["duplicate_skipped"] == 1, timeout=20,
                 what="the stale copy acknowledged unrun")
        assert probe.count(f"{queue}.wait.5s") == 0 and probe.count(queue) == 0
    assert [a[3] for a in backend.attempts()] == [0, 1, 2], "each failure counted once"
    assert backend.probe(settings).count(dlq) == 1, "one copy in the backout queue"


def test_two_copies_that_fail_side_by_side_leave_one_that_goes_on_to_the_backout_queue(
    backend: Backend,
) -> None:
    """A poison message sent twice (a producer's retry): both copies are delivered before either
    fails, then both fail. The copy that leaves after the second failure must carry that count: if
    both carried the count their delivery began with, both came back stale and the message vanished."""
    queue = backend.q("TWICE")
    settings = backend.write(
        ports={"Work": {"destination": queue, "concurrency": 2, "prefetch": 1, "max_retries": 100}},
        queues={queue: {"backout_threshold": 4, "redelivery_delay": "300ms"}},
    )
    backend.queues.update(wait_queues(queue, QueueSettings(backout_threshold=4, redelivery_delay="300ms")))
    reached, go = backend.tmp / "reached", backend.tmp / "go"
    body = {"n": 1, "action": "fail", "pause": [str(reached), str(go)]}
    with backend.producer(settings) as producer:
        producer.send(queue, body, message_id="twice")
        producer.send(queue, body, message_id="twice")
    dlq = backend.q("DLQ")
    with backend.container(settings):
        probe = backend.probe(settings)
        # Both delivered (one consumer each), so both began with no failure counted; on PostgreSQL
        # the second waits for the first one's dedup claim, on the embedded broker it runs beside it.
        wait_for(lambda: reached.exists() and probe.count(queue) == 0, what="both copies delivered")
        go.touch()
        wait_for(lambda: probe.count(dlq) == 1, timeout=30, what="the poison message backed out")
        wait_for(lambda: probe.count(queue) == 0 and probe.count(f"{queue}.wait.300ms") == 0,
                 timeout=10, what="no copy left behind")
    [dead] = probe.take_all(dlq)
    assert dead.properties["message_id"] == "twice"
    assert dict(dead.headers)["x-mdb-redelivery-count"] == 4


def test_an_original_redelivered_after_a_crash_and_its_copy_failing_side_by_side_lose_nothing(
    backend: Backend,
) -> None:
    """SIGKILL after the copy is confirmed, before the original's ack; the next container starts
    once the copy is back from its wait, so the redelivered original and the copy are delivered
    together and both fail. One of them must go on (here: to the backout queue), not both vanish."""
    queue = backend.q("BESIDE")
    keys = {"backout_threshold": 4, "redelivery_delay": "200ms"}
    settings = backend.write(
        ports={"Work": {"destination": queue, "concurrency": 2, "prefetch": 1, "max_retries": 100}},
        queues={queue: keys},
    )
    backend.queues.update(wait_queues(queue, QueueSettings(**keys)))
    reached, go = backend.tmp / "reached", backend.tmp / "go"
    go.touch()  # the first container fails it at once
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "fail", "pause": [str(reached), str(go)]},
                      message_id="beside")
    first = backend.container(settings)
    first.env.update({"MDB_CRASH_AT": "mid-wait", "MDB_CRASH_ONCE_FILE": str(backend.tmp / "crashed")})
    with first.start(wait=False):
        assert first.wait_exit(60) != 0, "killed itself between the move and the ack"
    go.unlink()
    reached.unlink()
    probe = backend.probe(settings)
    time.sleep(1.0)  # the copy's 200 ms wait is over: it is due back beside the original
    dlq = backend.q("DLQ")
    with backend.container(settings, log_path=backend.tmp / "second.log"):
        wait_for(lambda: reached.exists() and probe.count(queue) == 0, what="both delivered")
        go.touch()
        wait_for(lambda: probe.count(dlq) == 1, timeout=30, what="the poison message backed out")
        wait_for(lambda: probe.count(queue) == 0 and probe.count(f"{queue}.wait.200ms") == 0,
                 timeout=10, what="no copy left behind")
    assert [m.properties["message_id"] for m in probe.take_all(dlq)] == ["beside"]


@pytest.mark.rabbitmq
def test_a_quorum_queue_waits_on_quorum_wait_queues(rabbit: Backend) -> None:
    queue = rabbit.q("QUORUM")
    settings = delayed_settings(rabbit, queue, {"prefetch": 1}, quorum=True, redelivery_delay="1s",
                                backout_threshold=3)
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 1}, message_id="q1")
        producer.send(queue, {"n": 2, "fail": 9}, message_id="q-poison")
    with rabbit.container(settings):
        wait_for(lambda: "q1" in rabbit.effects(), timeout=30, what="the message after its wait")
        wait_for(lambda: rabbit.probe(settings).count(rabbit.q("DLQ")) == 1, timeout=30, what="backout")
    listed = rabbitmqctl("list_queues", "--quiet", "--no-table-headers", "name", "type", "arguments")
    types = {line.split("\t")[0]: line for line in listed.splitlines() if "\t" in line}
    assert "quorum" in types[f"{queue}.wait.1s"] and "at-least-once" in types[f"{queue}.wait.1s"]
    assert [a[3] for a in rabbit.attempts() if a[1] == "q-poison"] == [0, 1, 2]


@pytest.mark.parametrize("transaction", ["container", "none"])
def test_a_failed_member_of_a_batch_waits_alone_and_the_rest_are_settled(
    backend: Backend, transaction: str,
) -> None:
    queue = backend.q("BATCHED")
    keys = {"redelivery_delay": "1s", "backout_threshold": 3}
    backend.queues.update(wait_queues(queue, QueueSettings(**keys)))
    settings = backend.write(
        ports={"Work": {"destination": queue, "batch_size": 10, "batch_linger": "300ms",
                        "transaction": transaction, "max_retries": 5}},
        queues={queue: keys})
    with backend.producer(settings) as producer:
        for n in range(10):
            producer.send(queue, {"n": n, **({"fail_first": 1} if n == 6 else {})}, message_id=f"b-{n}")
    with backend.container(settings) as container:
        wait_for(lambda: (container.port_state("Work") or {}).get("handled") == 10, timeout=30,
                 what="ten handled, the failed one after its wait")
        probe = backend.probe(settings)
        assert probe.count(queue) == 0 and probe.count(f"{queue}.wait.1s") == 0
    assert [a[3] for a in backend.attempts() if a[1] == "b-6"][-2:] == [0, 1]
    if transaction == "container":
        assert backend.effects() == {f"b-{n}": 1 for n in range(10)}
    else:
        assert all(n == 1 for mid, n in Counter(a[1] for a in backend.attempts()).items() if mid != "b-6")
