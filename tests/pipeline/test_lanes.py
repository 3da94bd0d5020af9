"""The per-key lanes of an ordered port (pipeline/lanes.py) and how a key is read (support/ordering.py).

Pure decisions, no broker: each runs in microseconds.
"""

from __future__ import annotations

import pytest

from mdbcontainer.errors import SettingsError
from mdbcontainer.pipeline.lanes import Lanes, Unkeyed
from mdbcontainer.settings import PortSettings, validate_port
from mdbcontainer.support.ordering import OrderKey


def test_one_item_per_key_in_flight_in_arrival_order() -> None:
    lanes: Lanes[str] = Lanes()
    for item in ("a1", "b1", "a2", "a3", "b2"):
        lanes.add(item[0], item)
    assert lanes.take() == ("a", "a1")
    assert lanes.take() == ("b", "b1")
    assert lanes.take() is None, "a and b are both in flight"
    lanes.done("b")
    assert lanes.take() == ("b", "b2")
    lanes.done("a")
    assert lanes.take() == ("a", "a2")
    assert lanes.waiting == 1


def test_a_failed_item_goes_first_and_a_held_key_waits_until_released() -> None:
    lanes: Lanes[str] = Lanes()
    lanes.add("a", "a1")
    lanes.add("a", "a2")
    assert lanes.take() == ("a", "a1")
    lanes.front("a", "a1")  # failed: it runs again before a2
    lanes.done("a")
    assert lanes.take() == ("a", "a1")
    lanes.hold("a")  # backed out, on_backout = "hold"
    lanes.done("a")
    lanes.add("b", "b1")
    assert lanes.take() == ("b", "b1"), "other keys go on"
    assert lanes.take() is None and lanes.waiting_for("a") == 1
    lanes.release("a")
    assert lanes.take() == ("a", "a2")


def test_messages_without_a_key_are_keys_of_their_own() -> None:
    lanes: Lanes[str] = Lanes()
    lanes.add(Unkeyed(), "x1")
    lanes.add(Unkeyed(), "x2")
    assert lanes.take() is not None and lanes.take() is not None
    assert sorted(lanes.drain()) == []


def test_the_key_comes_from_a_header_or_a_top_level_body_field() -> None:
    assert OrderKey("JMSXGroupID").of({"JMSXGroupID": "acct-7"}, b"{}") == "acct-7"
    assert OrderKey("JMSXGroupID").of({}, b"{}") is None
    assert OrderKey("body:account_id").of(None, b'{"account_id": 7}') == "7"
    assert OrderKey("body:account_id").of(None, b'{"account_id": "a"}') == "a"
    assert OrderKey("body:account_id").of(None, b"not json") is None
    assert OrderKey("body:account_id").of(None, b"[1, 2]") is None


@pytest.mark.parametrize("port, needle", [
    ({"destination": "Q", "order_by": "body:"}, "needs a field name"),
    ({"destination": "Q", "order_by": "k", "acknowledge": "dups_ok", "transaction": "none"},
     "order_by needs acknowledge = 'auto'"),
    ({"topic": "t", "order_by": "k", "partitions": 2}, "partitions: needs a destination"),
    ({"destination": "Q", "partitions": 2}, "apply to an ordered port only"),
    ({"destination": "Q", "on_backout": "hold"}, "apply to an ordered port only"),
])
def test_contradictory_ordered_settings_are_one_line_errors(port: dict[str, object], needle: str) -> None:
    with pytest.raises(SettingsError) as raised:
        validate_port("settings.toml", "P", port)
    assert needle in str(raised.value) and "ports.P" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_an_ordered_port_prefetches_enough_for_its_waiting_keys() -> None:
    assert PortSettings(destination="Q", order_by="k").prefetch == 1000
    assert PortSettings(destination="Q", order_by="k", concurrency=200).prefetch == 1600
    assert PortSettings(destination="Q", order_by="k", prefetch=20).prefetch == 20
    assert PortSettings(destination="Q").prefetch == 10
