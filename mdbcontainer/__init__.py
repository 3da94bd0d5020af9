"""mdbcontainer: message-driven handlers with listener-port reliability.

Decorate a handler with :func:`message_driven`, name its listener port in the
settings, and run ``mdb run``. The container wraps each delivery in a
transaction, counts failed deliveries durably, backs poison messages out to a
backout queue, stops a port after its maximum retries, and keeps a dedup
table so each message's database work commits once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BrokerError,
    BrokerUnavailable,
    DatabaseError,
    DlqError,
    ListenerError,
    MdbError,
    NoReplyTo,
    PublishError,
    QueueUnavailable,
    RequestTimeout,
    SettingsError,
    SubscriptionInUse,
    TransactionError,
    Unroutable,
)

if TYPE_CHECKING:
    from .handlers.registry import message_driven
    from .message import Message
    from .sending.producer import Producer
    from .settings import Settings, load_settings
    from .state.outbox import Outbox
    from .units.context import BatchContext, MessageContext

# Imported on first use: ``mdb send`` loads the CLI through this package, and the
# handler and transaction machinery (SQLAlchemy) would cost it a second.
_LAZY = {
    "BatchContext": "units.context", "MessageContext": "units.context", "message_driven": "handlers.registry",
    "Message": "message", "Outbox": "state.outbox", "Producer": "sending.producer",
    "Settings": "settings", "load_settings": "settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "BatchContext",
    "BrokerError",
    "BrokerUnavailable",
    "DatabaseError",
    "DlqError",
    "ListenerError",
    "MdbError",
    "Message",
    "MessageContext",
    "NoReplyTo",
    "Outbox",
    "Producer",
    "PublishError",
    "QueueUnavailable",
    "RequestTimeout",
    "Settings",
    "SettingsError",
    "SubscriptionInUse",
    "TransactionError",
    "Unroutable",
    "load_settings",
    "message_driven",
]
