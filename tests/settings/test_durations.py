"""Durations as the settings spell them (``settings.durations``): read and printed the same way.

The printed form names the wait queues (``Q.wait.2s``) and fills ``mdb ports``:
what is printed must read back as the same duration, or a container would
declare a second wait queue for the same wait.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdbcontainer.settings import QueueSettings, format_duration, parse_duration


@given(st.integers(min_value=1, max_value=30 * 86_400_000))
def test_every_whole_millisecond_duration_reads_back_from_its_printed_form(ms: int) -> None:
    duration = timedelta(milliseconds=ms)
    assert parse_duration(format_duration(duration)) == duration


@pytest.mark.parametrize(("duration", "printed"), [
    (timedelta(milliseconds=1500), "1500ms"), (timedelta(seconds=90), "90s"), (timedelta(minutes=2), "2m"),
    (timedelta(hours=36), "36h"), (timedelta(days=7), "7d"), (timedelta(0), "0ms"),
])
def test_a_duration_prints_in_the_largest_unit_that_holds_it_whole(duration: timedelta, printed: str) -> None:
    assert format_duration(duration) == printed


def test_the_same_wait_spelled_two_ways_is_one_setting() -> None:
    assert QueueSettings(redelivery_delay="2s") == QueueSettings(redelivery_delay="2000ms")
    assert QueueSettings(redelivery_delay=2).redelivery_delay == timedelta(seconds=2), "a number is seconds"


@pytest.mark.parametrize("value", [True, "2 weeks", "-1s", "s", "1.5.0s"])
def test_what_is_no_duration_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)  # type: ignore[arg-type]
