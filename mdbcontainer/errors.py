"""Every error this package raises on purpose.

The tree::

    MdbError                      root: catch this to catch everything below
    ├── SettingsError             the settings file, a key or an override is wrong (exit 2)
    ├── ListenerError             a listener module or a handler cannot be bound (exit 2)
    ├── BrokerError               the broker refused or could not be reached
    │   ├── BrokerUnavailable     no connection within ``connect_timeout``
    │   │   └── QueueUnavailable  a queue's node is down: an outage, waited out
    │   ├── SubscriptionInUse     a durable subscription already has its one active subscriber
    │   └── PublishError          the broker did not confirm a publish
    │       └── Unroutable        a mandatory publish reached no queue
    ├── RequestTimeout            ``Producer.request`` got no reply in time
    └── TransactionError          a transaction API used where it cannot apply

Each message is one line that names the culprit (file, key, argument, port),
because the CLI prints it as it is and exits.
"""

from __future__ import annotations


class MdbError(Exception):
    """Root of the errors raised by mdbcontainer."""


class SettingsError(MdbError):
    """The settings are invalid; the message names the file and the key path."""


class ListenerError(MdbError):
    """A listener module or handler cannot be imported or bound to a port."""


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


class RequestTimeout(MdbError):
    """A request got no reply within its timeout."""


class TransactionError(MdbError):
    """A transaction API was used where the port's settings do not allow it."""
