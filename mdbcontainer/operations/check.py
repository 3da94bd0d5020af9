"""``mdb check``'s advice on poison-message and cluster settings, in words (seed 000's advice)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..settings import Settings

if TYPE_CHECKING:
    from ..runtime.container import Binding


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
        lines += _classic_backout(settings, queue, where)
    return lines


def _classic_backout(settings: Settings, queue: str, where: str) -> list[str]:
    """A quorum queue survives a node's death; a classic backout queue beside it does not."""
    if not queue or not settings.queue(queue).quorum:
        return []
    backout = settings.backout_queue_for(queue)
    if settings.queue(backout).quorum:
        return []
    return [
        f"{where}: quorum queue {queue!r} backs out to {backout!r}, a classic queue: while the "
        f"node holding {backout!r} is down, poison messages cannot be moved and wait on {queue!r}. "
        f"Set [queues.\"{backout}\"] quorum = true"
    ]
