"""``mdb check``'s advice on poison-message and cluster settings, and its look at the services.

The advice follows the README's *Guarantees* (Maximum retries and the backout
threshold) and *A RabbitMQ cluster*.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import BrokerUnavailable, SettingsError
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
                + (" (0 and 5 are the defaults, WebSphere's; README: Settings for a new service)"
                   if (retries, threshold) == (0, 5) else "")
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


def verify_services(settings: Settings) -> list[str]:
    """Connect once to the broker and the database: raise on settings they refuse, else warn.

    A missing database or role, a wrong password, a refused broker login or
    vhost cannot be waited out: it is a settings error (exit 2) that names the
    setting, so ``mdb check`` in a deployment's pre-start step catches it. A
    service that is merely down is a warning: ``mdb run`` waits for it.
    """
    return [line for line in (_verify_broker(settings), _verify_database(settings)) if line]


def _verify_broker(settings: Settings) -> str | None:
    from ..wire.connection import Broker

    broker = Broker(settings)
    if broker.is_embedded:  # a file of ours: nothing to refuse
        return None
    try:
        away = broker.verify_login()
    except BrokerUnavailable as exc:  # refused: the login, the password or the vhost
        raise SettingsError(f"container.broker_url: {exc}") from exc
    return f"{away}; mdb run waits for it" if away else None


def _verify_database(settings: Settings) -> str | None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from ..state.store import make_engine
    from ..support.failures import describe
    from ..units.single import database_refused

    url = settings.container.database_url
    if make_url(url).get_backend_name() == "sqlite":  # a file of ours: nothing to refuse
        return None
    engine = make_engine(url, timeout=settings.container.database_timeout)
    try:
        engine.connect().close()
    except SQLAlchemyError as exc:
        if database_refused(exc):
            raise SettingsError(f"container.database_url: {describe(exc)}") from exc
        return f"database {mask_url(url)} not reachable: {describe(exc)}; mdb run waits for it"
    finally:
        engine.dispose()
    return None
