"""Test helpers for users' handlers: the container in the test's process, or ``mdb run`` as a process.

:class:`TestContainer` runs the real pipeline in the test's own process, on
the embedded broker and SQLite in a temporary folder, in milliseconds, with
a clock the test moves and crash points it arms (``kit.py``); the pytest
plugin (``plugin.py``) offers it as the fixture ``mdb``.
:class:`ContainerProcess` and the helpers beside it (``process.py``) drive
``mdb run`` as a real process, for what only a process shows (a SIGKILL, a
signal, a second host).
"""

from __future__ import annotations

from .kit import BROKER_ENV, PortState, TestContainer
from .process import (
    ContainerProcess,
    QueueProbe,
    dump_toml,
    headers_of,
    mdb,
    wait_for,
    write_settings,
)
from .report import Failure, Failures

__all__ = [
    "BROKER_ENV",
    "ContainerProcess",
    "Failure",
    "Failures",
    "PortState",
    "QueueProbe",
    "TestContainer",
    "dump_toml",
    "headers_of",
    "mdb",
    "wait_for",
    "write_settings",
]
