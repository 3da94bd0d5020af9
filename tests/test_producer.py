"""Sending from outside a handler: ``Producer`` and ``mdb send`` as a user calls them."""

from __future__ import annotations

import pytest
from amqp.exceptions import NotFound

from mdbcontainer import Unroutable
from mdbcontainer.broker import Broker
from mdbcontainer.settings import Settings
from tests.conftest import Backend
from tests.test_cli import mdb, one_line_error


def queue_exists(settings: Settings, name: str) -> bool:
    """A passive declare: the broker's own answer, not a count that reads 0 for a missing queue."""
    conn = Broker(settings).connect()
    try:
        conn.channel().queue_declare(queue=name, passive=True)
    except NotFound:
        return False
    finally:
        conn.close()
    return True


# -- a queue publish is mandatory on every broker (contract section 10) -----------------------


def test_send_to_a_queue_nobody_named_exits_1_naming_it_and_creates_nothing(backend: Backend) -> None:
    typo = backend.q("NO.SUCH.QUEUE")
    path = backend.write(ports={"Work": {"destination": backend.q("WORK")}})
    result = mdb("send", typo, '{"a": 1}', "-c", str(path), env=backend.env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    line = one_line_error(result)
    assert f"queue {typo!r} does not exist" in line
    assert not queue_exists(backend.settings(path), typo)


def test_producer_send_to_a_missing_queue_raises_unroutable(backend: Backend) -> None:
    typo = backend.q("MISSING")
    path = backend.write(ports={"Work": {"destination": backend.q("WORK")}})
    with backend.producer(path) as producer, pytest.raises(Unroutable, match=typo):
        producer.send(typo, {"a": 1})
    assert not queue_exists(backend.settings(path), typo)


def test_a_queue_the_settings_name_is_declared_by_the_first_send(backend: Backend) -> None:
    """A port's destination and a [queues] table are declared before the publish, as the container does."""
    work, table = backend.q("WORK"), backend.q("TABLE")
    path = backend.write(ports={"Work": {"destination": work}}, queues={table: {"max_priority": 9}})
    for queue in (work, table):
        result = mdb("send", queue, '{"a": 1}', "-c", str(path), env=backend.env)
        assert result.returncode == 0, result.stderr
        assert backend.probe(path).count(queue) == 1
