"""The container in the test's own process, on the embedded broker: the core without ``mdb run``.

A behaviour test (tests/behaviour) starts ``mdb run`` as a real process and
pays for its start; these start ``Container`` in a thread-backed form inside
pytest, so a check of the pipeline or of a unit of work takes a fraction of a
second and can read the port's own figures (``port.stats``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from mdbcontainer.runtime.container import Container
from mdbcontainer.runtime.port import ListenerPort
from mdbcontainer.testing import wait_for
from tests.apps import common, inproc
from tests.conftest import Backend


@dataclass
class Running:
    container: Container
    queue: str  # port InProc's queue
    settings: Path

    @property
    def port(self) -> ListenerPort:
        return self.container.ports["InProc"]


@contextmanager
def running(backend: Backend, *, transaction: str, max_retries: int = 100,
            **queue: Any) -> Iterator[Running]:
    """A container with port InProc on a fresh queue (its ``[queues]`` entry: ``queue``); stopped after."""
    name = backend.q("Q")
    # Maximum retries high: a port that stops at its first failure would hide the pipeline's steps.
    port = {"destination": name, "transaction": transaction, "max_retries": max_retries}
    path = backend.write(ports={"InProc": port},
                         queues={name: queue}, listeners=["tests.apps.inproc"])
    container = Container(backend.settings(path))
    container.start()
    try:
        wait_for(lambda: container.ports["InProc"].state == "started", what="port InProc started")
        yield Running(container, name, path)
    finally:
        container.stop(timeout=10)
        container.store.dispose()


def attempts(message_id: str) -> list[int]:
    """The redelivery counts the handler saw for ``message_id``, in order."""
    return [count for mid, count in inproc.ATTEMPTS if mid == message_id]


def effects(backend: Backend, message_id: str) -> int:
    """Committed rows of the handler's work for ``message_id``."""
    table = common.effects
    with backend.engine.connect() as conn:
        return len(conn.execute(select(table.c.id).where(table.c.message_id == message_id)).all())


def send(backend: Backend, run: Running, message_id: str, **body: Any) -> None:
    with backend.producer(run.settings) as producer:
        producer.send(run.queue, body, message_id=message_id)
