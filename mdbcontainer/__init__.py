"""mdbcontainer: message-driven handlers with listener-port reliability.

Decorate a handler with :func:`message_driven`, name its listener port in the
settings, and run ``mdb run``. The container wraps each delivery in a
transaction, counts failed deliveries durably, backs poison messages out to a
backout queue, stops a port after its maximum retries, and keeps a dedup
table so each message's database work commits once.
"""

from .errors import (
    BrokerError,
    BrokerUnavailable,
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
from .handlers.registry import message_driven
from .message import Message
from .sending.producer import Producer
from .settings import Settings, load_settings
from .units.context import BatchContext, MessageContext

__all__ = [
    "BatchContext",
    "BrokerError",
    "BrokerUnavailable",
    "DlqError",
    "ListenerError",
    "MdbError",
    "Message",
    "MessageContext",
    "NoReplyTo",
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
