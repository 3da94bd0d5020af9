"""Durations as the settings file spells them: ``"500ms"``, ``"30s"``, ``"5m"``, ``"7d"``.

Parsed into a ``timedelta`` on the way in and printed back the same way (``mdb
ports``, the console, the wait queues' names), so one spelling is read and shown.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: timedelta | str | float) -> timedelta:
    """Turn ``"500ms"``, ``"30s"``, ``"5m"``, ``"7d"`` (or seconds as a number) into a timedelta.

    Raises ValueError, naming the value, for anything else (a bool included).
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError("a duration is a string such as '30s', '500ms', '5m' or '7d'")
    if isinstance(value, int | float):
        return timedelta(seconds=value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a duration such as '30s', '500ms', '5m' or '7d'")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def format_duration(value: timedelta) -> str:
    """Print a duration the way the settings file spells it."""
    ms = round(value.total_seconds() * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
]

