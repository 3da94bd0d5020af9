"""The embedded broker (kombu transport on SQLite), through kombu's public API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import amqp.exceptions
import kombu.exceptions
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message

from mdbcontainer import embedded
from mdbcontainer.embedded import NoRoute, Transport, browse, topic_matches

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "broker.db")


@pytest.fixture
def conn(db: str) -> Iterator[Connection]:
    with Connection(f"embedded://{db}") as connection:
        yield connection


def qname() -> str:
    return f"q-{uuid.uuid4()}"


def declare(conn: Connection, name: str, **queue_arguments: Any) -> Queue:
    """A plain queue on the default exchange, as the container declares them."""
    queue = Queue(name, Exchange(""), routing_key=name, queue_arguments=queue_arguments or None)
    queue(conn.default_channel).declare()
    return queue


def publish(conn: Connection, name: str, body: Any, **kwargs: Any) -> None:
    Producer(conn.default_channel).publish(body, exchange="", routing_key=name, **kwargs)


def get(conn: Connection, queue: Queue) -> Message | None:
    return queue(conn.default_channel).get(no_ack=False)


def run_python(db: str, code: str, timeout: float = 15) -> str:
    """Run `code` in a new interpreter with ``DB`` set; return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", _prelude(db) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _prelude(db: str) -> str:
    return f"import json, time, kombu\nimport mdbcontainer.embedded\nDB = {db!r}\n"


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


# ------------------------------------------------------------------ basics ---


def test_url_and_transport_class_forms(db: str) -> None:
    with Connection(f"embedded://{db}") as c1, Connection(hostname=db, transport=Transport) as c2:
        assert isinstance(c1.transport, Transport)
        name = qname()
        declare(c1, name)
        publish(c1, name, {"n": 1})
        message = get(c2, Queue(name, Exchange(""), routing_key=name))
        assert message is not None and message.payload == {"n": 1}
        message.ack()
    assert Path(db).exists()


def test_publish_consume_ack(conn: Connection, db: str) -> None:
    name = qname()
    queue = declare(conn, name)
    publish(conn, name, {"n": 1}, headers={"h": "v"}, message_id="m-1")
    assert queue(conn.default_channel).queue_declare(passive=True).message_count == 1

    seen: list[Message] = []
    with Consumer(conn, [queue], callbacks=[lambda body, m: seen.append(m)], prefetch_count=1):
        conn.drain_events(timeout=2)
    (message,) = seen
    assert message.payload == {"n": 1}
    assert message.headers == {"h": "v", "x-delivery-count": 0}
    assert message.properties["message_id"] == "m-1"
    assert message.delivery_info["redelivered"] is False
    assert len(browse(db, name)) == 1 and browse(db, name)[0]["claimed"] is True
    message.ack()
    assert browse(db, name) == []


def test_reject_requeue_keeps_head_and_counts(conn: Connection) -> None:
    name = qname()
    queue = declare(conn, name)
    for n in range(3):
        publish(conn, name, {"n": n})
    first = get(conn, queue)
    assert first is not None and first.payload == {"n": 0}
    first.requeue()

    again = get(conn, queue)
    assert again is not None and again.payload == {"n": 0}
    assert again.delivery_info["redelivered"] is True
    assert again.headers["x-delivery-count"] == 1
    again.requeue()
    third = get(conn, queue)
    assert third is not None and third.headers["x-delivery-count"] == 2
    third.ack()
    rest = [get(conn, queue) for _ in range(2)]
    assert [m.payload["n"] for m in rest if m] == [1, 2]


def test_reject_without_requeue_deletes(conn: Connection, db: str) -> None:
    name = qname()
    queue = declare(conn, name)
    publish(conn, name, "x")
    message = get(conn, queue)
    assert message is not None
    message.reject()
    assert browse(db, name) == []


def test_close_hands_back_unacked_at_head_without_counting(db: str) -> None:
    name = qname()
    with Connection(f"embedded://{db}") as conn:
        queue = declare(conn, name)
        for n in range(2):
            publish(conn, name, {"n": n})
        held = get(conn, queue)
        assert held is not None and held.payload == {"n": 0}
    with Connection(f"embedded://{db}") as conn:
        message = get(conn, queue)
        assert message is not None and message.payload == {"n": 0}
        assert message.delivery_info["redelivered"] is True
        assert message.headers["x-delivery-count"] == 0  # a hand-back is no failure


def test_multiple_ack(conn: Connection, db: str) -> None:
    name = qname()
    queue = declare(conn, name)
    for n in range(3):
        publish(conn, name, n)
    messages = [get(conn, queue) for _ in range(3)]
    assert all(messages)
    messages[1].ack(multiple=True)  # type: ignore[union-attr]
    assert [m["body"] for m in browse(db, name)] == [b"2"]


def test_no_ack_consumer_takes_messages(conn: Connection, db: str) -> None:
    name = qname()
    queue = declare(conn, name)
    publish(conn, name, "x")
    seen: list[Any] = []
    with Consumer(conn, [queue], callbacks=[lambda body, m: seen.append(body)], no_ack=True):
        conn.drain_events(timeout=2)
    assert seen == ["x"]
    assert browse(db, name) == []


def test_purge_size_delete(conn: Connection) -> None:
    name = qname()
    queue = declare(conn, name)
    for n in range(3):
        publish(conn, name, n)
    bound = queue(conn.default_channel)
    held = bound.get()
    assert bound.queue_declare(passive=True).message_count == 2
    assert bound.purge() == 2
    assert held is not None
    held.ack()
    bound.delete()
    with pytest.raises(amqp.exceptions.NotFound):
        bound.queue_declare(passive=True)


# --------------------------------------------------------- RabbitMQ errors ---


def test_passive_declare_of_missing_queue_is_404(conn: Connection) -> None:
    queue = Queue(qname(), Exchange(""), routing_key="x")
    with pytest.raises(kombu.exceptions.ChannelError) as info:
        queue(conn.default_channel).queue_declare(passive=True)
    assert isinstance(info.value, amqp.exceptions.NotFound)
    assert info.value.reply_code == 404


def test_redeclare_with_other_arguments_fails(conn: Connection) -> None:
    name = qname()
    declare(conn, name, **{"x-max-priority": 5})
    declare(conn, name, **{"x-max-priority": 5})
    with pytest.raises(amqp.exceptions.PreconditionFailed):
        declare(conn, name)


def test_mandatory_publish_without_route_raises(conn: Connection) -> None:
    with pytest.raises(NoRoute) as info:
        publish(conn, qname(), "lost", mandatory=True)
    assert info.value.reply_code == 312
    publish(conn, qname(), "dropped")  # not mandatory: dropped, as RabbitMQ does


# ------------------------------------------------------------- exchanges ---


def test_topic_binding_routes_across_connections(db: str) -> None:
    topic = Exchange("orders.created", type="topic")
    sub, other = qname(), qname()
    with Connection(f"embedded://{db}") as binder:
        Queue(sub, topic, routing_key="#")(binder.default_channel).declare()
        Queue(other, topic, routing_key="orders.*.eu")(binder.default_channel).declare()
    with Connection(f"embedded://{db}") as publisher:
        producer = Producer(publisher.default_channel)
        producer.publish({"id": 1}, exchange="orders.created", routing_key="orders.created")
        producer.publish({"id": 2}, exchange="orders.created", routing_key="orders.x.eu")
    assert [m["body"] for m in browse(db, sub)] == [b'{"id": 1}', b'{"id": 2}']
    assert [m["body"] for m in browse(db, other)] == [b'{"id": 2}']


def test_fanout_unbind_and_exchange_delete(conn: Connection, db: str) -> None:
    fanout = Exchange("fan", type="fanout")
    a, b = qname(), qname()
    qa = Queue(a, fanout, routing_key="ignored")(conn.default_channel)
    qa.declare()
    Queue(b, fanout)(conn.default_channel).declare()
    Producer(conn.default_channel).publish("one", exchange="fan", routing_key="k")
    qa.unbind_from(fanout, routing_key="ignored")
    Producer(conn.default_channel).publish("two", exchange="fan", routing_key="k")
    assert [len(browse(db, a)), len(browse(db, b))] == [1, 2]
    fanout(conn.default_channel).delete()
    with pytest.raises(amqp.exceptions.NotFound):
        Producer(conn.default_channel).publish("three", exchange="fan", routing_key="k")


@pytest.mark.parametrize(
    ("key", "routing_key", "match"),
    [
        ("#", "", True),
        ("#", "a.b.c", True),
        ("a.#", "a", True),
        ("a.#.c", "a.c", True),
        ("a.#.c", "a.b.b.c", True),
        ("a.*", "a", False),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("*.b.#", "a.b", True),
        ("a.b", "a.b", True),
        ("a.b", "a.bc", False),
    ],
)
def test_topic_matching(key: str, routing_key: str, match: bool) -> None:
    assert topic_matches(key, routing_key) is match


# ------------------------------------------------ priority, TTL, persistence ---


def test_priority_queue_orders_by_priority_then_fifo(conn: Connection) -> None:
    prio, plain = qname(), qname()
    pq = declare(conn, prio, **{"x-max-priority": 5})
    fq = declare(conn, plain)
    for n, priority in enumerate([1, 9, 5, 1]):  # 9 is capped at 5
        publish(conn, prio, n, priority=priority)
        publish(conn, plain, n, priority=priority)
    assert [m.payload for m in (get(conn, pq) for _ in range(4)) if m] == [1, 2, 0, 3]
    assert [m.payload for m in (get(conn, fq) for _ in range(4)) if m] == [0, 1, 2, 3]


def test_expired_messages_are_dropped_or_dead_lettered(conn: Connection, db: str) -> None:
    dead = qname()
    declare(conn, dead)
    source = declare(
        conn, qname(), **{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
    )
    plain = declare(conn, qname())
    for queue in (source, plain):
        publish(conn, queue.name, "old", expiration=0.05)
        publish(conn, queue.name, "new")
    time.sleep(0.1)
    for queue in (source, plain):
        message = get(conn, queue)
        assert message is not None and message.payload == "new"
        message.ack()
    (lettered,) = browse(db, dead)
    assert lettered["body"] == b"old"
    assert "expiration" not in lettered["properties"]
    death = lettered["headers"]["x-death"][0]
    assert (death["queue"], death["reason"], death["count"]) == (source.name, "expired", 1)
    assert lettered["headers"]["x-first-death-reason"] == "expired"


def test_state_survives_reopen(db: str) -> None:
    topic = Exchange("events", type="topic")
    name = qname()
    with Connection(f"embedded://{db}") as conn:
        Queue(name, topic, routing_key="#")(conn.default_channel).declare()
    with Connection(f"embedded://{db}") as conn:
        Producer(conn.default_channel).publish({"k": 1}, exchange="events", routing_key="a.b")
    with Connection(f"embedded://{db}") as conn:
        message = conn.SimpleQueue(Queue(name, topic, routing_key="#")).get(timeout=2)
        assert message.payload == {"k": 1}
        message.ack()


# ------------------------------------------------------------ processes ---


def test_message_crosses_processes(db: str, conn: Connection) -> None:
    name = qname()
    declare(conn, name)
    run_python(
        db,
        f"""
        with kombu.Connection("embedded://" + DB) as c:
            kombu.Producer(c.default_channel).publish({{"from": "child"}}, routing_key={name!r})
        """,
    )
    message = get(conn, Queue(name, Exchange(""), routing_key=name))
    assert message is not None and message.payload == {"from": "child"}
    message.ack()

    publish(conn, name, {"from": "parent"})
    out = run_python(db, _consume_one_code(name))
    assert json.loads(out) == {"body": {"from": "parent"}, "redelivered": False, "count": 0}


def _consume_one_code(name: str, then: str = "m.ack()") -> str:
    return f"""
        with kombu.Connection("embedded://" + DB) as c:
            q = c.SimpleQueue({name!r})
            m = q.get(timeout=5)
            print(json.dumps({{"body": m.payload, "redelivered": m.delivery_info["redelivered"],
                              "count": m.headers["x-delivery-count"]}}), flush=True)
            {then}
        """


def test_killed_consumer_message_is_redelivered(db: str, conn: Connection) -> None:
    name = qname()
    conn.SimpleQueue(name).put({"poison": True})
    code = _prelude(db) + textwrap.dedent(_consume_one_code(name, then="time.sleep(60)"))
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO, env=_env()
    )
    try:
        assert child.stdout is not None
        assert json.loads(child.stdout.readline())["count"] == 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
    assert browse(db, name)[0]["claimed"] is True

    out = run_python(db, _consume_one_code(name))
    assert json.loads(out) == {"body": {"poison": True}, "redelivered": True, "count": 1}


def test_concurrent_declares_from_processes(tmp_path: Path) -> None:
    db = str(tmp_path / "fresh.db")  # schema creation races too
    start = time.time() + 1.0
    code = _prelude(db) + textwrap.dedent(
        f"""
        ex = kombu.Exchange("t", type="topic")
        q = kombu.Queue("shared", ex, routing_key="#", queue_arguments={{"x-max-priority": 3}})
        time.sleep(max(0.0, {start!r} - time.time()))
        with kombu.Connection("embedded://" + DB) as c:
            for _ in range(5):
                q(c.default_channel).declare()
            kombu.Producer(c.default_channel).publish("hi", exchange="t", routing_key="a")
        """
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=_env(), stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    for child in children:
        _, err = child.communicate(timeout=15)
        assert child.returncode == 0, err
    assert len(browse(db, "shared")) == 4


def test_module_registers_alias() -> None:
    from kombu.transport import TRANSPORT_ALIASES

    assert TRANSPORT_ALIASES["embedded"] == "mdbcontainer.embedded:Transport"
    assert embedded.Transport.implements.exchange_type == frozenset({"direct", "topic", "fanout"})


def test_claims_of_a_channel_closed_without_hand_back_are_released(db: str) -> None:
    name = qname()
    conn = Connection(f"embedded://{db}")
    queue = declare(conn, name)
    publish(conn, name, "held")
    channel = conn.channel()
    assert queue(channel).get() is not None
    channel.qos.restore_at_shutdown = False  # as if the hand-back had failed
    channel.close()
    assert browse(db, name)[0]["claimed"] is True
    with Connection(f"embedded://{db}") as other:  # same process, new channel
        message = get(other, queue)
        assert message is not None and message.delivery_info["redelivered"] is True
        message.ack()
    conn.close()


def test_auto_delete_queue_goes_with_its_last_consumer(conn: Connection, db: str) -> None:
    name = qname()
    queue = Queue(name, Exchange(""), routing_key=name, auto_delete=True)
    queue(conn.default_channel).declare()
    publish(conn, name, "kept until a consumer comes and goes")
    first = Consumer(conn, [queue], callbacks=[lambda body, m: m.ack()])
    second = Consumer(conn, [queue], callbacks=[lambda body, m: m.ack()])
    with first:
        with second:
            assert queue(conn.default_channel).queue_declare(passive=True).consumer_count == 2
        assert queue(conn.default_channel).queue_declare(passive=True).consumer_count == 1
    with pytest.raises(amqp.exceptions.NotFound):
        queue(conn.default_channel).queue_declare(passive=True)


def test_competing_consumer_processes_get_each_message_once(db: str, conn: Connection) -> None:
    name, n = qname(), 400
    declare(conn, name)
    code = _prelude(db) + textwrap.dedent(
        f"""
        from kombu import Consumer, Queue
        seen = []
        with kombu.Connection("embedded://" + DB) as c:
            def on(body, m):
                seen.append(body)
                time.sleep(0.002)  # a little work, so the other poller gets its turn
                m.ack()
            with Consumer(c, [Queue({name!r}, no_declare=True)], callbacks=[on], prefetch_count=5):
                print("ready", flush=True)
                idle = time.time() + 2
                while time.time() - idle < 1.0:
                    try:
                        c.drain_events(timeout=0.2)
                        idle = time.time()
                    except TimeoutError:
                        pass
        print(json.dumps(seen))
        """
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
    for i in range(n):
        publish(conn, name, i)
    results = [json.loads(child.communicate(timeout=20)[0]) for child in children]
    assert sorted(results[0] + results[1]) == list(range(n))
    assert all(results)  # both took part
