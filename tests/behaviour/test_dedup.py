"""The dedup table's housekeeping: batched purges past retention, one purger at a time."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select, text

from mdbcontainer.settings import load_settings
from mdbcontainer.state.dedup import Dedup
from mdbcontainer.state.store import Store, utcnow
from mdbcontainer.testing import mdb
from tests.conftest import Backend


def fill(store: Store, port: str, count: int, age: timedelta) -> None:
    stamp = utcnow() - age
    rows = [{"port": port, "message_id": f"{port}-{age.days}-{i}", "processed_at": stamp}
            for i in range(count)]
    with store.engine.begin() as conn:
        conn.execute(insert(store.tables.dedup), rows)


_stores: list[Store] = []


def dedup_store(backend: Backend) -> Store:
    settings_path = backend.write(ports={"Work": {"destination": backend.q("D")}})
    store = Store(load_settings(settings_path, environ={}).container)
    store.create_tables()
    _stores.append(store)
    return store


@pytest.fixture(autouse=True)
def _dispose_stores() -> object:
    yield
    while _stores:
        _stores.pop().dispose()


def test_purge_deletes_only_rows_past_retention_in_batches(backend: Backend) -> None:
    store = dedup_store(backend)
    fill(store, "P", 2500, timedelta(days=10))
    fill(store, "P", 300, timedelta(days=1))
    dedup = Dedup(store)
    batches: list[int] = []
    original = dedup._purge_batch

    def counting(cutoff: object, batch: int) -> int:
        removed = original(cutoff, batch)
        batches.append(removed)
        return removed

    dedup._purge_batch = counting  # type: ignore[method-assign]
    assert dedup.purge(timedelta(days=7)) == 2500
    assert batches == [1000, 1000, 500], "short transactions, never one huge DELETE"
    assert dedup.count("P") == 300


def test_mdb_dedup_purge_command(backend: Backend) -> None:
    store = dedup_store(backend)
    fill(store, "Work", 50, timedelta(days=3))
    result = mdb("dedup", "purge", "--older-than", "2d", settings=backend.tmp / "settings.toml",
                 env=backend.env)
    assert result.returncode == 0, result.stderr
    assert "removed 50 dedup row(s) older than 2d" in result.stdout
    assert Dedup(store).count() == 0


@pytest.mark.postgres
def test_one_purger_at_a_time_and_claims_are_not_blocked(rabbit: Backend) -> None:
    store = dedup_store(rabbit)
    fill(store, "P", 3000, timedelta(days=30))
    dedup = Dedup(store)
    with store.engine.connect() as holder:
        assert dedup._lock(holder), "first purger takes the advisory lock"
        assert dedup.purge(timedelta(days=7)) == 0, "a second purger backs off"
        dedup._unlock(holder)
    claimed: list[bool] = []

    def claims() -> None:
        session = store.session()
        for i in range(50):
            with session.begin():
                claimed.append(dedup.claim(session, "Live", f"new-{i}"))
        session.close()

    worker = threading.Thread(target=claims)
    worker.start()
    assert dedup.purge(timedelta(days=7)) == 3000
    worker.join(30)
    assert claimed == [True] * 50, "deliveries claim their rows while a purge runs"
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(store.tables.dedup)).scalar() == 50


@pytest.mark.postgres
def test_a_purge_in_another_schema_does_not_hold_this_one_back(rabbit: Backend) -> None:
    """Two services in one database keep their tables in their own schemas: one
    service's purge in progress must not make the other's purge give up."""
    store = dedup_store(rabbit)
    fill(store, "P", 40, timedelta(days=30))
    schema = f"{rabbit.schema}_other"
    with rabbit.engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        settings_path = rabbit.write(ports={"Work": {"destination": rabbit.q("D")}},
                                     name="other.toml", db_schema=schema)
        other = Store(load_settings(settings_path, environ={}).container)
        _stores.append(other)
        other.create_tables()
        with other.engine.connect() as holder:
            assert Dedup(other)._lock(holder), "the other service's purger holds its lock"
            try:
                assert Dedup(store).purge(timedelta(days=7)) == 40
            finally:
                Dedup(other)._unlock(holder)
    finally:
        with rabbit.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
