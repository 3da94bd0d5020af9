"""The helpers of ``mdbcontainer.testing`` that users build tests on: they must fail loudly.

A probe that read a misspelt queue as empty, or a process whose database
could not be read as one without ports, would let ``count == 0`` and "not
started yet" assertions pass on a mistake.
"""

from __future__ import annotations

import pytest
from amqp.exceptions import NotFound
from sqlalchemy.exc import OperationalError

from tests.conftest import Backend


def test_a_queue_that_does_not_exist_is_an_error_not_an_empty_queue(backend: Backend) -> None:
    queue, missing = backend.q("Q"), backend.q("NO-SUCH-QUEUE")
    settings = backend.write(ports={"Work": {"destination": queue}})
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1}, message_id="m")
    probe = backend.probe(settings)
    assert (probe.exists(queue), probe.exists(missing)) == (True, False)
    for look in (probe.count, probe.take_all, probe.purge):
        with pytest.raises(NotFound, match=missing):
            look(missing)
    assert probe.count(queue) == 1
    assert [m.properties["message_id"] for m in probe.take_all(queue)] == ["m"]
    assert probe.count(queue) == 0


def test_rows_are_empty_before_the_tables_exist_and_an_unreadable_database_raises(
    backend: Backend,
) -> None:
    settings = backend.write(ports={"Work": {"destination": backend.q("Q")}})
    assert backend.container(settings).rows() == [], "no container has made its tables yet"
    broken = backend.write(name="broken.toml", ports={"Work": {"destination": backend.q("Q")}},
                           database_url="postgresql+psycopg://postgres@127.0.0.1:1/test")
    with pytest.raises(OperationalError, match="port 1 failed"):
        backend.container(broken).rows()
