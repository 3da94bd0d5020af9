"""The batch handler of the batch walk-through, tested in process with the test kit.

A bad order rolls its batch back; the container runs the batch again one by
one, so only the bad order fails, and with ``backout_threshold = 1`` it goes
to the backout queue at once. A duplicate is skipped by the dedup table.
"""

from __future__ import annotations

from pathlib import Path

from order_listener import Order
from sqlalchemy import func, select

from mdbcontainer.testing import TestContainer

SETTINGS = Path(__file__).with_name("settings.toml")


def test_a_bad_order_alone_is_backed_out_and_every_good_one_is_stored_once() -> None:
    with TestContainer(SETTINGS) as mdb:
        for n in range(1, 21):
            mdb.send("ORDERS", {"sku": f"S-{n}", "amount": n}, message_id=f"order-{n}")
        mdb.send("ORDERS", {"sku": "S-bad", "amount": -1}, message_id="order-bad")
        mdb.send("ORDERS", {"sku": "S-1", "amount": 1}, message_id="order-1")  # a duplicate
        mdb.drain()
        assert [m.id for m in mdb.backed_out()] == ["order-bad"]
        with mdb.session() as session:
            assert session.scalar(select(func.count()).select_from(Order)) == 20
            assert session.scalar(select(func.count(func.distinct(Order.message_id)))) == 20
        outcomes = mdb.outcomes("OrdersPort")
        assert (outcomes["handled"], outcomes["backed_out"]) == (20, 1)
        assert outcomes["duplicate_skipped"] == 1
