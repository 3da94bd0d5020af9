"""Async handlers (README, "Async handlers"): ``async def`` behind the same guarantees.

Every test drives real ``mdb run`` processes on the embedded broker + SQLite and on
RabbitMQ + PostgreSQL (the ``backend`` fixture), with the handlers of
tests/apps/asyncwork.py (a function) and tests/apps/asyncbean.py (a bean with
bean-managed transactions and async setup/teardown).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import mdb, wait_for
from tests.conftest import ROOT, Backend, one_line_error


def async_settings(backend: Backend, port: str = "AsyncWork", queues: dict[str, Any] | None = None,
                   **settings: Any) -> tuple[Path, str]:
    work = backend.q("AWORK")
    path = backend.write(ports={port: {"destination": work, **settings}},
                         queues={work: {}, **(queues or {})})
    return path, work


def send(backend: Backend, path: Path, queue: str, bodies: list[dict[str, Any]],
         prefix: str = "m") -> list[str]:
    ids = [f"{prefix}-{i:04d}" for i in range(len(bodies))]
    with backend.producer(path) as producer:
        for message_id, body in zip(ids, bodies, strict=True):
            producer.send(queue, body, message_id=message_id)
    return ids


@pytest.mark.parametrize("transaction", ["container", "none"])
def test_an_async_handler_commits_each_message_once_with_waits_overlapped(
        backend: Backend, transaction: str) -> None:
    path, work = async_settings(backend, transaction=transaction, concurrency=20)
    bodies = [{"n": i, "action": "sleep", "seconds": 0.5} for i in range(40)]
    ids = send(backend, path, work, bodies)
    with backend.container(path) as container:
        started = time.monotonic()
        wait_for(lambda: len(backend.attempts("AsyncWork")) == 40, timeout=60,
                 what="every message to reach the handler")
        elapsed = time.monotonic() - started
        wait_for(lambda: backend.probe(path).count(work) == 0, timeout=30, what="the queue to drain")
        assert container.terminate() == 0
    # 40 handlers waiting 0.5 s each, 20 at a time: about 1 s, never 20 s one by one.
    assert elapsed < 10, f"the waits did not overlap: {elapsed:.1f}s"
    if transaction == "container":
        assert backend.effects("AsyncWork") == Counter({i: 1 for i in ids})
    assert [a for a in backend.attempts("AsyncWork") if a[3] > 0] == [], "no delivery failed"
