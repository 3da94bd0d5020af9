"""The pytest plugin (entry point ``mdbcontainer``): the fixture ``mdb``, with nothing to import.

``mdb`` is a running :class:`~mdbcontainer.testing.TestContainer` of the
settings named by ``--mdb-settings`` or the ``mdb_settings`` ini option
(relative to the ini file's folder), else of the usual lookup
(``$MDB_SETTINGS``, ``./settings.toml``). A test that fails shows, in a
section of its report, every delivery that failed during it: the handler's
traceback and what the container did (requeued, backed out, port stopped).

The kit is imported when the fixture is first used, not when pytest starts:
a test run that never asks for ``mdb`` does not pay for the container.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_REPORT = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mdbcontainer")
    group.addoption("--mdb-settings", dest="mdb_settings", default=None,
                    help="settings file of the mdb fixture (default: the mdb_settings ini option)")
    parser.addini("mdb_settings", "settings file of the mdb fixture, relative to the ini file",
                  default="")


def _settings_of(config: pytest.Config) -> Path | None:
    given = config.getoption("mdb_settings")
    if given:
        return Path(given)
    ini = str(config.getini("mdb_settings") or "")
    if not ini:
        return None
    base = config.inipath.parent if config.inipath else config.rootpath
    return base / ini


@pytest.fixture
def mdb(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A running TestContainer of the configured settings, stopped after the test."""
    from .kit import TestContainer

    kit = TestContainer(_settings_of(request.config))
    request.node.stash[_REPORT] = kit.failures
    with kit:
        yield kit


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    failures = item.stash.get(_REPORT, None)
    if report.failed and failures:
        report.sections.append(("mdbcontainer: failed deliveries", failures.report()))
    return report
