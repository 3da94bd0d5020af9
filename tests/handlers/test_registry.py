"""Handlers that hide an ``async def`` (issue 27, item 7), run by a container in the test's process.

An ``async def`` behind a plain ``functools.wraps`` decorator is still an async
handler: its port awaits it. A synchronous call that returns an awaitable did
not do its work: the delivery fails like an exception (never acknowledged as
handled), and the coroutine is closed, so no "never awaited" warning.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mdbcontainer.handlers.binding import bind
from mdbcontainer.runtime.container import Container
from mdbcontainer.testing import wait_for
from tests.apps import decorated
from tests.conftest import Backend


@contextmanager
def port_of(backend: Backend, name: str, **queue: Any) -> Iterator[tuple[Container, str, Any]]:
    """A container in this process running port ``name`` of tests.apps.decorated on a fresh queue."""
    destination = backend.q(name.upper())
    ports = {other: {"destination": backend.q(other.upper()), "transaction": "none", "max_retries": 100}
             for other in ("Decorated", "Forgetful")}
    path = backend.write(ports=ports, queues={destination: queue}, listeners=["tests.apps.decorated"])
    container = Container(backend.settings(path), ports=[name])
    container.start()
    try:
        wait_for(lambda: container.ports[name].state == "started", what=f"port {name} started")
        yield container, destination, path
    finally:
        container.stop(timeout=10)
        container.store.dispose()


def test_an_async_handler_behind_a_plain_decorator_is_bound_as_async(embedded: Backend) -> None:
    path = embedded.write(ports={"Decorated": {"destination": embedded.q("D")},
                                 "Forgetful": {"destination": embedded.q("F")}},
                          listeners=["tests.apps.decorated"])
    (binding,) = bind(embedded.settings(path), ["Decorated"])
    assert binding.spec.is_async, "functools.wraps leads to an async def: the port awaits it"
    assert binding.spec.signature().is_async


def test_an_async_handler_behind_a_plain_decorator_runs_its_work(embedded: Backend) -> None:
    decorated.DONE.clear()
    with port_of(embedded, "Decorated") as (container, queue, path):
        with embedded.producer(path) as producer:
            producer.send(queue, {"n": 1}, message_id="wrapped-1")
        wait_for(lambda: container.ports["Decorated"].stats.handled == 1, what="handled")
    assert decorated.DONE == ["wrapped-1"], "the coroutine the decorator returned was awaited"
    assert "decorated" in decorated.CALLS, "through the decorator, not around it"


def test_a_def_that_returns_a_coroutine_fails_its_delivery_and_is_never_handled(embedded: Backend,
                                                                               recwarn: Any) -> None:
    decorated.DONE.clear()
    with port_of(embedded, "Forgetful", backout_threshold=2) as (container, queue, path):
        with embedded.producer(path) as producer:
            producer.send(queue, {"n": 1}, message_id="forgot-1")
        wait_for(lambda: embedded.probe(path).count(embedded.q("DLQ")) == 1,
                 what="the message backed out after two failed deliveries")
        stats = container.ports["Forgetful"].stats
        assert (stats.handled, stats.failed) == (0, 2), "each delivery failed, none handled"
    gc.collect()
    assert decorated.DONE == [], "the work was never run"
    (letter,) = embedded.probe(path).take_all(embedded.q("DLQ"))
    assert "coroutine" in str(letter.headers["x-mdb-exception"]), letter.headers
    never_awaited = [w for w in recwarn if "never awaited" in str(w.message)]
    assert not never_awaited, "the coroutine was closed"
