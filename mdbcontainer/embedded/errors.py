"""The AMQP errors the embedded broker raises, worded as RabbitMQ words them.

Callers (wire/connection.py, kombu's retry logic, users reading a log) already know
py-amqp's exceptions and RabbitMQ's reply texts; raising the same classes
with the same texts lets them treat both brokers alike.
"""

from __future__ import annotations

from amqp.exceptions import ChannelError, NotFound, PreconditionFailed

# AMQP method signatures, so amqp exceptions print the method that failed.
EXCHANGE_DECLARE = (40, 10)
EXCHANGE_DELETE = (40, 20)
QUEUE_DECLARE = (50, 10)
QUEUE_BIND = (50, 20)
QUEUE_DELETE = (50, 40)
BASIC_PUBLISH = (60, 40)
BASIC_RETURN = (60, 50)


class NoRoute(ChannelError):  # type: ignore[misc]
    """A mandatory publish that no queue took (AMQP ``basic.return`` 312).

    py-amqp raises a ChannelError with code 312 from a confirmed publish
    whose return nobody handles; raising the same kind here lets callers
    treat both brokers alike.
    """

    code = 312


def not_found(what: str, name: str, method: tuple[int, int]) -> NotFound:
    """RabbitMQ's 404 for a missing queue or exchange."""
    return NotFound(f"NOT_FOUND - no {what} '{name}' in vhost '/'", method)


def precondition(text: str, method: tuple[int, int]) -> PreconditionFailed:
    """RabbitMQ's 406: an inequivalent redeclare, a non-empty or used delete."""
    return PreconditionFailed(f"PRECONDITION_FAILED - {text}", method)
