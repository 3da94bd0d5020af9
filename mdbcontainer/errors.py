"""Every error this package raises on purpose.

The tree::

    MdbError                      root: catch this to catch everything below (exit 1)
    ├── SettingsError             the settings file, a key or an override is wrong (exit 2)
    ├── ListenerError             a listener module or a handler cannot be bound (exit 2)
    ├── BrokerError               the broker refused or could not be reached
    │   ├── BrokerUnavailable     no connection within ``connect_timeout``
    │   │   └── QueueUnavailable  a queue's node is down: an outage, waited out
    │   ├── SubscriptionInUse     a durable subscription already has its one active subscriber
    │   └── PublishError          the broker did not confirm a publish
    │       └── Unroutable        a mandatory publish reached no queue
    ├── DatabaseError             the database refused a statement or the settings, or was away
    ├── DlqError                  a backout queue or a message on it is not there, or a replay stopped
    ├── NoReplyTo                 ``ctx.reply`` to a message that names no ``reply_to``
    ├── RequestTimeout            ``Producer.request`` got no reply in time
    └── TransactionError          a transaction API used where it cannot apply

Each message is one line that names the culprit (file, key, argument, port),
because the CLI prints it as it is and exits with the class's ``exit_code``
(click's convention: 2 for bad usage or settings, 1 for a failure). The
exception that caused one stays on ``__cause__`` for library callers.
"""

from __future__ import annotations

from typing import ClassVar


class MdbError(Exception):
    """Root of the errors raised by mdbcontainer."""

    exit_code: ClassVar[int] = 1  # what ``mdb`` exits with when this error stops a command


class SettingsError(MdbError):
    """The settings are invalid; the message names the file and the key path."""

    exit_code: ClassVar[int] = 2


class ListenerError(MdbError):
    """A listener module or handler cannot be imported or bound to a port."""

    exit_code: ClassVar[int] = 2


class BrokerError(MdbError):
    """The broker refused an operation or could not be reached."""


class BrokerUnavailable(BrokerError):
    """No connection to the broker could be made within the connect timeout."""


class QueueUnavailable(BrokerUnavailable):
    """A queue cannot be declared or reached because the cluster node that holds it is down.

    An outage like a lost connection: waited out with backoff, never a failed
    delivery or a port stop (a classic queue lives on one node).
    """


class SubscriptionInUse(BrokerError):
    """A durable subscription already has its one active subscriber (JMS allows one)."""


class PublishError(BrokerError):
    """The broker did not confirm a publish, so the message is not counted as sent."""


class Unroutable(PublishError):
    """A mandatory publish was returned: no queue was bound for it."""


class DatabaseError(MdbError):
    """The database refused a statement or the settings, or could not be reached.

    Raised above ``state/`` in place of SQLAlchemy's own errors (kept on
    ``__cause__``), so that the CLI, the console and the operations tell a
    database that is away from a bug without importing SQLAlchemy. ``refused``:
    the settings themselves were refused (a missing database or role, a wrong
    password; ``mdb check`` and ``mdb run`` exit 2 on it). ``outage``: the
    connection was lost or refused, to be waited out.
    """

    def __init__(self, message: str, *, refused: bool = False, outage: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        self.outage = outage


class DlqError(MdbError):
    """A backout queue or a message in it cannot be found, or a replay stopped short."""


class NoReplyTo(MdbError):
    """``ctx.reply`` was called for a message that names no ``reply_to`` queue."""


class RequestTimeout(MdbError):
    """A request got no reply within its timeout."""


class TransactionError(MdbError):
    """A transaction API was used where the port's settings do not allow it."""
