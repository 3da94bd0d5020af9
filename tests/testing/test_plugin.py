"""The pytest plugin (mdbcontainer/testing/plugin.py): the fixture ``mdb`` in a project of a user's.

Each test writes a small project (settings, a listener module, its tests) and
runs pytest on it with ``pytester``: nothing is imported from mdbcontainer in
the project's tests, the plugin comes from the package's entry point.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

LISTENER = '''
from pydantic import BaseModel
from mdbcontainer import MessageContext, message_driven

class Placed(BaseModel):
    order_id: int

@message_driven("{port}")
def on_order(order: Placed, ctx: MessageContext) -> None:
    if order.order_id < 0:
        raise ValueError(f"order {{order.order_id}} refused")
'''

SETTINGS = '''
[container]
listeners = ["{module}"]

[queues.ORDERS]
backout_threshold = 2

[ports.{port}]
destination = "ORDERS"
max_retries = 5
'''

TESTS = '''
def test_an_order_is_handled_once(mdb):
    mdb.send("ORDERS", {"order_id": 1}, message_id="o-1")
    mdb.send("ORDERS", {"order_id": 1}, message_id="o-1")
    mdb.drain()
    assert mdb.outcomes("{port}") == {"handled": 1, "duplicate_skipped": 1}

def test_a_refused_order_fails_the_test(mdb):
    mdb.send("ORDERS", {"order_id": -1}, message_id="o-2")
    mdb.drain()
    assert mdb.outcomes("{port}") == {"handled": 1}
'''


def project(pytester: pytest.Pytester, port: str, settings_name: str) -> None:
    module = f"pt_{port.lower()}"
    pytester.makepyfile(**{module: LISTENER.format(port=port)})
    pytester.makefile(".toml", **{settings_name: SETTINGS.format(module=module, port=port)})
    pytester.makepyfile(test_orders=TESTS.replace("{port}", port))


def test_the_mdb_fixture_runs_the_settings_of_the_ini_option(pytester: pytest.Pytester) -> None:
    project(pytester, "PtIniOrders", "app_settings")
    pytester.makeini("[pytest]\nmdb_settings = app_settings.toml\n")
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    # The failing test shows the handler's traceback and what the container did with the message.
    result.stdout.fnmatch_lines([
        "*mdbcontainer: failed deliveries*",
        "*message o-2 on port PtIniOrders:*",
        "*Traceback (most recent call last):*",
        "*ValueError: order -1 refused*",
        "*backed_out: port PtIniOrders: backed out: message o-2*",
    ])


class Config:
    """What the plugin reads of pytest's config: the option, the ini value and the ini file."""

    def __init__(self, option: str | None, ini: str, inipath: Path | None) -> None:
        self.option, self.ini, self.inipath, self.rootpath = option, ini, inipath, Path("/root-dir")

    def getoption(self, name: str) -> str | None:
        assert name == "mdb_settings"
        return self.option

    def getini(self, name: str) -> str:
        assert name == "mdb_settings"
        return self.ini


def test_the_mdb_settings_option_wins_over_the_ini_option_which_is_relative_to_its_file() -> None:
    from mdbcontainer.testing.plugin import _settings_of

    ini = Path("/project/pytest.ini")
    assert _settings_of(Config("given.toml", "app.toml", ini)) == Path("given.toml")  # type: ignore[arg-type]
    assert _settings_of(Config(None, "app.toml", ini)) == Path("/project/app.toml")  # type: ignore[arg-type]
    assert _settings_of(Config(None, "", ini)) is None  # type: ignore[arg-type]
