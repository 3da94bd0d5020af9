"""Amazon SQS (CONTRACT section 17), on moto's SQS server: what only SQS does to a container.

Standard queues deliver duplicates (here: the same producer id sent twice),
a redelivery delay is the message's visibility timeout (it survives a
SIGKILL of the container), a long handler keeps its message invisible, a
graceful stop hands the prefetched messages back at once, a FIFO queue keeps
its groups' order through a failure, and what SQS lacks is refused at start.
The behaviour tests that hold on every transport run on SQS through the
``transport`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from mdbcontainer.testing import ContainerProcess, headers_of, mdb, wait_for
from mdbcontainer.wire.sqs import GROUP_HEADER, sqs_name
from tests.chaos.faults import forwarded
from tests.conftest import ROOT, Backend, delayed_settings, one_line_error

pytestmark = pytest.mark.slow


def client() -> Any:
    import boto3

    return boto3.client("sqs")


def create(queue: str, **attributes: str) -> None:
    """Create ``queue`` on SQS before the container does (it keeps the queue's attributes)."""
    if queue.endswith(".fifo"):
        attributes["FifoQueue"] = "true"
    client().create_queue(QueueName=sqs_name(queue), Attributes=attributes)


def test_a_duplicate_that_sqs_delivers_is_applied_once(sqs: Backend) -> None:
    queue = sqs.q("ORDERS")
    settings = sqs.write(ports={"Work": {"destination": queue, "once_only": True, "concurrency": 2}},
                         queues={queue: {}})
    with sqs.producer(settings) as producer:
        for n in range(20):
            producer.send(queue, {"n": n}, message_id=f"m{n}")
        for n in range(5):  # a producer's retry: SQS keeps both copies (standard queues do)
            producer.send(queue, {"n": n}, message_id=f"m{n}")
    with sqs.container(settings):
        wait_for(lambda: sqs.probe(settings).count(queue) == 0 and len(sqs.effects()) == 20,
                 timeout=60, what="every message handled")
        time.sleep(1.0)  # a second copy handled late would show now
    assert sqs.effects() == {f"m{n}": 1 for n in range(20)}


def test_a_poison_message_is_backed_out_to_an_sqs_queue_with_its_headers(sqs: Backend) -> None:
    queue, dlq = sqs.q("IN"), sqs.q("IN.BACKOUT")
    settings = sqs.write(ports={"Work": {"destination": queue, "max_retries": 100}},
                         queues={queue: {"backout_threshold": 2, "backout_queue": dlq}})
    with sqs.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "fail"}, message_id="poison",
                      headers={"tenant": "acme", "attempt": 7})
        producer.send(queue, {"n": 2}, message_id="good")
    with sqs.container(settings):
        wait_for(lambda: sqs.probe(settings).count(dlq) == 1, timeout=60, what="the backout")
        wait_for(lambda: sqs.effects() == {"good": 1}, what="the good message")
    assert [a[1] for a in sqs.attempts()].count("poison") == 2, "backed out at the threshold"
    moved = sqs.probe(settings).take_all(dlq)[0]
    headers = headers_of(moved)
    assert moved.message_id == "poison", "the producer's id, not SQS's own"
    assert json.loads(moved.body) == {"n": 1, "action": "fail"}
    assert headers["tenant"] == "acme" and headers["attempt"] == 7
    assert headers["x-mdb-redelivery-count"] == 2
    assert "poison message 1" in headers["x-mdb-exception"]


def test_a_redelivery_delay_is_kept_by_sqs_through_a_sigkill(sqs: Backend) -> None:
    queue = sqs.q("LATER")
    settings = delayed_settings(sqs, queue, redelivery_delay="6s", backout_threshold=5)
    with sqs.producer(settings) as producer:
        producer.send(queue, {"n": 1, "fail": 1}, message_id="later")
        for n in range(2, 6):
            producer.send(queue, {"n": n}, message_id=f"good-{n}")
    with sqs.container(settings) as container:
        wait_for(lambda: len(sqs.effects()) == 4 and sqs.attempt_times("later"), timeout=60,
                 what="the good ones handled, the failed one waiting")
        time.sleep(1.0)  # its failure counted, its visibility set
        container.kill()  # SIGKILL: nothing of the wait is in the process
    failed_at = sqs.attempt_times("later")[0]
    with sqs.container(settings):
        started = time.time()
        wait_for(lambda: "later" in sqs.effects(), timeout=30, what="the message back after its delay")
    second = sqs.attempt_times("later")[1]
    assert second - failed_at >= 5.0, "it waited its 6 s, in SQS, across the kill"
    assert second - max(failed_at + 6.0, started) < 4.0, "and came back when its wait was over"
    assert sqs.effects() == {"later": 1, **{f"good-{n}": 1 for n in range(2, 6)}}


def test_a_handler_longer_than_the_visibility_timeout_runs_once(sqs: Backend) -> None:
    """Visibility 10 s, handler 40 s, two containers on the queue: no second consumer ever gets it.

    Without the extension the message would be visible again three times over
    while its handler runs, and the idle container long-polls the queue throughout.
    """
    queue = sqs.q("LONG")
    create(queue, VisibilityTimeout="10")
    settings = sqs.write(ports={"Work": {"destination": queue, "prefetch": 1}}, queues={queue: {}})
    with sqs.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "sleep", "seconds": 40}, message_id="long")
    with sqs.container(settings), sqs.container(settings):
        wait_for(lambda: "long" in sqs.effects(), timeout=70, what="the long handler done")
        time.sleep(3.0)  # a copy received as the first one ended would be running now
    assert [a[1] for a in sqs.attempts()] == ["long"], "one delivery, never a second mid-way"
    assert sqs.effects() == {"long": 1}
    assert sqs.probe(settings).count(queue) == 0


def test_a_graceful_stop_hands_prefetched_messages_back_at_once(sqs: Backend) -> None:
    """Visibility 120 s: handed back messages that waited for it would not be done in the test's time."""
    queue = sqs.q("STOP")
    create(queue, VisibilityTimeout="120")
    settings = sqs.write(ports={"Work": {"destination": queue, "prefetch": 10}}, queues={queue: {}})
    with sqs.producer(settings) as producer:
        for n in range(20):
            producer.send(queue, {"n": n, "action": "sleep", "seconds": 0.2}, message_id=f"m{n}")
    with sqs.container(settings) as container:
        wait_for(lambda: len(sqs.effects()) >= 2, timeout=30, what="the first messages handled")
        assert container.terminate() == 0  # SIGTERM: a graceful stop
    with sqs.container(settings):
        wait_for(lambda: len(sqs.effects()) == 20, timeout=40, what="the rest, handed back at stop")
    assert sqs.effects() == {f"m{n}": 1 for n in range(20)}


def test_a_fifo_queue_keeps_each_groups_order_through_a_failure(sqs: Backend) -> None:
    queue = sqs.q("PAYMENTS") + ".fifo"
    settings = sqs.write(ports={"Work": {"destination": queue, "max_retries": 100, "prefetch": 10}},
                         queues={queue: {"backout_threshold": 5}})
    with sqs.producer(settings) as producer:
        for n in range(8):
            for group in ("a", "b", "c"):
                body = {"n": n, "fail_first": 1} if n == 2 else {"n": n}
                producer.send(queue, body, message_id=f"{group}-{n}", headers={GROUP_HEADER: group})
    with sqs.container(settings):
        wait_for(lambda: len(sqs.effects()) == 24, timeout=60, what="every message handled")
    table = sqs.metadata.tables["effects"]
    order: dict[str, list[int]] = defaultdict(list)
    with sqs.engine.connect() as conn:
        for row in conn.execute(select(table.c.message_id, table.c.n).order_by(table.c.id)):
            order[row.message_id.split("-")[0]].append(row.n)
    assert order == {group: list(range(8)) for group in ("a", "b", "c")}, "each group in its order"


def test_a_fifo_queues_groups_are_the_keys_of_an_async_port_without_order_by(sqs: Backend) -> None:
    """One receive hands out several messages of a group; four tasks must still run them in turn.

    The port sets no ``order_by``: on a FIFO queue the message group is its key
    (CONTRACT section 17). Each group's even messages sleep longer than its odd
    ones, so two of a group side by side would commit out of order.
    """
    queue = sqs.q("LEDGER") + ".fifo"
    settings = sqs.write(ports={"AsyncWork": {"destination": queue, "concurrency": 4, "prefetch": 10}},
                         queues={queue: {}})
    with sqs.producer(settings) as producer:
        for n in range(6):
            for group in ("a", "b", "c"):
                body = {"n": n, "action": "sleep", "seconds": 0.3 if n % 2 == 0 else 0.01}
                producer.send(queue, body, message_id=f"{group}-{n}", headers={GROUP_HEADER: group})
    with sqs.container(settings) as container:
        wait_for(lambda: len(sqs.effects()) == 18, timeout=60, what="every message handled")
        ports = container.rows()
    table = sqs.metadata.tables["effects"]
    order: dict[str, list[int]] = defaultdict(list)
    with sqs.engine.connect() as conn:
        for row in conn.execute(select(table.c.message_id, table.c.n).order_by(table.c.id)):
            order[row.message_id.split("-")[0]].append(row.n)
    assert order == {group: list(range(6)) for group in ("a", "b", "c")}, "each group in its order"
    assert [p.get("order_by") for p in ports] == [GROUP_HEADER], ports


def test_sqs_out_of_reach_for_seconds_loses_nothing_and_applies_nothing_twice(
        sqs: Backend, moto_sqs: str) -> None:
    """The endpoint goes away mid-traffic for 8 s, longer than the queue's 3 s visibility timeout.

    Receives, deletes and visibility changes fail meanwhile, and the messages the
    container held come back to it as new deliveries: each must still commit
    once, the port must not stop (an outage counts against no retry limit), and
    the container says what happened.
    """
    queue = sqs.q("REACH")
    create(queue, VisibilityTimeout="3")
    settings = sqs.write(ports={"Work": {"destination": queue, "once_only": True, "concurrency": 2,
                                         "max_retries": 1}},
                         queues={queue: {}})
    with sqs.producer(settings) as producer:
        for n in range(40):
            producer.send(queue, {"n": n, "action": "sleep", "seconds": 0.1}, message_id=f"m{n}")
    with forwarded(moto_sqs) as forwarder:
        env = {**sqs.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{forwarder.port}"}
        with ContainerProcess(settings, env=env, cwd=ROOT) as container:
            wait_for(lambda: len(sqs.effects()) >= 8, timeout=30, what="the first messages handled")
            forwarder.stop()
            time.sleep(8.0)
            forwarder.start()
            wait_for(lambda: len(sqs.effects()) == 40 and sqs.probe(settings).count(queue) == 0,
                     timeout=60, what="every message handled after the outage")
            time.sleep(4.0)  # past a visibility timeout: a message left undeleted would be back
            assert (container.port_state("Work") or {}).get("state") == "started", container.output()
            assert "unavailable" in container.output()
    assert sqs.effects() == {f"m{n}": 1 for n in range(40)}
    assert sqs.probe(settings).count(queue) == 0


@pytest.mark.parametrize(("extra", "refused"), [
    ({"topics": {"news": {}}, "ports": {"Work": {"topic": "news"}}}, "topics"),
    ({"queues": {"Q": {"max_priority": 5}}}, "queues.Q.max_priority"),
])
def test_what_sqs_lacks_is_refused_at_start(sqs: Backend, tmp_path: Path, extra: dict[str, Any],
                                            refused: str) -> None:
    data = sqs.settings_data(ports={"Work": {"destination": "Q"}}, queues={"Q": {}})
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value}
    from mdbcontainer.testing import write_settings

    settings = write_settings(tmp_path / "refused.toml", data)
    line = one_line_error(mdb("run", settings=settings, env=sqs.env, cwd=Path.cwd()), code=2)
    assert refused in line and "sqs" in line


def test_mdb_request_is_refused_on_sqs_in_one_line(sqs: Backend) -> None:
    queue = sqs.q("ASK")
    settings = sqs.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    line = one_line_error(mdb("request", queue, '{"q": 1}', settings=settings, env=sqs.env), code=2)
    assert "temporary reply queues" in line and "sqs" in line
