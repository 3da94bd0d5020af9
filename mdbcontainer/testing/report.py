"""What a test sees of a handler's failure: its traceback and what the container did with it.

The container logs each failed delivery, each backout and each port stopped
by Maximum retries as one structured record (``outcome``, ``port``,
``message_id``); a failure's record carries its exception (``mdb_error``).
:class:`Failures` listens to those records while a ``TestContainer`` runs and
tells them per message: ``ValueError: bad amount`` with its traceback, then
``failed (requeued)``, ``backed_out``, ``port_stopped``. A test that fails
shows that report (the pytest plugin adds it as a section; a ``with
TestContainer`` block prints it on stderr when the block raises).
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass

# The records that say what became of a failing delivery, in the words of mdb ports.
_OUTCOMES = ("failed", "backed_out", "invalid_body", "port_stopped")


@dataclass(frozen=True)
class Failure:
    """One record: a port's delivery of a message failed, was backed out, or stopped the port."""

    port: str
    message_id: str
    outcome: str
    text: str  # the log line
    error: BaseException | None

    def describe(self) -> str:
        line = f"{self.outcome}: {self.text}"
        if self.error is None:
            return line
        trace = "".join(traceback.format_exception(self.error)).rstrip()
        return f"{line}\n{_indent(trace)}"


class Failures(logging.Handler):
    """The failure records of the container's loggers, kept in order for the test to read."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._lock = threading.Lock()
        self.records: list[Failure] = []
        self._logger = logging.getLogger("mdbcontainer")
        self._level: int | None = None

    def attach(self) -> None:
        """Listen to ``mdbcontainer``'s loggers (WARNING records reach it whatever the test's level)."""
        if self._level is None:
            self._level = self._logger.level
            if not self._logger.isEnabledFor(logging.WARNING):
                self._logger.setLevel(logging.WARNING)
            self._logger.addHandler(self)

    def detach(self) -> None:
        if self._level is not None:
            self._logger.removeHandler(self)
            self._logger.setLevel(self._level)
            self._level = None

    def emit(self, record: logging.LogRecord) -> None:
        outcome = getattr(record, "outcome", None)
        if outcome not in _OUTCOMES:
            return
        failure = Failure(str(getattr(record, "port", "")), str(getattr(record, "message_id", "")),
                          str(outcome), record.getMessage(), getattr(record, "mdb_error", None))
        with self._lock:
            self.records.append(failure)

    def __bool__(self) -> bool:
        return bool(self.records)

    def of(self, message_id: str) -> list[Failure]:
        """The records of one message, in order."""
        return [f for f in list(self.records) if f.message_id == message_id]

    def report(self) -> str:
        """Every failing message: each failure with its traceback, then what the container did."""
        records = list(self.records)
        if not records:
            return "mdbcontainer: no delivery failed"
        lines = ["mdbcontainer: deliveries that failed, and what the container did with them"]
        for message_id in dict.fromkeys(f.message_id for f in records):
            mine = [f for f in records if f.message_id == message_id]
            lines.append(f"message {message_id} on port {mine[0].port}:")
            lines.extend(_indent(f.describe()) for f in mine)
        return "\n".join(lines)

    def summary(self) -> str:
        """One clause for an error message: how many failure records there are, if any."""
        return f"; {len(self.records)} delivery failure(s) recorded (see the report)" if self else ""


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
