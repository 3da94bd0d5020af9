"""``mdb check``'s advice on poison-message settings, in words (seed 000's advice)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .settings import Settings

if TYPE_CHECKING:
    from .container import Binding


def warnings_for(settings: Settings, bindings: list[Binding]) -> list[str]:
    """Warn where one poison message loops until the port stops, or stops it before its backout."""
    lines = []
    for binding in bindings:
        queue = binding.settings.queue_name
        threshold = settings.queue(queue).backout_threshold
        retries = binding.settings.max_retries
        where = f"port {binding.name} (queue {queue or binding.settings.topic})"
        if threshold == 0:
            lines.append(
                f"{where}: backout_threshold = 0 never backs a message out: a poison message "
                f"is redelivered until the port stops after {retries + 1} consecutive failure(s)"
            )
        elif retries < threshold:
            lines.append(
                f"{where}: max_retries = {retries} < backout_threshold = {threshold}: the port "
                "stops before a poison message is backed out; someone must restart it "
                f"(mdb port start {binding.name}) for each failure up to the threshold. "
                "Set max_retries >= backout_threshold to back poison out without stopping"
            )
    return lines
