"""``mdb check``'s advice on poison-message and cluster settings, and its look at the services.

The advice follows the README's *Guarantees* (Maximum retries and the backout
threshold) and *A RabbitMQ cluster*.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import BrokerUnavailable, DatabaseError, SettingsError
from ..settings import Settings, mask_url

if TYPE_CHECKING:
    from ..handlers.binding import Binding


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
                + (" (0 and 5 are the defaults, WebSphere's; docs/guides/poison-messages.md: "
                   "Settings for a new service)"
                   if (retries, threshold) == (0, 5) else "")
            )
        lines += _classic_backout(settings, queue, where)
        lines += _broker_limit(settings, queue, threshold, where)
    return lines


# RabbitMQ 4 gives every quorum queue this delivery limit unless a policy or argument says otherwise.
QUORUM_DELIVERY_LIMIT = 20


def _broker_limit(settings: Settings, queue: str, threshold: int, where: str) -> list[str]:
    """The broker gives up on a quorum queue's message before the container's threshold does."""
    if not queue or not settings.queue(queue).quorum or threshold < QUORUM_DELIVERY_LIMIT:
        return []
    return [
        f"{where}: backout_threshold = {threshold} on quorum queue {queue!r} is at or above "
        f"RabbitMQ 4's default delivery limit ({QUORUM_DELIVERY_LIMIT}): the broker dead-letters "
        f"a poison message to {settings.backout_queue_for(queue)!r} first, with its own reason "
        "(x-death) instead of the container's headers. Set backout_threshold below "
        f"{QUORUM_DELIVERY_LIMIT}, or raise the queue's delivery-limit by a policy"
    ]


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


def verify_services(settings: Settings) -> list[str]:
    """Connect once to the broker and the database: raise on settings they refuse, else warn.

    A missing database or role, a wrong password, a refused broker login or
    vhost cannot be waited out: it is a settings error (exit 2) that names the
    setting, so ``mdb check`` in a deployment's pre-start step catches it. A
    service that is merely down is a warning: ``mdb run`` waits for it.
    """
    lines = [_verify_broker(settings), _verify_database(settings)]
    if not lines[0]:  # the broker answers: can it route to partitions?
        lines.append(_verify_partitions(settings))
    return [line for line in lines if line]


def _verify_partitions(settings: Settings) -> str | None:
    """Partitions need the consistent-hash exchange plugin: say so when the broker lacks it."""
    import uuid
    from contextlib import suppress

    from ..wire.connection import Broker
    from ..wire.partitions import missing_text, plugin_missing

    broker = Broker(settings)
    if not broker.partitions:
        return None
    conn = broker.connect_once()
    try:
        missing = plugin_missing(conn.channel(), f"mdb.check.{uuid.uuid4().hex[:12]}")
    finally:
        with suppress(Exception):  # a refused type closed the connection already
            conn.close()
    if not missing:
        return None
    part = next(iter(broker.partitions.values()))
    return missing_text(part.destination, part.count) + "; its ordered port cannot start"


def _verify_broker(settings: Settings) -> str | None:
    from ..wire.connection import Broker

    broker = Broker(settings)
    if broker.capabilities.local_file:  # a file of ours: nothing to refuse
        return None
    try:
        away = broker.verify_login()
    except BrokerUnavailable as exc:  # refused: the login, the password or the vhost
        raise SettingsError(f"container.broker_url: {exc}") from exc
    return f"{away}; mdb run waits for it" if away else None


def _verify_database(settings: Settings) -> str | None:
    from sqlalchemy.engine import make_url

    from ..state.database import database_errors
    from ..state.store import make_engine

    url = settings.container.database_url
    if make_url(url).get_backend_name() == "sqlite":  # a file of ours: nothing to refuse
        return None
    engine = make_engine(url, timeout=settings.container.database_timeout)
    try:
        with database_errors():
            engine.connect().close()
    except DatabaseError as exc:
        if exc.refused:
            raise SettingsError(f"container.database_url: {exc}") from exc.__cause__
        return f"database {mask_url(url)} not reachable: {exc}; mdb run waits for it"
    finally:
        engine.dispose()
    return None
