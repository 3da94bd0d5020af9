"""The poison-message scenarios of the README's tour, replayed on the embedded broker and on RabbitMQ + PostgreSQL.

One poison message (its handler always raises) among good ones, under the
listener port's Maximum retries and the queue's backout threshold.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mdbcontainer.testing import headers_of, mdb, wait_for
from tests.conftest import Backend

pytestmark = pytest.mark.slow


def send_all(backend: Backend, settings: Path, queue: str, bodies: list[tuple[str, dict]]) -> None:
    with backend.producer(settings) as producer:
        for message_id, body in bodies:
            producer.send(queue, body, message_id=message_id)


def test_defaults_stop_the_port_at_each_failure_and_back_out_after_five(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    settings = backend.write(
        ports={"Work": {"destination": queue, "prefetch": 1}},
        queues={queue: {}},
    )
    send_all(backend, settings, queue, [
        ("good-1", {"n": 1}), ("poison", {"n": 2, "action": "fail"}),
        ("good-2", {"n": 3}), ("good-3", {"n": 4}),
    ])
    with backend.container(settings).start(wait=False) as container:
        for failures in range(1, 6):
            def stopped(failures: int = failures) -> bool:
                state = container.port_state("Work") or {}
                poison = [a for a in backend.attempts() if a[1] == "poison"]
                return (state.get("state") == "stopped" and len(poison) == failures
                        and "maximum retries (0) exceeded" in state.get("reason", ""))

            wait_for(stopped, what=f"stop #{failures}")
            poison = [a for a in backend.attempts() if a[1] == "poison"]
            assert [a[3] for a in poison] == list(range(failures))
            assert backend.effects() == {"good-1": 1}, "nothing behind the poison message ran"
            result = mdb("port", "start", "Work", settings=settings, env=backend.env)
            assert result.returncode == 0, result.stderr
            if failures < 5:
                wait_for(lambda f=failures: len([a for a in backend.attempts() if a[1] == "poison"]) > f,
                         what="one more delivery")
        wait_for(lambda: backend.effects() == {"good-1": 1, "good-2": 1, "good-3": 1},
                 what="good messages behind the poison one")
        assert len([a for a in backend.attempts() if a[1] == "poison"]) == 5
    dead = backend.probe(settings).take_all(backend.q("DLQ"))
    assert len(dead) == 1
    headers = headers_of(dead[0])
    assert dead[0].properties["message_id"] == "poison"
    assert headers["x-mdb-redelivery-count"] == 5
    assert headers["x-mdb-original-destination"] == queue
    assert headers["x-mdb-port"] == "Work"
    assert "RuntimeError: poison message 2" in headers["x-mdb-exception"]
    assert backend.probe(settings).count(queue) == 0


def test_max_retries_at_threshold_never_stops_and_delivers_poison_exactly_five_times(
    backend: Backend,
) -> None:
    queue = backend.q("ORDERS")
    settings = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 5, "prefetch": 1}},
        queues={queue: {"backout_threshold": 5}},
    )
    send_all(backend, settings, queue, [("poison", {"n": 1, "action": "fail"})]
             + [(f"good-{i}", {"n": i}) for i in range(2, 6)])
    with backend.container(settings) as container:
        wait_for(lambda: len(backend.effects()) == 4, what="good messages")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
        assert container.port_state("Work")["state"] == "started"
        wait_for(lambda: container.port_state("Work")["backed_out"] == 1, timeout=5,
                 what="the backout in the port's figures (written each control_interval)")
    poison = [a for a in backend.attempts() if a[1] == "poison"]
    assert [a[3] for a in poison] == [0, 1, 2, 3, 4]
    assert set(backend.effects().values()) == {1}


def test_threshold_zero_loops_until_the_port_stops_and_the_message_stays(backend: Backend) -> None:
    queue = backend.q("MQ.DEFAULT")
    settings = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 3, "prefetch": 1}},
        queues={queue: {"backout_threshold": 0}},
    )
    send_all(backend, settings, queue, [("poison", {"n": 1, "action": "fail"})])
    with backend.container(settings).start(wait=False) as container:
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "stopped",
                 what="the port to stop")
        assert len(backend.attempts()) == 4, "max_retries + 1 consecutive failures"
    assert backend.probe(settings).count(queue) == 1
    assert backend.probe(settings).count(backend.q("DLQ")) == 0


def test_figure_two_csinput_queue_threshold_one_moves_after_first_rollback(transport: Backend) -> None:
    queue = transport.q("CSINPUT_QUEUE")
    dlq = transport.q("SYSTEM.DEAD.LETTER.QUEUE")
    settings = transport.write(
        ports={"Work": {"destination": queue, "max_retries": 5}},
        queues={queue: {"backout_threshold": 1, "backout_queue": dlq}},
    )
    send_all(transport, settings, queue, [("m1", {"n": 1, "action": "rollback"})])
    with transport.container(settings) as container:
        wait_for(lambda: transport.probe(settings).count(dlq) == 1, what="backout")
        assert container.port_state("Work")["state"] == "started"
    assert len(transport.attempts()) == 1
    assert transport.effects() == {}, "the rolled-back work is not committed"
    moved = transport.probe(settings).take_all(dlq)[0]
    assert headers_of(moved)["x-mdb-redelivery-count"] == 1
    assert "set_rollback_only" in headers_of(moved)["x-mdb-exception"]


def test_handler_choices_move_and_discard(backend: Backend) -> None:
    queue = backend.q("IN")
    elsewhere = backend.q("ELSEWHERE")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}, elsewhere: {}})
    send_all(backend, settings, queue, [
        ("moved", {"n": 1, "action": "move", "to": elsewhere}), ("kept", {"n": 2}),
    ])
    with backend.container(settings):
        probe = backend.probe(settings)  # the move declares the queue
        wait_for(lambda: probe.exists(elsewhere) and probe.count(elsewhere) == 1, what="move_to")
        wait_for(lambda: "kept" in backend.effects(), what="next message")
    moved = backend.probe(settings).take_all(elsewhere)[0]
    assert moved.properties["message_id"] == "moved"
    assert headers_of(moved)["x-mdb-backout-reason"] == "moved by the handler"
    assert backend.effects()["moved"] == 1, "move_to commits with the handler's work"
