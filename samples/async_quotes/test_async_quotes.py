"""The async quote handler, tested in process with the test kit: concurrent, and once each.

Fifty tasks on one event loop price the quotes at once (each waits 100 ms);
the quote row and the dedup row commit together, so a duplicate is skipped.
"""

from __future__ import annotations

import time
from pathlib import Path

from quote_listener import Quote
from sqlalchemy import func, select

from mdbcontainer.testing import TestContainer

SETTINGS = Path(__file__).with_name("settings.toml")


def test_quotes_are_priced_concurrently_and_stored_once() -> None:
    with TestContainer(SETTINGS) as mdb:
        began = time.monotonic()
        for n in range(40):
            mdb.send("QUOTES", {"sku": f"Q-{n}", "quantity": 1}, message_id=f"quote-{n}")
        mdb.send("QUOTES", {"sku": "Q-0", "quantity": 1}, message_id="quote-0")  # a duplicate
        mdb.drain()
        elapsed = time.monotonic() - began
        assert mdb.outcomes("QuotesPort") == {"handled": 40, "duplicate_skipped": 1}
        with mdb.session() as session:
            assert session.scalar(select(func.count()).select_from(Quote)) == 40
        # Time in handlers, added up, against the time it all took: how many ran at once.
        in_handlers = sum(t.handler.sum for t in mdb.container.ports["QuotesPort"].tallies)
    assert in_handlers >= 40 * 0.1
    assert in_handlers / elapsed > 3, f"{in_handlers:.1f}s of handlers in {elapsed:.1f}s: not concurrent"
