"""Binding: a port's effective settings, where the transport adds to what the settings file says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.handlers.binding import bind
from mdbcontainer.settings import load_settings
from mdbcontainer.testing import write_settings


@pytest.mark.parametrize(("broker_url", "port", "order_by"), [
    ("sqs://", {"destination": "LEDGER.fifo"}, "JMSXGroupID"),
    ("sqs://", {"destination": "LEDGER.fifo", "order_by": "body:account"}, "body:account"),
    ("sqs://", {"destination": "LEDGER.fifo", "transaction": "none", "acknowledge": "client"}, None),
    ("sqs://", {"destination": "LEDGER"}, None),
    ("amqp://guest:guest@127.0.0.1:5672//", {"destination": "LEDGER.fifo"}, None),
])
def test_a_port_on_an_sqs_fifo_queue_is_ordered_by_its_message_group(
    tmp_path: Path, broker_url: str, port: dict[str, Any], order_by: str | None,
) -> None:
    """CONTRACT section 17: a FIFO queue's group is an ordered port's key without ``order_by``.

    An ``order_by`` of the port's own wins; a mode that cannot be ordered (not
    ``acknowledge = "auto"``) stays unordered rather than refused; a standard
    queue, or a ``.fifo`` name on RabbitMQ, is not ordered by anything.
    """
    path = write_settings(tmp_path / "settings.toml", {
        "container": {"broker_url": broker_url, "database_url": f"sqlite:///{tmp_path}/db.sqlite",
                      "listeners": ["tests.apps.work"]},
        "ports": {"Work": port},
    })
    (binding,) = bind(load_settings(path, environ={}), ["Work"])
    assert binding.settings.order_by == order_by
