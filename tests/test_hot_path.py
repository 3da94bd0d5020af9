"""The per-delivery path's cheap forms keep what a user sees.

The envelope reads its rarely used fields from the wire only when asked,
and outcomes are counted per consumer in plain integers added up at scrape
time: a handler must still see a plain ``Message``, and ``/metrics`` the
same series, as before.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from datetime import UTC, datetime, timedelta

from mdbcontainer import Message
from mdbcontainer.state.metrics import Metrics, Tally
from mdbcontainer.wire.delivery import Delivery, envelope
from tests.conftest import RawMessage

STAMP = 1764600000


def received() -> Message:
    raw = RawMessage(b'{"n": 1}', "application/json", {"h": "v"},
                     {"priority": 7, "timestamp": STAMP, "expiration": "60000", "delivery_mode": 2,
                      "reply_to": "answers", "correlation_id": "c-1"},
                     {"redelivered": True})
    return envelope(Delivery(raw), "m-1", 2, ["application/json"], 1000, "Orders")


def test_an_envelope_reads_as_the_message_it_always_was() -> None:
    message = received()
    sent = datetime.fromtimestamp(STAMP, UTC)
    expected = Message(id="m-1", body={"n": 1}, headers={"h": "v"}, redelivery_count=2,
                       redelivered=True, priority=7, expires_at=sent + timedelta(seconds=60),
                       persistent=True, reply_to="answers", correlation_id="c-1", timestamp=sent,
                       destination="Orders", content_type="application/json", raw=b'{"n": 1}')
    assert isinstance(message, Message)
    assert message == expected
    assert repr(message) == repr(expected)
    assert dataclasses.asdict(message) == dataclasses.asdict(expected)
    changed = dataclasses.replace(message, body={"n": 2})
    assert type(changed) is Message and changed.body == {"n": 2} and changed.priority == 7
    assert copy.copy(message) == expected and copy.deepcopy(message) == expected


def test_an_envelope_stays_read_only() -> None:
    message = received()
    for name in ("body", "priority", "timestamp"):
        try:
            setattr(message, name, None)
        except dataclasses.FrozenInstanceError:
            continue
        raise AssertionError(f"Message.{name} could be set")


def test_metrics_add_up_the_tallies_of_every_consumer_when_scraped() -> None:
    metrics = Metrics()
    first, second = Tally(), Tally()
    metrics.bind_port("Orders", started=lambda: True, failures=lambda: 0, in_flight=lambda: 0,
                      tallies=lambda: [first, second])
    metrics.bind_port("Idle", started=lambda: False, failures=lambda: 0, in_flight=lambda: 0,
                      tallies=lambda: [])
    first.count("handled")
    second.count("handled")
    second.count("failed")
    first.handler.observe(0.003)
    second.handler.observe(2.0)
    first.end_to_end(time.time() - 1.5)
    second.sizes.observe(7)
    second.fallbacks += 1
    text = metrics.exposition().decode()
    assert 'mdb_deliveries_total{outcome="handled",port="Orders"} 2.0' in text
    assert 'mdb_deliveries_total{outcome="failed",port="Orders"} 1.0' in text
    assert 'mdb_deliveries_total{outcome="handled",port="Idle"} 0.0' in text
    assert 'mdb_handler_seconds_bucket{le="0.005",port="Orders"} 1.0' in text
    assert 'mdb_handler_seconds_bucket{le="2.5",port="Orders"} 2.0' in text
    assert 'mdb_handler_seconds_count{port="Orders"} 2.0' in text
    assert 'mdb_end_to_end_seconds_bucket{le="1.0",port="Orders"} 0.0' in text
    assert 'mdb_end_to_end_seconds_bucket{le="2.0",port="Orders"} 1.0' in text
    assert 'mdb_batch_size_count{port="Orders"} 1.0' in text
    assert 'mdb_batch_fallbacks_total{port="Orders"} 1.0' in text
    assert 'mdb_port_started{port="Idle"} 0.0' in text
