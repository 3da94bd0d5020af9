"""The container's tables on a real database: SQLite in the test's directory, and PostgreSQL in a schema of its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mdbcontainer.settings import Settings
from mdbcontainer.state.store import Store
from tests.conftest import Backend


@pytest.fixture
def settings(backend: Backend) -> Settings:
    """Settings on the test's broker and database (a PostgreSQL schema of its own, dropped after)."""
    return backend.settings(backend.write(ports={}))


@pytest.fixture
def store(settings: Settings) -> Iterator[Store]:
    """The container's tables, created as a container creates them at start."""
    store = Store(settings.container)
    store.create_tables()
    yield store
    store.dispose()
