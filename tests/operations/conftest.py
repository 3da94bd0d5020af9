"""The container's tables of the settings an operation runs with (its PostgreSQL schema, or SQLite)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mdbcontainer.state.store import Store
from tests.conftest import Backend


@pytest.fixture
def store(backend: Backend) -> Iterator[Store]:
    """The tables of the test's database, as an operation's own ``Store`` finds them."""
    store = Store(backend.settings(backend.write("tables.toml", ports={})).container)
    store.create_tables()
    yield store
    store.dispose()
