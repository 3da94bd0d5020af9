"""What a database error means: an outage to wait out, a refusal of the settings, or a failure.

Every layer meets database errors (a handler's statements, the container's
tables, ``mdb dlq replay``, the console), and each must tell the same three
apart: an outage (a lost or refused connection, a failover's read-only
standby) is waited out and never counted against a message; a refusal of the
settings themselves (a missing database or role, a wrong password) is a
configuration error at start; anything else is the statement's own failure.
The rules live here once, beside the tables. Above ``state/``, a SQLAlchemy
error is met as :class:`mdbcontainer.errors.DatabaseError` (:func:`database_errors`
wraps it at the boundary), so no upper layer imports ``sqlalchemy.exc``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import exc as sa_exc

from ..errors import DatabaseError
from ..support.failures import describe

_SQLITE_ERROR = 1  # the primary result code of a statement SQLite cannot run
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"


def is_infrastructure(exc: BaseException) -> bool:
    """A lost or refused database connection: retried, never counted against the message.

    Except a session the server ended because the handler left its transaction
    idle past ``database_timeout`` (SQLSTATE 25P03): the connection is gone, but
    the handler caused it, as a statement timeout; waited out as an outage, that
    message would be retried forever, never counted.
    """
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if sqlstate == IDLE_IN_TRANSACTION_TIMEOUT:
        return False
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if _sqlite_statement_error(exc):
        return False
    if isinstance(sqlstate, str) and sqlstate:
        return _transient_sqlstate(sqlstate)
    return isinstance(
        exc,
        sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.DisconnectionError
        | sa_exc.TimeoutError,
    )


# What PostgreSQL says, before any SQLSTATE reaches the client, when the login itself is wrong
# (libpq reports a failed startup as text only): 3D000, 28000, 28P01.
_REFUSED_AT_LOGIN = ("does not exist", "password authentication failed", "no pg_hba.conf entry",
                     "is not permitted to log in", "no password supplied")


def database_refused(exc: BaseException) -> bool:
    """The database refused the settings themselves: a missing database or role, a wrong password.

    An outage while running (a role locked for a moment is waited out like any
    refused connection), but at start a configuration error: waiting cannot
    create a database, so ``mdb check`` and ``mdb run`` exit 2 on it.
    """
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate == "3D000" or sqlstate.startswith("28")
    if not isinstance(exc, sa_exc.OperationalError):
        return False
    text = str(getattr(exc, "orig", exc))
    said_by_server = "FATAL" in text or "fe_sendauth" in text  # not a statement's own error
    return said_by_server and any(marker in text for marker in _REFUSED_AT_LOGIN)


_TRANSIENT = frozenset({"57P01", "57P02", "57P03", "25006"})


def _transient_sqlstate(sqlstate: str) -> bool:
    """PostgreSQL errors that are the server's state, not the message's: waited out, not counted.

    Connection exceptions (08), a login refused (28) or a database missing (3D),
    insufficient resources (53), serialization failures and deadlocks (40,
    which pass on retry), the server shutting down (57P01-57P03), and a write
    refused as read-only (25006): the connection reached a standby, as after a
    failover on a URL that does not ask for ``target_session_attrs=read-write``;
    counted, every message would be backed out until the writes come back. A
    statement or lock timeout (57014, 55P03) is not among them: a message
    whose query always times out is a failed delivery, counted and in the end
    backed out, instead of being retried forever uncounted.
    """
    return sqlstate[:2] in {"08", "28", "3D", "53", "40"} or sqlstate in _TRANSIENT


def _sqlite_statement_error(exc: BaseException) -> bool:
    """SQLite's SQLITE_ERROR: the statement itself is wrong (a missing table, a syntax error).

    SQLite raises it as OperationalError, the class of a locked or unreadable
    database; waited out as an outage, a handler's bad SQL would loop forever,
    never counted and never backed out.
    """
    code = getattr(getattr(exc, "orig", None), "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == _SQLITE_ERROR


def wrapped(exc: BaseException) -> DatabaseError | None:
    """``exc`` as a :class:`DatabaseError` when SQLAlchemy raised it, else None.

    Asks without importing SQLAlchemy (a second of ``mdb send``): an error of
    SQLAlchemy's exists only once its module is loaded.
    """
    errors = sys.modules.get("sqlalchemy.exc")
    if errors is None or not isinstance(exc, errors.SQLAlchemyError):
        return None
    error = DatabaseError(describe(exc), refused=database_refused(exc),
                          outage=is_infrastructure(exc))
    error.__cause__ = exc
    return error


@contextmanager
def database_errors() -> Iterator[None]:
    """Raise a SQLAlchemy error of the block as :class:`DatabaseError` (``from`` it)."""
    try:
        yield
    except sa_exc.SQLAlchemyError as exc:
        error = wrapped(exc)
        assert error is not None
        raise error from exc


def database_error_types() -> tuple[type[BaseException], ...]:
    """The classes of SQLAlchemy's errors, for a handler registered by class (the console's)."""
    return (sa_exc.SQLAlchemyError,)
