"""The headers of a backed-out message (``pipeline.backout``): the latest failure only, the rest kept."""

from __future__ import annotations

from datetime import UTC, datetime

from mdbcontainer.pipeline.backout import backout_headers
from mdbcontainer.wire.headers import BACKOUT_REASON, FAILURE_HEADERS, REASON_INVALID, REASON_THRESHOLD


def test_a_message_backed_out_again_carries_its_latest_failure_and_the_producers_headers() -> None:
    """A replayed message that fails again: the first backout's headers must not mislead the operator."""
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    first = backout_headers({"app": "kept"}, reason=REASON_THRESHOLD, destination="ORDERS", port="Orders",
                            count=5, exception="ValueError: first", failed_at=at)
    second = backout_headers({**first, "x-mdb-waited": "2s"}, reason=REASON_INVALID, destination="ORDERS",
                             port="Orders", count=0, exception=None, failed_at=at)
    assert second == {"app": "kept", BACKOUT_REASON: REASON_INVALID,
                      "x-mdb-original-destination": "ORDERS", "x-mdb-port": "Orders",
                      "x-mdb-redelivery-count": 0, "x-mdb-exception": "", "x-mdb-failed-at": at.isoformat()}
    assert set(second) == {"app", BACKOUT_REASON, *FAILURE_HEADERS}
