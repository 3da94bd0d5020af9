"""Port InProc in a ``TestContainer``: the fast tests of the core run on the public test kit.

tests/pipeline and tests/units check one step of the pipeline or one unit
of work; they run the container in the test's own process, as a user's test
does (``mdbcontainer.testing.TestContainer``, on the embedded broker and
SQLite in a temporary folder), and read the port's own figures where a user
would not (``mdb.container.ports["InProc"]``). The handler
(tests/apps/inproc.py) takes its script from ``inproc.FAIL_FIRST`` and
reports each attempt in ``inproc.ATTEMPTS``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from mdbcontainer.runtime.container import Container
from mdbcontainer.runtime.port import ListenerPort
from mdbcontainer.testing import TestContainer, wait_for
from tests.apps import common, inproc
from tests.conftest import Backend


class Running(TestContainer):
    """A TestContainer of port InProc on a fresh queue, ``queue`` its name."""

    __test__ = False

    def __init__(self, queue: str, settings: dict[str, Any]) -> None:
        super().__init__(settings, ports=["InProc"])
        self.queue = queue


def running(*, transaction: str, max_retries: int = 100, **queue: Any) -> Running:
    """Port InProc on a fresh queue (its ``[queues]`` entry: ``queue``), for a ``with`` block."""
    name = f"Q-{uuid.uuid4().hex[:8]}"
    # Maximum retries high: a port that stops at its first failure would hide the pipeline's steps.
    port = {"destination": name, "transaction": transaction, "max_retries": max_retries}
    settings = {
        "container": {"listeners": ["tests.apps.inproc"], "metadata": "tests.apps.common:metadata"},
        "queues": {name: queue},
        "ports": {"InProc": port},
    }
    return Running(name, settings)


@dataclass
class OnBackend:
    container: Container
    queue: str  # port InProc's queue
    settings: Path

    @property
    def port(self) -> ListenerPort:
        return self.container.ports["InProc"]


@contextmanager
def running_on(backend: Backend, *, transaction: str, max_retries: int = 100,
            port_keys: dict[str, Any] | None = None, queues: dict[str, Any] | None = None,
            **queue: Any) -> Iterator[OnBackend]:
    """A ``Container`` (not the kit) with port InProc on a fresh queue of ``backend``, for the tests that
    read the port's own objects (its counter, stats, resources). A container with port InProc on a fresh queue (its ``[queues]`` entry: ``queue``); stopped after.

    ``port_keys``: more keys of the port (``acknowledge``...); ``queues``: more ``[queues]`` entries.
    """
    name = backend.q("Q")
    # Maximum retries high: a port that stops at its first failure would hide the pipeline's steps.
    port = {"destination": name, "transaction": transaction, "max_retries": max_retries, **(port_keys or {})}
    path = backend.write(ports={"InProc": port},
                         queues={name: queue, **(queues or {})}, listeners=["tests.apps.inproc"])
    container = Container(backend.settings(path))
    container.start()
    try:
        wait_for(lambda: container.ports["InProc"].state == "started", what="port InProc started")
        yield OnBackend(container, name, path)
    finally:
        container.stop(timeout=10)
        container.store.dispose()


def attempts(message_id: str) -> list[int]:
    """The redelivery counts the handler saw for ``message_id``, in order."""
    return [count for mid, count in inproc.ATTEMPTS if mid == message_id]


def effects(mdb: TestContainer, message_id: str) -> int:
    """Committed rows of the handler's work for ``message_id``."""
    table = common.effects
    with mdb.session() as session:
        return int(session.scalar(select(func.count()).select_from(table)
                                  .where(table.c.message_id == message_id)) or 0)


def effects_in(backend: Backend, message_id: str) -> int:
    """Committed rows of the handler's work for ``message_id`` in ``backend``'s database."""
    table = common.effects
    with backend.engine.connect() as conn:
        return len(conn.execute(select(table.c.id).where(table.c.message_id == message_id)).all())


def send(backend: Backend, run: OnBackend, message_id: str, **body: Any) -> None:
    with backend.producer(run.settings) as producer:
        producer.send(run.queue, body, message_id=message_id)
