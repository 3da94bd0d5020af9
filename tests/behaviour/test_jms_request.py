"""JMS mechanisms (README): temporary queues and request/reply, from code and from ``mdb request``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer import Message, RequestTimeout
from mdbcontainer.testing import mdb, wait_for
from tests.apps.jms import records
from tests.conftest import Backend, jms_settings, on_embedded

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transaction", ["none", "container"])
def test_a_request_gets_its_reply_through_a_temporary_queue(backend: Backend, transaction: str) -> None:
    # With a container transaction the reply leaves through the outbox after the commit;
    # either way it goes to reply_to undeclared (RabbitMQ refuses a declare of another
    # connection's exclusive queue).
    queue = backend.q("SERVICE")
    settings = jms_settings(backend, queue, transaction=transaction)
    with backend.container(settings), backend.producer(settings) as producer:
        reply = producer.request(queue, {"n": 7, "action": "reply"}, timeout="10s",
                                 correlation_id="corr-7")
    assert isinstance(reply, Message)
    assert reply.body == {"echo": 7, "port": "Jms"}
    assert reply.correlation_id == "corr-7"
    request = records(backend.log)[0]
    assert request["correlation_id"] == "corr-7"
    assert request["reply_to"] and request["reply_to"] != queue
    assert not queue_exists(backend, settings, request["reply_to"]), "the temporary queue is gone"


def queue_exists(backend: Backend, settings: Path, name: str) -> bool:
    from amqp.exceptions import NotFound

    from mdbcontainer.wire.connection import Broker

    conn = Broker(backend.settings(settings)).connect()
    try:
        conn.channel().queue_declare(queue=name, passive=True)
        return True
    except NotFound:
        return False
    finally:
        conn.close()


def test_mdb_request_prints_the_reply_and_a_timeout_exits_1(backend: Backend) -> None:
    queue, nobody = backend.q("SERVICE"), backend.q("NOBODY")
    settings = jms_settings(backend, queue, {queue: {}, nobody: {}}, transaction="none")
    with backend.container(settings):
        result = mdb("request", queue, '{"n": 3, "action": "reply"}', "--timeout", "10s",
                     settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"echo": 3, "port": "Jms"}

    result = mdb("request", nobody, '{"n": 4}', "--timeout", "1s", settings=settings,
                 env=backend.env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"mdb: error: no reply from '{nobody}' within 1s")


def test_a_late_reply_is_dropped_with_the_temporary_queue(backend: Backend) -> None:
    queue = backend.q("SLOWSERVICE")
    settings = jms_settings(backend, queue, transaction="none")
    with backend.producer(settings) as producer, pytest.raises(RequestTimeout, match="within 0.5s"):
        producer.request(queue, {"n": 1, "action": "reply"}, timeout="500ms")
    with backend.container(settings) as container:  # answers once the requester has gone
        wait_for(lambda: (container.port_state("Jms") or {}).get("handled") == 1,
                 what="the late request handled")
        state = container.port_state("Jms") or {}
    assert (state["state"], state["failed"]) == ("started", 0), "a reply nobody waits for is no failure"


# The refusal comes before anything is sent: the unit of work's rule, whatever the transport.
@on_embedded
@pytest.mark.parametrize("port", [{"transaction": "bean"}, {"transaction": "container"}])
def test_a_request_inside_a_unit_of_work_is_refused_with_the_reason(
    backend: Backend, port: dict[str, Any]
) -> None:
    queue = backend.q("TXREQUEST")
    settings = jms_settings(backend, queue, **port)
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "request", "to": backend.q("OTHER"),
                              "settings": str(settings)})
    with backend.container(settings):
        wait_for(lambda: records(backend.log), what="the handler's attempt")
    error = records(backend.log)[0]["error"]
    assert error.startswith("TransactionError: port 'Jms': request to ")
    assert f"refused inside a unit of work (transaction = '{port['transaction']}')" in error
    assert "leaves only when it commits" in error


def test_a_request_from_a_handler_without_a_unit_of_work_is_sent(backend: Backend) -> None:
    queue, other = backend.q("NOTX"), backend.q("OTHER")
    settings = jms_settings(backend, queue, {queue: {}, other: {}}, transaction="none")
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "request", "to": other, "settings": str(settings)})
    with backend.container(settings):
        wait_for(lambda: records(backend.log), timeout=30, what="the handler's attempt")
    assert records(backend.log)[0]["error"].startswith(f"RequestTimeout: no reply from '{other}'")
    assert backend.probe(settings).count(other) == 1, "the request itself was sent"


def test_a_request_inside_a_transacted_acknowledgment_is_refused(rabbit: Backend) -> None:
    queue = rabbit.q("TXACK")
    settings = jms_settings(rabbit, queue, transaction="none", acknowledge="transacted")
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "request", "to": rabbit.q("OTHER"),
                              "settings": str(settings)})
    with rabbit.container(settings):
        wait_for(lambda: records(rabbit.log), what="the handler's attempt")
    assert "refused inside a unit of work (acknowledge = 'transacted')" in records(rabbit.log)[0]["error"]
