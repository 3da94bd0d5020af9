"""Logging set-up: text or JSON lines on stderr, secrets masked.

Nothing is logged per successful message at INFO (``log_level = "DEBUG"``
asks for one line per handled delivery): a failed delivery, a backout, an
outage and a port state change each log one line. Those lines carry their
facts as record attributes (``extra=``): the text format writes them into
the message, the JSON format as keys a log stack can filter on.

Every line passes through :func:`mask_secrets`, tracebacks included, so a
password in a URL or a ``password=`` pair never reaches the log, whatever a
handler or a library puts in an exception.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

from ..settings import ContainerSettings, mask_url

# The attributes a line may carry, in the order the JSON object lists them.
FIELDS = ("port", "message_id", "redelivery_count", "outcome", "duration", "state", "reason",
          "destination", "outage")
_PASSWORD_PAIR = re.compile(r"(?i)\b(password|passwd|pwd)(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|[^\s,;&]+)")


def mask_secrets(text: str) -> str:
    """Hide URL passwords (``amqp://guest:***@host``) and ``password=...`` pairs."""
    return _PASSWORD_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}***", mask_url(text))


def fields(**values: Any) -> dict[str, Any]:
    """The ``extra=`` of a structured line, without the values that are None."""
    return {key: value for key, value in values.items() if value is not None}


class MaskingFilter(logging.Filter):
    """Masks secrets in every record's message, whatever a handler or a library logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


class TextFormatter(logging.Formatter):
    """One line of text; the whole output masked, so tracebacks are too."""

    def __init__(self, process: int | None = None) -> None:
        label = f"[process {process}] " if process is not None else ""
        super().__init__(f"%(asctime)s %(levelname)-7s {label}%(name)s [%(threadName)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log stacks that parse fields."""

    def __init__(self, process: int | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": mask_secrets(record.getMessage()),
            "thread": record.threadName,
        }
        if self.process is not None:
            entry["process"] = self.process
        for key in FIELDS:
            if hasattr(record, key):
                value = getattr(record, key)
                entry[key] = mask_secrets(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


def setup_logging(settings: ContainerSettings, process: int | None = None) -> None:
    """Log to stderr; ``process``: the number of a supervised container process, on every line.

    The N processes of ``mdb run --processes N`` share the supervisor's stderr,
    so each line says which of them wrote it (``[process 2]``, JSON ``"process": 2``).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(MaskingFilter())
    json_lines = settings.log_format == "json"
    handler.setFormatter(JsonFormatter(process) if json_lines else TextFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    for noisy in ("amqp", "kombu", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
