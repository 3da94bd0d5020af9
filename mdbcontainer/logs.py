"""Logging set-up: text or JSON lines on stderr, secrets masked.

Nothing is logged per successful message at INFO: a failed delivery, a
backout, an outage and a port state change each log one line.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from .settings import ContainerSettings, mask_url


class MaskingFilter(logging.Filter):
    """Masks URL passwords in every record, whatever a handler or a library logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_url(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log stacks that parse fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "thread": record.threadName,
        }
        for key in ("port", "message_id", "redelivery_count", "outcome", "duration"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = mask_url(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


def setup_logging(settings: ContainerSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(MaskingFilter())
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s [%(threadName)s] %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    for noisy in ("amqp", "kombu", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
