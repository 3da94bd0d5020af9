"""``mdb ports`` sees a container from the moment it logs that it started (README: The `mdb` command).

The heartbeat is written at start, before the "container started" line, and
again at every port state change, so neither waits for ``control_interval``
(set far longer than these tests wait).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from mdbcontainer.settings import load_settings
from mdbcontainer.state.control import Control
from mdbcontainer.state.store import Store, utcnow
from mdbcontainer.testing import mdb, wait_for, write_settings
from tests.conftest import Backend

# Longer than any wait below: what these tests see was written by a state change, not a poll.
SLOW_POLL = "60s"


def ports_json(backend: Backend, settings: object) -> list[dict[str, object]]:
    result = mdb("ports", "--json", "-c", str(settings), env=backend.env)
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, object]] = json.loads(result.stdout)
    return rows


@pytest.mark.slow
def test_ports_show_the_container_when_it_logs_its_start_and_each_state_change(
    backend: Backend,
) -> None:
    queue = backend.q("SEEN")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 0}},
                             queues={queue: {"backout_threshold": 0}}, control_interval=SLOW_POLL)
    with backend.container(settings).start(wait=False) as container:
        wait_for(lambda: " started: 1 port(s)" in container.output(), what="the start line")
        [row] = container.rows()
        assert row["port"] == "Work", "listed as soon as it started"
        assert row["state"] in {"starting", "started"}, "a port on its way up is not shown stopped"

        began = time.monotonic()
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "started",
                 timeout=8, what="the port's started state, long before the next poll")
        assert [r["state"] for r in ports_json(backend, settings)] == ["started"]

        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "fail"}, message_id="poison")
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "stopped",
                 timeout=8, what="the port stopped by Maximum retries")
        [row] = ports_json(backend, settings)
        assert row["state"] == "stopped" and "maximum retries" in str(row["reason"])
        assert time.monotonic() - began < 20, "both changes seen well within one control_interval"


def test_a_container_polling_slowly_stays_listed_between_its_heartbeats(tmp_path: Path) -> None:
    """Fresh is three heartbeats of control_interval (at least 10s): with "30s", a heartbeat
    taken 15s ago is a running container, not a gone one."""

    def settings(interval: str) -> Path:
        return write_settings(tmp_path / f"settings-{interval}.toml", {"container": {
            "broker_url": f"embedded://{tmp_path / 'b.db'}", "listeners": [],
            "database_url": f"sqlite:///{tmp_path / 'd.db'}", "control_interval": interval}})

    slow, fast = settings("30s"), settings("1s")
    store = Store(load_settings(slow, environ={}).container)
    store.create_tables()
    control = Control(store)
    control.register()
    control.heartbeat([{"port": "Slow", "state": "started"}])
    with store.engine.begin() as conn:
        conn.execute(update(store.tables.container).values(heartbeat_at=utcnow() - timedelta(seconds=15)))
    store.dispose()
    listed = json.loads(mdb("ports", "--json", "-c", str(slow)).stdout)
    assert [row["port"] for row in listed] == ["Slow"]
    assert json.loads(mdb("ports", "--json", "-c", str(fast)).stdout) == [], "1s: 15s is stale"
