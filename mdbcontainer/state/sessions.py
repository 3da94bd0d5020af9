"""The caller's sessions that :meth:`Outbox.send` writes through: which database, and when.

A ``Session`` is written at once. An ``AsyncSession`` cannot be written by a
plain call (its driver needs an ``await``), so its rows wait in the session
and are inserted by the commit itself (SQLAlchemy's ``before_commit``, which
the async commit runs where the driver can be called): they commit with the
transaction or, rolled back, are dropped with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url

from ..errors import TransactionError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, SessionTransaction

_ROWS = "mdb_outbox_rows"  # session.info: the root transaction's rows, waiting for its commit

Insert = Callable[["Session", list[dict[str, Any]]], None]


def sync_session_of(session: Any) -> Session:
    """The ``Session`` itself, or an ``AsyncSession``'s synchronous one; TypeError for anything else."""
    from sqlalchemy.orm import Session

    if isinstance(session, Session):
        return session
    inner = getattr(session, "sync_session", None)
    if isinstance(inner, Session):
        return inner
    raise TypeError(f"outbox.send needs a SQLAlchemy Session or AsyncSession, not {type(session).__name__}")


class DatabaseCheck:
    """Refuses a session bound to another database than the container's, before any write.

    An engine found to be the container's database is remembered (weakly): the
    check costs a URL parse and, on SQLite, a path resolved, once per engine,
    not once per send.
    """

    def __init__(self, url: str) -> None:
        self.url = make_url(url)
        self._accepted: weakref.WeakSet[Any] = weakref.WeakSet()

    def __call__(self, session: Session) -> None:
        engine = session.get_bind().engine  # an Engine or a Connection: both name their engine
        if engine in self._accepted:
            return
        if not _same_database(engine.url, self.url):
            raise TransactionError(
                f"outbox.send: the session is bound to {_shown(engine.url)}, not to the container's "
                f"database {_shown(self.url)} (container.database_url); nothing was written"
            )
        self._accepted.add(engine)


def _same_database(a: URL, b: URL) -> bool:
    """One database, whichever driver reaches it (psycopg, its async mode, aiosqlite, ...)."""
    if a.get_backend_name() != b.get_backend_name():
        return False
    if a.get_backend_name() == "sqlite":
        return _sqlite_file(a) == _sqlite_file(b)
    return _server(a) == _server(b)


def _sqlite_file(url: URL) -> str:
    name = url.database or ":memory:"
    return name if name == ":memory:" else str(Path(name).resolve())


def _server(url: URL) -> tuple[str, int, str]:
    host = url.host or str(url.query.get("host") or "localhost")
    return host.lower().replace("127.0.0.1", "localhost"), url.port or 5432, url.database or ""


def _shown(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def deferred_rows(session: Session, insert: Insert) -> list[dict[str, Any]]:
    """The list of rows ``insert`` writes at the commit of ``session``'s current transaction."""
    transaction = session.get_transaction() or session.begin()  # no I/O: the connection waits
    root = _root(transaction)
    waiting: dict[int, list[dict[str, Any]]] = session.info.setdefault(_ROWS, {})
    if not event.contains(session, "before_commit", _write_waiting):
        event.listen(session, "before_commit", _write_waiting)
        event.listen(session, "after_transaction_end", _drop_ended)
    session.info[f"{_ROWS}.insert"] = insert
    return waiting.setdefault(id(root), [])


def _root(transaction: SessionTransaction) -> SessionTransaction:
    while transaction.parent is not None:
        transaction = transaction.parent
    return transaction


def _write_waiting(session: Session) -> None:
    transaction = session.get_transaction()
    if transaction is None:
        return
    rows = session.info.get(_ROWS, {}).pop(id(_root(transaction)), None)
    if rows:
        session.info[f"{_ROWS}.insert"](session, rows)


def _drop_ended(session: Session, transaction: SessionTransaction) -> None:
    """A root transaction ended: its rows were written at its commit, or go with its rollback."""
    if transaction.parent is None:
        session.info.get(_ROWS, {}).pop(id(transaction), None)
