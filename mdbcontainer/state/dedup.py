"""The dedup table: once-and-only-once between commit and acknowledgment.

The one crash window that matters here is after the handler's transaction
commits and before the broker hears the acknowledgment: the message comes
back although its work is done. The row ``(port, message id)`` commits in the
same transaction as the work, so the redelivery finds it and is acknowledged
without calling the handler.

The claim is ``INSERT ... ON CONFLICT DO NOTHING RETURNING``: a plain insert
that fails aborts a PostgreSQL transaction, and a rowcount check is wrong on
SQLAlchemy 2 (-1 for that statement), so the returned row is the answer. Two
consumers claiming the same id at once serialize on the row: the second
waits for the first to commit, then sees the conflict.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, String, bindparam, cast, delete, exists, func, select, text

from .store import Store, utcnow

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("mdbcontainer.dedup")

PURGE_BATCH = 1000
# One container of a fleet purges a dedup table at a time: a PostgreSQL advisory
# lock in this class, keyed by the table's qualified name, so services that keep
# their tables in other schemas of one database never hold back each other's purge.
PURGE_LOCK_CLASS = 7426002
# The "port" of the rows that remember a replay's forgetting (:meth:`Dedup.forget_once`): a
# name no listener port has (ports are TOML keys a person writes; this has a space in it).
REPLAY_MARKS = "mdb replay"


class DuplicateMessage(BaseException):
    """Raised out of ``ctx.transaction()`` when the message was already applied.

    A BaseException, like dramatiq's Interrupt, so that a handler's ``except
    Exception`` cannot swallow it and commit the work a second time.
    """


class Dedup:
    """Claims, checks and purges dedup rows."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = store.tables.dedup
        t = self.table
        self._claims: dict[int, tuple[str, list[str]]] = {}
        # Driver SQL skips SQLAlchemy's type processing: the timestamp is converted as a
        # statement would (SQLite stores it as SQLAlchemy's text, not the driver's).
        self._stamp = t.c.processed_at.type.bind_processor(store.engine.dialect)
        self._claim = (
            self.store.insert(t)
            .values(port=bindparam("port"), message_id=bindparam("message_id"),
                    processed_at=bindparam("processed_at"))
            .on_conflict_do_nothing(index_elements=[t.c.port, t.c.message_id])
            .returning(t.c.port)
        )

    def claim(self, session: Session, port: str, message_id: str) -> bool:
        """Write the row inside the caller's transaction; False when it already exists.

        The statement is built once and run on the session's connection: on the
        hot path, building and caching a statement per message costs more CPU
        than the round trip it makes.
        """
        params = {"port": port, "message_id": message_id, "processed_at": utcnow()}
        return session.connection().execute(self._claim, params).first() is not None

    def claim_many(self, session: Session, port: str, message_ids: list[str]) -> set[str]:
        """Claim a batch's rows in one statement inside the caller's transaction.

        ``INSERT ... ON CONFLICT DO NOTHING RETURNING message_id``: the ids
        returned are the ones this transaction claimed; the others were claimed
        before (duplicates). An id given twice is claimed once. The ids go in
        sorted, so two consumers claiming overlapping batches lock the rows in
        one order and cannot deadlock.
        """
        unique = sorted(set(message_ids))
        if not unique:
            return set()
        at = utcnow()
        params: dict[str, Any] = {"port": port, "processed_at": self._stamp(at) if self._stamp else at}
        if self.store.dialect == "postgresql":
            sql, _ = self._claim_array_sql()
            params["ids"] = json.dumps(unique)
            claimed = session.connection().exec_driver_sql(sql, params).scalar()
            return set(claimed or ())
        else:
            params.update({f"m{i}": m for i, m in enumerate(unique)})
            sql, order = self._claim_sql(len(unique))
        connection = session.connection()
        driver_params: Any = tuple(params[name] for name in order) if order else params
        rows = connection.exec_driver_sql(sql, driver_params)
        return {str(row[0]) for row in rows}

    def _claim_array_sql(self) -> tuple[str, list[str]]:
        """PostgreSQL: the claim with the ids as one JSON array parameter, compiled once.

        ``INSERT ... SELECT FROM json_array_elements_text(:ids) WITH ORDINALITY
        ... ORDER BY`` the array's order, inside ``WITH claimed AS (...) SELECT
        json_agg(message_id)``: three parameters for any batch size, one
        statement text, and one row back. Where a hundred-row VALUES has 102
        parameters for the driver to adapt, a text array is adapted element
        by element in Python (a quoting check each), and a row returned per
        id is fetched one by one, the JSON text is made and read by the json
        module's C code.
        """
        cached = self._claims.get(0)
        if cached is None:
            t = self.table
            ids = func.json_array_elements_text(cast(bindparam("ids", type_=String), JSON)).table_valued(
                "m", with_ordinality="i").render_derived()
            rows = (select(cast(bindparam("port"), t.c.port.type), ids.c.m,
                           cast(bindparam("processed_at"), t.c.processed_at.type))
                    .select_from(ids).order_by(ids.c.i))
            statement = (
                self.store.insert(t).from_select(["port", "message_id", "processed_at"], rows)
                .on_conflict_do_nothing(index_elements=[t.c.port, t.c.message_id])
                .returning(t.c.message_id)
            )
            compiled = statement.compile(dialect=self.store.engine.dialect)
            sql = f"WITH claimed AS ({compiled}) SELECT json_agg(message_id) FROM claimed"
            cached = self._claims[0] = (sql, [])
        return cached

    def _claim_sql(self, size: int) -> tuple[str, list[str]]:
        """The claim of ``size`` ids as the driver's SQL, compiled once per size.

        SQLAlchemy compiles a multi-row VALUES again on every execution (about
        10 ms for a hundred rows, more than the round trip), so the statement
        is compiled here once and run as driver SQL; ``order`` names the
        parameters of a positional driver (SQLite), empty for a named one.
        """
        cached = self._claims.get(size)
        if cached is None:
            t = self.table
            rows: list[dict[str, Any]] = [
                {"port": bindparam("port"), "message_id": bindparam(f"m{i}"),
                 "processed_at": bindparam("processed_at")} for i in range(size)]
            statement = (
                self.store.insert(t).values(rows)
                .on_conflict_do_nothing(index_elements=[t.c.port, t.c.message_id])
                .returning(t.c.message_id)
            )
            compiled = statement.compile(dialect=self.store.engine.dialect)
            order = list(compiled.positiontup or []) if compiled.positional else []
            cached = self._claims[size] = (str(compiled), order)
        return cached

    def seen(self, port: str, message_id: str) -> bool:
        """True when the message's work has committed (checked for redeliveries only)."""
        t = self.table
        query = select(exists().where(t.c.port == port, t.c.message_id == message_id))
        with self.store.engine.connect() as conn:
            return bool(conn.execute(query).scalar())

    def seen_many(self, port: str, message_ids: list[str]) -> set[str]:
        """The ids of ``message_ids`` whose work has committed: one short read, outside any transaction.

        Where claims go last (SQLite), a batch reads them first, so that a
        duplicate never reaches a handler, without taking the write lock.
        """
        if not message_ids:
            return set()
        t = self.table
        query = select(t.c.message_id).where(t.c.port == port, t.c.message_id.in_(set(message_ids)))
        with self.store.engine.connect() as conn:
            return {str(row[0]) for row in conn.execute(query)}

    def forget_once(self, port: str, message_id: str, replay: str) -> bool:
        """Delete one row, so that a replayed message is handled again (``mdb dlq replay``),
        unless replay ``replay`` deleted it before; whether it did now.

        A replay killed between its confirmed copy and the acknowledgment of the
        original leaves the original where it was; run again, it must not forget
        the row that the first copy committed since, or the second copy would be
        applied as well. So the first forgetting claims a row of its own,
        ``(REPLAY_MARKS, replay)``, in the same transaction as the delete; it is
        purged with the dedup rows past retention.
        """
        t = self.table
        mark = {"port": REPLAY_MARKS, "message_id": replay, "processed_at": utcnow()}
        with self.store.engine.begin() as conn:
            if conn.execute(self._claim, mark).first() is None:
                return False
            conn.execute(delete(t).where(t.c.port == port, t.c.message_id == message_id))
        return True

    def purge(self, older_than: timedelta, *, batch: int = PURGE_BATCH) -> int:
        """Delete rows older than ``older_than`` in short batches; return how many went.

        Short batches keep each transaction's locks brief, so deliveries are never
        blocked behind one huge DELETE.
        """
        cutoff = utcnow() - older_than
        total = 0
        with self.store.engine.connect() as lock_conn:
            if not self._lock(lock_conn):
                log.debug("another container is purging the dedup table")
                return 0
            try:
                while True:
                    removed = self._purge_batch(cutoff, batch)
                    total += removed
                    if removed < batch:
                        break
                self._purge_deliveries(cutoff)
            finally:
                self._unlock(lock_conn)
        return total

    def _purge_batch(self, cutoff: Any, batch: int) -> int:
        t = self.table
        keys = (
            select(t.c.port, t.c.message_id)
            .where(t.c.processed_at < cutoff)
            .order_by(t.c.processed_at)
            .limit(batch)
        )
        with self.store.engine.begin() as conn:
            rows = conn.execute(keys).all()
            if not rows:
                return 0
            for port in {r.port for r in rows}:
                ids = [r.message_id for r in rows if r.port == port]
                conn.execute(delete(t).where(t.c.port == port, t.c.message_id.in_(ids)))
        return len(rows)

    def _purge_deliveries(self, cutoff: Any) -> None:
        t = self.store.tables.delivery
        with self.store.engine.begin() as conn:
            conn.execute(delete(t).where(t.c.updated_at < cutoff))

    def _lock(self, conn: Any) -> bool:
        if self.store.dialect != "postgresql":
            return True
        got = conn.execute(
            text(f"SELECT pg_try_advisory_lock({PURGE_LOCK_CLASS}, hashtext(:table))"),
            {"table": self._lock_name()},
        ).scalar()
        conn.commit()
        return bool(got)

    def _lock_name(self) -> str:
        t = self.table
        return f"{t.schema}.{t.name}" if t.schema else t.name

    def _unlock(self, conn: Any) -> None:
        if self.store.dialect == "postgresql":
            conn.execute(
                text(f"SELECT pg_advisory_unlock({PURGE_LOCK_CLASS}, hashtext(:table))"),
                {"table": self._lock_name()},
            )
            conn.commit()

    def count(self, port: str | None = None) -> int:
        from sqlalchemy import func

        query = select(func.count()).select_from(self.table)
        if port is not None:
            query = query.where(self.table.c.port == port)
        with self.store.engine.connect() as conn:
            return int(conn.execute(query).scalar() or 0)
