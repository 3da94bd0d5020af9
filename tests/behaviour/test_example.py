"""The README's tour: `mdb run -c settings.example.toml`, `mdb send` from a second shell."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mdbcontainer.testing import ContainerProcess, mdb, wait_for
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_example_settings_run_the_sample_listeners(tmp_path: Path) -> None:
    shutil.copy(ROOT / "settings.example.toml", tmp_path / "settings.example.toml")
    shutil.copytree(ROOT / "listeners", tmp_path / "listeners")
    settings = tmp_path / "settings.example.toml"
    env = {"PYTHONPATH": str(tmp_path)}

    assert mdb("check", settings=settings, env=env).returncode == 0
    with ContainerProcess(settings, cwd=tmp_path, env=env) as container:
        assert "created 1 table(s) of listeners.orders:Base: sample_orders" in container.output()
        sent = mdb("send", "ORDERS", '{"order_id": 1, "amount": "9.99"}', "--id", "order-1",
                   settings=settings, env=env)
        assert sent.returncode == 0, sent.stderr
        wait_for(lambda: "order 1 placed (9.99)" in container.output(), what="the order")
        wait_for(lambda: "audit #1: {'order_id': 1, 'event': 'placed'}" in container.output(),
                 what="the audit bean's event from the outbox")
        again = mdb("send", "ORDERS", '{"order_id": 1, "amount": "9.99"}', "--id", "order-1",
                    settings=settings, env=env)
        assert again.returncode == 0
        assert mdb("send", "ORDERS", '{"order_id": "x"}', "--id", "bad", settings=settings,
                   env=env).returncode == 0
        wait_for(lambda: "moved to SYSTEM.DEAD.LETTER.QUEUE (invalid-body" in container.output(),
                 what="the invalid order backed out")
        assert container.output().count("order 1 placed") == 1, "the duplicate was skipped"
        assert container.terminate() == 0
    assert (tmp_path / ".mdb" / "broker.db").exists(), "the embedded broker lives in .mdb/"
