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

from .settings import ContainerSettings, mask_url

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

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s [%(threadName)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return mask_secrets(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log stacks that parse fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": mask_secrets(record.getMessage()),
            "thread": record.threadName,
        }
        for key in FIELDS:
            if hasattr(record, key):
                value = getattr(record, key)
                entry[key] = mask_secrets(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = mask_secrets(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


def setup_logging(settings: ContainerSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(MaskingFilter())
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    for noisy in ("amqp", "kombu", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
