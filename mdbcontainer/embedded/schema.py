"""The broker file: its tables, their migration, and how a connection opens.

Everything the broker knows (queues, consumers, exchanges, bindings,
messages) is a table here, so any process that opens the same file sees
the same broker.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: UPDATE ... RETURNING needs SQLite 3.35.
MIN_SQLITE = (3, 35, 0)
SCHEMA_VERSION = 1
DEFAULT_BUSY_TIMEOUT = 10.0
SYNCHRONOUS_MODES = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS broker_queues (
        name TEXT PRIMARY KEY,
        arguments TEXT NOT NULL DEFAULT '{}',
        max_priority INTEGER NOT NULL DEFAULT 0,
        message_ttl INTEGER,
        exclusive_owner TEXT,
        auto_delete INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL
    )""",
    # Consumers of all processes, so that an auto-delete queue goes when
    # its last consumer does (and a dead process's consumers are known).
    """CREATE TABLE IF NOT EXISTS broker_consumers (
        owner TEXT NOT NULL,
        tag TEXT NOT NULL,
        queue TEXT NOT NULL,
        PRIMARY KEY (owner, tag)
    )""",
    "CREATE INDEX IF NOT EXISTS broker_consumers_queue ON broker_consumers (queue)",
    """CREATE TABLE IF NOT EXISTS broker_exchanges (
        name TEXT PRIMARY KEY,
        type TEXT NOT NULL,
        durable INTEGER NOT NULL DEFAULT 1,
        auto_delete INTEGER NOT NULL DEFAULT 0,
        arguments TEXT NOT NULL DEFAULT '{}'
    )""",
    """CREATE TABLE IF NOT EXISTS broker_bindings (
        exchange TEXT NOT NULL,
        queue TEXT NOT NULL,
        routing_key TEXT NOT NULL,
        arguments TEXT NOT NULL DEFAULT '{}',
        PRIMARY KEY (exchange, queue, routing_key)
    )""",
    "CREATE INDEX IF NOT EXISTS broker_bindings_queue ON broker_bindings (queue)",
    """CREATE TABLE IF NOT EXISTS broker_messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        queue TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        payload TEXT NOT NULL,
        published_at REAL NOT NULL,
        expires_at REAL,
        claimed_by TEXT,
        claim TEXT,
        claimed_at REAL,
        delivery_count INTEGER NOT NULL DEFAULT 0,
        redelivered INTEGER NOT NULL DEFAULT 0
    )""",
    # Serves the claim query (queue, unclaimed, priority DESC, id) and
    # per-queue deletes.
    """CREATE INDEX IF NOT EXISTS broker_messages_ready
        ON broker_messages (queue, claimed_by, priority DESC, id)""",
    """CREATE INDEX IF NOT EXISTS broker_messages_claimed
        ON broker_messages (claimed_by) WHERE claimed_by IS NOT NULL""",
    """CREATE INDEX IF NOT EXISTS broker_messages_expiry
        ON broker_messages (queue, expires_at) WHERE expires_at IS NOT NULL""",
    """INSERT OR IGNORE INTO broker_exchanges (name, type) VALUES
        ('amq.direct', 'direct'), ('amq.topic', 'topic'),
        ('amq.fanout', 'fanout')""",
)


def db_path(hostname: str | None) -> str:
    """Turn ``embedded:///abs/b.db``, ``embedded://rel.db`` or a path into a path."""
    text = hostname or ""
    if "://" in text:
        text = text.split("://", 1)[1]
    text = text.split("?", 1)[0]
    if not text:
        raise ValueError("embedded broker: no database path in the URL")
    return os.path.expanduser(text)


def json_args(arguments: dict[str, Any] | None) -> str:
    """Arguments as stored: sorted keys, so equal arguments compare equal."""
    return json.dumps(arguments or {}, sort_keys=True, default=str)


def connect(path: str, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
    """Open the broker file in WAL mode with its schema in place.

    Autocommit mode (isolation_level=None): transactions are explicit
    ``BEGIN IMMEDIATE`` blocks, so a writer waits on the busy timeout
    instead of failing when another process holds the write lock.
    """
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise RuntimeError(f"embedded broker needs SQLite >= 3.35 (found {sqlite3.sqlite_version})")
    mode = synchronous.upper()
    if mode not in SYNCHRONOUS_MODES:
        raise ValueError(f"embedded broker: bad synchronous mode {synchronous!r}")
    db = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        _enable_wal(db, busy_timeout)
        db.execute(f"PRAGMA synchronous = {mode}")
        _ensure_schema(db)
    except BaseException:
        db.close()
        raise
    return db


def _enable_wal(db: sqlite3.Connection, busy_timeout: float) -> None:
    """Switch to WAL, retrying: the switch may not wait on the busy handler."""
    deadline = time.monotonic() + busy_timeout
    while True:
        try:
            if db.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal":
                return
        except sqlite3.OperationalError:
            pass
        if time.monotonic() > deadline:
            raise sqlite3.OperationalError("embedded broker: cannot enable WAL mode")
        time.sleep(0.02)


@contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction that takes the write lock up front."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _ensure_schema(db: sqlite3.Connection) -> None:
    """Create the tables once; the version check keeps later opens read-only."""
    if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
        return
    with immediate(db):
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(f"embedded broker: unknown schema version {version}")
        for statement in _SCHEMA:
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
