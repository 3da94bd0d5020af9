"""The container's tables, in the user's database beside the business tables.

They live in ``container.database_url`` because one transaction must cover a
handler's work and its dedup row (and its outbox sends). Names carry
``container.table_prefix`` and, where set, ``container.db_schema``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property, lru_cache
from importlib import import_module
from typing import TYPE_CHECKING, Any

import tenacity
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Engine,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from ..settings import ContainerSettings
from ..support import clock

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from sqlalchemy.orm import Session, sessionmaker


def utcnow() -> datetime:
    return clock.now()


@dataclass(frozen=True)
class Tables:
    """The container's tables for one prefix and schema."""

    metadata: MetaData
    dedup: Table
    delivery: Table
    outbox: Table
    port: Table
    container: Table
    history: Table
    lease: Table
    held: Table

    @classmethod
    def build(cls, prefix: str = "mdb_", schema: str | None = None) -> Tables:
        md = MetaData(schema=schema)
        ts = DateTime(timezone=True)
        dedup = Table(
            f"{prefix}dedup", md,
            Column("port", String(200), primary_key=True),
            Column("message_id", String(255), primary_key=True),
            Column("processed_at", ts, nullable=False),
            Index(f"ix_{prefix}dedup_processed_at", "processed_at"),
        )  # fmt: skip
        # Counts of earlier deliveries, kept durable so that a crash or a second
        # replica never resets them (a count in memory loops forever).
        delivery = Table(
            f"{prefix}delivery", md,
            Column("queue", String(255), primary_key=True),
            Column("message_id", String(255), primary_key=True),
            Column("opened", Integer, nullable=False, default=0),
            Column("closed", Integer, nullable=False, default=0),
            Column("failures", Integer, nullable=False, default=0),
            Column("last_exception", Text),
            Column("updated_at", ts, nullable=False),
            Index(f"ix_{prefix}delivery_updated_at", "updated_at"),
        )  # fmt: skip
        outbox = Table(
            f"{prefix}outbox", md,
            Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                   autoincrement=True),
            Column("created_at", ts, nullable=False),
            Column("port", String(200), nullable=False),
            Column("exchange", String(255), nullable=False),
            Column("routing_key", String(255), nullable=False),
            Column("declare_queue", String(255)),
            Column("mandatory", Boolean, nullable=False),
            Column("body", LargeBinary, nullable=False),
            Column("properties", Text, nullable=False),
            Index(f"ix_{prefix}outbox_created_at", "created_at"),
            # SQLite reuses the highest rowid once its row is deleted; AUTOINCREMENT never does,
            # so an id names one row for ever (Outbox.dispatch deletes by id what it published).
            sqlite_autoincrement=True,
        )  # fmt: skip
        port = Table(
            f"{prefix}port", md,
            Column("name", String(200), primary_key=True),
            Column("state", String(16), nullable=False),
            Column("reason", Text),
            Column("since", ts, nullable=False),
            Column("generation", Integer, nullable=False, default=0),
        )  # fmt: skip
        container = Table(
            f"{prefix}container", md,
            Column("id", String(64), primary_key=True),
            Column("host", String(255), nullable=False),
            Column("pid", Integer, nullable=False),
            Column("started_at", ts, nullable=False),
            Column("heartbeat_at", ts, nullable=False),
            Column("stopped", Boolean, nullable=False, default=False),
            Column("stats", Text, nullable=False),
        )  # fmt: skip
        # What operators did (port stop/start, replay, purge), from the console or the CLI.
        history = Table(
            f"{prefix}history", md,
            Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                   autoincrement=True),
            Column("at", ts, nullable=False),
            Column("action", String(16), nullable=False),
            Column("target", String(255), nullable=False),
            Column("detail", Text, nullable=False),
            Column("origin", String(255), nullable=False),
            Column("actor", String(255)),
            Index(f"ix_{prefix}history_at", "at"),
        )  # fmt: skip
        # One row per consumer connection, written before it consumes: a
        # redelivery without a count record is charged as a crash only when a
        # lease of its queue shows a death (never ended, its holder gone), not
        # when a container that lives on lost its connection (counts.py).
        lease = Table(
            f"{prefix}lease", md,
            Column("id", String(64), primary_key=True),
            Column("queue", String(255), nullable=False),
            Column("container", String(64), nullable=False),
            Column("host", String(255), nullable=False),
            Column("pid", Integer, nullable=False),
            Column("started_at", ts, nullable=False),
            Column("ended_at", ts),
            Column("died", Boolean, nullable=False, default=False),
            Index(f"ix_{prefix}lease_queue", "queue"),
        )  # fmt: skip
        # The keys of ordered ports held after a backout (on_backout = "hold"), fleet-wide,
        # until ``mdb port release`` deletes the row or a replay of the message does (holds.py).
        held = Table(
            f"{prefix}held_key", md,
            Column("port", String(200), primary_key=True),
            Column("key", String(255), primary_key=True),
            Column("message_id", String(255), nullable=False),
            Column("held_at", ts, nullable=False),
        )  # fmt: skip
        return cls(md, dedup, delivery, outbox, port, container, history, lease, held)


_SQLITE_BUSY = timedelta(seconds=30)  # without a database_timeout (tools that pass none)
# libpq-based drivers take these connection parameters.
_LIBPQ_DRIVERS = frozenset({"psycopg", "psycopg2", "psycopg2cffi"})


def timeout_parameters(timeout: timedelta) -> dict[str, Any]:
    """libpq parameters that bound a PostgreSQL connection's every wait by ``timeout``.

    A connection on a network gone silent fails within the bound instead of
    the kernel's retransmission timeout (many minutes): the connect times out,
    keepalives probe an idle connection (after a third of the bound, three
    probes a sixth of it apart), and data unacknowledged for the bound ends it
    (TCP user timeout). The server ends a session left idle inside a
    transaction for as long, so a container that vanished mid-delivery does
    not keep its uncommitted dedup claims locked for hours.
    """
    seconds = max(1, math.ceil(timeout.total_seconds()))
    return {
        "connect_timeout": max(2, seconds),  # libpq takes less than 2 as 2
        "keepalives": 1,
        "keepalives_idle": max(1, seconds // 3),
        "keepalives_interval": max(1, seconds // 6),
        "keepalives_count": 3,
        "tcp_user_timeout": seconds * 1000,
        "options": f"-c idle_in_transaction_session_timeout={seconds * 1000}",
    }


def make_engine(url: str, *, timeout: timedelta | None = None, **kwargs: Any) -> Engine:
    """An engine for ``url``; on SQLite, WAL, a busy timeout and explicit BEGINs.

    ``timeout`` (``[container] database_timeout``): on PostgreSQL, the bound of
    :func:`timeout_parameters`; parameters the URL sets itself are kept. On
    SQLite, the busy timeout: how long a write waits for the one write lock.

    On SQLite a plain (deferred) BEGIN lets readers such as ``mdb ports`` run
    beside a handler's open transaction; the container's units of work claim
    their dedup rows last, so a handler holds the write lock only from its own
    first write to the commit, never while it computes or waits.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # No pre-ping: it is a round trip on every delivery. A connection found
        # dead is an infrastructure fault the delivery waits out and retries, and
        # SQLAlchemy then drops every pooled connection of that generation.
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)
        if timeout is not None and parsed.get_driver_name() in _LIBPQ_DRIVERS:
            given = parsed.query
            extra = {k: v for k, v in timeout_parameters(timeout).items() if k not in given}
            if "options" in given:  # the URL's own server options, and the idle timeout after them
                ours = timeout_parameters(timeout)["options"]
                extra["options"] = f"{given['options']} {ours}"
            kwargs["connect_args"] = {**extra, **kwargs.get("connect_args", {})}
        return create_engine(url, **kwargs)
    if parsed.database and parsed.database != ":memory:":
        from pathlib import Path

        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    # The busy timeout: how long a write waits for SQLite's one write lock (database_timeout).
    busy = (timeout or _SQLITE_BUSY).total_seconds()
    engine = create_engine(url, connect_args={"timeout": busy, "check_same_thread": False}, **kwargs)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver's own implicit BEGIN would take a read lock and fail on upgrade.
        dbapi_connection.isolation_level = None
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute(f"PRAGMA busy_timeout={round(busy * 1000)}")
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        # ``sqlite_begin="IMMEDIATE"``: a transaction that must write after it reads (the outbox
        # relay) takes the write lock first, instead of failing on a stale snapshot at its write.
        mode = connection.get_execution_options().get("sqlite_begin")
        connection.exec_driver_sql(f"BEGIN {mode}" if mode == "IMMEDIATE" else "BEGIN")

    return engine


# Connections a container process holds at once besides its consumers': the control loop
# (port switches, heartbeats), the housekeeping (the dedup purge keeps its lock on one
# connection while it deletes on another) and the outbox relay (its rounds; its listener,
# on PostgreSQL, is a connection of its own, detached from the pool).
OWN_CONNECTIONS = 3


def async_url(url: str) -> str:
    """The async driver for ``database_url``: psycopg's async mode, or aiosqlite.

    The URL is otherwise the same (host, database, the query's parameters), so
    an async handler's ``ctx.session`` writes to the database the container's
    tables are in, and its dedup row commits with its work.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg_async").render_as_string(hide_password=False)
    if backend == "sqlite":
        return parsed.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False)
    raise ValueError(f"async handlers need PostgreSQL or SQLite, not {backend!r}")


def make_async_engine(url: str, *, timeout: timedelta | None, tasks: int) -> AsyncEngine:
    """An async engine for ``url`` with a pool for ``tasks`` tasks, set up as :func:`make_engine`'s.

    One per event loop: an async driver's connections belong to the loop that
    opened them. A container-managed task holds one connection from its claim
    to its commit, so the pool has one per task and one for the loop's own reads.
    """
    from sqlalchemy.ext.asyncio import create_async_engine

    parsed = make_url(url)
    kwargs: dict[str, Any] = {}
    if not (parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:")):
        kwargs.update(pool_size=tasks + 1, max_overflow=OWN_CONNECTIONS)
    if parsed.get_backend_name() != "sqlite":
        if timeout is not None and parsed.get_driver_name() in _LIBPQ_DRIVERS:
            given = parsed.query
            extra = {k: v for k, v in timeout_parameters(timeout).items() if k not in given}
            kwargs["connect_args"] = extra
        return create_async_engine(async_url(url), **kwargs)
    busy = (timeout or _SQLITE_BUSY).total_seconds()
    engine = create_async_engine(async_url(url), connect_args={"timeout": busy}, **kwargs)

    @event.listens_for(engine.sync_engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # explicit BEGINs, as the synchronous engine
        cursor = dbapi_connection.cursor()
        for pragma in ("journal_mode=WAL", f"busy_timeout={round(busy * 1000)}", "synchronous=NORMAL"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN")

    return engine


def pool_for(url: str, consumers: int) -> dict[str, int]:
    """Pool sizes for a container of ``consumers`` consumers (the sum of its ports' ``concurrency``).

    A container-managed unit of work claims its dedup row first and holds that
    connection for the whole handler, so every consumer may hold one at once: a
    fixed pool smaller than that makes the consumers past it wait on the pool,
    time out, and report the database unavailable. The pool opens connections
    only as they are needed; ``max_overflow`` is headroom, never the plan.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        return {}  # one in-memory database per connection: SQLAlchemy's own pool, no sizes
    return {"pool_size": consumers + OWN_CONNECTIONS, "max_overflow": OWN_CONNECTIONS}


@lru_cache(maxsize=16)
def _tables(prefix: str, schema: str | None) -> Tables:
    """The tables of a prefix and schema, built once per process: a Table holds no connection,
    and a process that starts many containers (mdbcontainer.testing) pays for them once."""
    return Tables.build(prefix, schema)


class Store:
    """The database side of a container: engine, session factory and tables."""

    def __init__(self, settings: ContainerSettings, engine: Engine | None = None, *,
                 consumers: int | None = None) -> None:
        """``consumers``: a container's, to size its pool (:func:`pool_for`); without it (the
        CLI's commands, the supervisor) the pool keeps :func:`make_engine`'s defaults."""
        sizes = pool_for(settings.database_url, consumers) if consumers is not None else {}
        self.engine = engine or make_engine(settings.database_url, timeout=settings.database_timeout,
                                            **sizes)
        self.url = settings.database_url
        self.timeout = settings.database_timeout
        self.tables = _tables(settings.table_prefix, settings.db_schema)
        self.dialect = self.engine.dialect.name
        self._local = threading.local()
        # The dialect's ON CONFLICT insert; only that dialect's module (the engine loaded it).
        dialect = "postgresql" if self.dialect == "postgresql" else "sqlite"
        self._insert: Callable[[Table], Any] = import_module(f"sqlalchemy.dialects.{dialect}").insert

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        """The session factory, made on first use: the ORM is a tenth of a second to import, and
        a command (``mdb ports``, ``mdb port stop``) or a port without transactions never needs it."""
        from sqlalchemy.orm import sessionmaker

        return sessionmaker(bind=self.engine, expire_on_commit=False)

    def create_tables(self) -> None:
        """Create the container's tables where missing (idempotent, safe from several processes)."""
        if self.dialect != "sqlite":
            self._create_tables()
            return
        # SQLite: a deferred transaction that read the schema cannot take the write lock
        # while another process creates the tables (SQLITE_BUSY, no wait): try again.
        tenacity.Retrying(retry=tenacity.retry_if_exception_type(OperationalError), reraise=True,
                          stop=tenacity.stop_after_attempt(40), wait=tenacity.wait_fixed(0.05),
                          )(self._create_tables)

    def _create_tables(self) -> None:
        with self.engine.begin() as conn:
            schema = self.tables.metadata.schema
            if schema and self.dialect == "postgresql":
                conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            if self.dialect == "postgresql":
                # Two containers starting at once must not race on CREATE TABLE.
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7426001)")
            self.tables.metadata.create_all(conn)

    def insert(self, table: Table) -> Any:
        """The dialect's INSERT, the one with ``ON CONFLICT`` (PostgreSQL and SQLite alike)."""
        return self._insert(table)

    def session(self) -> Session:
        """This thread's Session, reused across deliveries (each unit of work closes it after use).

        Building a Session per delivery costs more than the dedup claim's own
        statement; a closed Session holds nothing, so a consumer thread keeps one.
        """
        session: Session | None = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self.sessions()
        return session

    def async_engine(self, tasks: int) -> AsyncEngine:
        """A new async engine on this store's database for one event loop of ``tasks`` tasks."""
        return make_async_engine(self.url, timeout=self.timeout, tasks=tasks)

    def dispose(self) -> None:
        self.engine.dispose()
