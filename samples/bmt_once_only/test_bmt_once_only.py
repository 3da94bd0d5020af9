"""The bean-managed credit bean, tested in process with the test kit (no ``mdb run``).

``run.py`` kills a real ``mdb run`` between the commit and the
acknowledgment; here ``crash(at="after-commit")`` makes the delivery die at
that point in the test's process, and the container comes back: the
redelivered transfer finds its dedup row and is not credited twice.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from credit_listener import Credit
from sqlalchemy import select

from mdbcontainer.testing import TestContainer

SETTINGS = Path(__file__).with_name("settings.toml")


def credits(mdb: TestContainer) -> Counter[str]:
    """Each account's credited total, from the bean's table."""
    totals: Counter[str] = Counter()
    with mdb.session() as session:
        for account, amount in session.execute(select(Credit.account, Credit.amount)):
            totals[account] += amount
    return totals


def test_a_duplicate_and_a_crash_after_the_commit_credit_each_transfer_once() -> None:
    with TestContainer(SETTINGS) as mdb:
        mdb.send("CREDITS", {"account": "alice", "amount": 15}, message_id="t-1")
        mdb.send("CREDITS", {"account": "alice", "amount": 15}, message_id="t-1")  # a producer's retry
        mdb.drain()
        mdb.crash(at="after-commit")
        mdb.send("CREDITS", {"account": "bob", "amount": 20}, message_id="t-2")
        mdb.drain()
        assert mdb.outcomes("CreditPort") == {"handled": 1, "duplicate_skipped": 2}
        assert credits(mdb) == {"alice": 15, "bob": 20}
