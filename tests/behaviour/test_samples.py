"""Every walk-through in samples/ runs to the end and shows what it promises (exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SAMPLES = ROOT / "samples"
# What each transcript must show, beyond the sample's own checks (which decide its exit code).
SHOWN = {
    "poison_walkthrough": ["maximum retries (0) exceeded", "SYSTEM.DEAD.LETTER.QUEUE: 1 message(s)",
                           "poison message poison (redelivery count 4)"],
    "bmt_once_only": ["mdb run exited with -9", "alice 15, bob 20"],
    "request_reply": ["'price': '9.99'", '{"sku": "B-2", "price": "24.50"}', "RequestTimeout",
                      "Unroutable: queue 'PRICE' does not exist"],
    "durable_subscription": ["holds 3 events", "audit: 3, 4, 5 (missed) and 6"],
    "async_quotes": ["50 at a time", "200 quotes stored, each exactly once"],
    "batch_orders": ["not 200 commits", "1 fallbacks", "backout queue: ['order-bad']",
                     "230 orders stored, each exactly once"],
    "web_orders": ["20 orders placed (201)", "20 orders confirmed by the port, each once",
                   "POST /orders {order_id: 99, amount: -5}: 422", "no event for order 99 ever left",
                   "outbox: no sends waiting"],
}


def test_every_sample_directory_is_run_by_this_test() -> None:
    found = {p.parent.name for p in SAMPLES.glob("*/run.py")}
    assert found == set(SHOWN)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SHOWN))
def test_sample_runs_and_exits_0(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDB_")}
    result = subprocess.run(
        [sys.executable, str(SAMPLES / name / "run.py")], capture_output=True, text=True,
        timeout=240, env={**env, "TMPDIR": str(tmp_path)}, cwd=tmp_path,
    )
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.stdout.rstrip().endswith("sample ok")
    for text in SHOWN[name]:
        assert text in result.stdout, text
    assert not list(tmp_path.glob("mdb-*")), "the scratch directory is removed"
