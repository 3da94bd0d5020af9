"""Embedded broker: a kombu virtual transport stored in one SQLite file.

Why not kombu's ``sqla+sqlite`` transport: it never deletes fetched rows, it
strands the messages of a killed process, it requeues rejected messages at
the tail and it keeps exchange bindings in process memory.  This transport
keeps the whole broker (queues, exchanges, bindings, messages) in the
database file, so any process that opens the same file sees the same broker,
and it behaves like a RabbitMQ classic queue where it matters to the
container:

* a delivery *claims* its row; ``ack`` deletes it; ``reject(requeue=True)``,
  ``recover`` and closing the channel unclaim it, so it keeps its place at the
  head of the queue and comes back with ``redelivered=True``;
* a claim names its owner process (host, pid, process start time); claims of
  a process that died are released when a channel opens and every few
  seconds while consuming, so a SIGKILL loses nothing;
* every delivery carries ``x-delivery-count`` (previous counted deliveries,
  as RabbitMQ quorum queues do), which survives crashes;
* direct, topic and fanout exchanges with bindings shared by all processes,
  ``x-max-priority``, per-message and per-queue TTL and dead-lettering.

Usage::

    import mdbcontainer.embedded
    kombu.Connection("embedded:///abs/path/broker.db")
    kombu.Connection(hostname="broker.db", transport=mdbcontainer.embedded.Transport)
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from queue import Empty
from typing import Any, cast

from amqp.exceptions import ChannelError, NotFound, PreconditionFailed
from amqp.protocol import queue_declare_ok_t
from kombu.log import get_logger
from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.utils import json as kombu_json

__all__ = [
    "Channel",
    "Transport",
    "Unroutable",
    "browse",
    "db_path",
    "topic_matches",
]

logger = get_logger(__name__)

Payload = dict[str, Any]

# kombu's JSON (datetime, Decimal, UUID and bytes survive the round trip);
# payloads are never pickled.
dumps = cast(Callable[[Any], str], kombu_json.dumps)
loads = cast(Callable[[str], Any], kombu_json.loads)

#: UPDATE ... RETURNING needs SQLite 3.35.
MIN_SQLITE = (3, 35, 0)
SCHEMA_VERSION = 1
DEFAULT_BUSY_TIMEOUT = 10.0
DEFAULT_RECLAIM_INTERVAL = 3.0
EXCHANGE_TYPES = frozenset({"direct", "topic", "fanout"})
SYNCHRONOUS_MODES = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
DELIVERY_COUNT_HEADER = "x-delivery-count"

# AMQP method signatures, so amqp exceptions print the method that failed.
_EXCHANGE_DECLARE = (40, 10)
_EXCHANGE_DELETE = (40, 20)
_QUEUE_DECLARE = (50, 10)
_QUEUE_BIND = (50, 20)
_QUEUE_DELETE = (50, 40)
_BASIC_PUBLISH = (60, 40)
_BASIC_RETURN = (60, 50)

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

_INSERT_MESSAGE = """
    INSERT INTO broker_messages (queue, priority, payload, published_at, expires_at)
    SELECT name, MAX(0, MIN(?, max_priority)), ?, ?,
           CASE WHEN message_ttl IS NULL THEN ?
                ELSE MIN(COALESCE(?, 1e300), ? + message_ttl / 1000.0) END
    FROM broker_queues WHERE name = ?"""

_NEXT_READY = """
    SELECT id FROM broker_messages WHERE queue = ? AND claimed_by IS NULL
    ORDER BY priority DESC, id LIMIT 1"""

_CLAIM = f"""
    UPDATE broker_messages
    SET claimed_by = ?, claim = ?, claimed_at = ?, delivery_count = delivery_count + 1
    WHERE id = ({_NEXT_READY})
    RETURNING id, payload, delivery_count, redelivered"""

_TAKE = f"""
    DELETE FROM broker_messages WHERE id = ({_NEXT_READY})
    RETURNING id, payload, delivery_count + 1, redelivered"""

_UNCLAIM = """
    UPDATE broker_messages
    SET claimed_by = NULL, claim = NULL, claimed_at = NULL, redelivered = 1,
        delivery_count = MAX(0, delivery_count - ?)
    WHERE id = ? AND claim = ?"""


# ---------------------------------------------------------------- errors ---


class Unroutable(ChannelError):  # type: ignore[misc]
    """A mandatory publish that no queue took (AMQP ``basic.return`` 312).

    py-amqp raises a ChannelError with code 312 from a confirmed publish
    whose return nobody handles; raising the same kind here lets callers
    treat both brokers alike.
    """

    code = 312


def _not_found(what: str, name: str, method: tuple[int, int]) -> NotFound:
    return NotFound(f"NOT_FOUND - no {what} '{name}' in vhost '/'", method)


def _precondition(text: str, method: tuple[int, int]) -> PreconditionFailed:
    return PreconditionFailed(f"PRECONDITION_FAILED - {text}", method)


# ------------------------------------------------------- owner liveness ---


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """Return (state, start time) of `pid` from /proc, or None off Linux.

    The start time (field 22, clock ticks since boot) tells a live process
    from a later one that reused its pid.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields 3.. of stat(5)
    if len(fields) < 20:
        return None
    return fields[0], fields[19]


_HOST = socket.gethostname()
_tokens: dict[int, str] = {}


def owner_token() -> str:
    """Identify this process in claims: ``host:pid:start-time``.

    Computed per pid so that a forked child does not inherit its parent's
    identity.
    """
    pid = os.getpid()
    token = _tokens.get(pid)
    if token is None:
        stat = _proc_stat(pid)
        token = _tokens[pid] = f"{_HOST}:{pid}:{stat[1] if stat else '?'}"
    return token


#: Channels of this process that are open; their claims are live.
_open_channels: set[str] = set()


def channel_token(channel_id: str) -> str:
    """Identify one channel in claims: ``host:pid:start-time/channel-id``."""
    return f"{owner_token()}/{channel_id}"


def owner_alive(token: str) -> bool:
    """Tell whether the channel named by a claim token may still be open.

    In this process, a channel closed without handing its claims back (its
    database was locked then) is dead.  Another process counts as alive
    until it exits; a zombie (SIGKILLed, not yet reaped) is dead.  Claims
    of another host are assumed alive: there is no way to check them.
    """
    process, _, channel_id = token.partition("/")
    if process == owner_token():
        return not channel_id or channel_id in _open_channels
    try:
        host, pid_text, start = process.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False  # not a token this module wrote
    if host != _HOST:
        return True
    return _process_alive(pid, start)


def _process_alive(pid: int, start: str) -> bool:
    """os.kill probes the pid; /proc's start time tells pid reuse apart."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to someone else
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: trust the pid
    state, started = stat
    return state not in ("Z", "X") and (start == "?" or started == start)


# --------------------------------------------------------------- routing ---


@lru_cache(maxsize=4096)
def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP topic match: ``*`` is one word, ``#`` zero or more words."""
    pattern = binding_key.split(".")
    words = routing_key.split(".")
    # reachable[j]: the pattern prefix seen so far can match words[:j]
    reachable = [True] + [False] * len(words)
    for part in pattern:
        if part == "#":
            for j in range(1, len(words) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
            continue
        nxt = [False] * (len(words) + 1)
        for j in range(1, len(words) + 1):
            nxt[j] = reachable[j - 1] and (part == "*" or part == words[j - 1])
        reachable = nxt
    return reachable[-1]


def _binding_matches(kind: str, binding_key: str, routing_key: str) -> bool:
    if kind == "fanout":
        return True
    if kind == "topic":
        return topic_matches(binding_key, routing_key)
    return binding_key == routing_key


# --------------------------------------------------------------- helpers ---


def db_path(hostname: str | None) -> str:
    """Turn ``embedded:///abs/b.db``, ``embedded://rel.db`` or a path into a path."""
    text = hostname or ""
    if "://" in text:
        text = text.split("://", 1)[1]
    text = text.split("?", 1)[0]
    if not text:
        raise ValueError("embedded broker: no database path in the URL")
    return os.path.expanduser(text)


def _json_args(arguments: dict[str, Any] | None) -> str:
    return json.dumps(arguments or {}, sort_keys=True, default=str)


def _expires_at(properties: dict[str, Any], now: float) -> float | None:
    """Absolute expiry from the AMQP ``expiration`` property (ms as text)."""
    expiration = properties.get("expiration")
    if expiration in (None, ""):
        return None
    try:
        return now + max(0, int(expiration)) / 1000.0
    except (TypeError, ValueError):
        return None


def _priority(properties: dict[str, Any]) -> int:
    try:
        return int(properties.get("priority") or 0)
    except (TypeError, ValueError):
        return 0


def _split_tag(tag: Any) -> tuple[int, str] | None:
    """Delivery tags are ``row-id:claim``; anything else is not ours."""
    row, sep, claim = str(tag).partition(":")
    if not sep or not row.isdigit():
        return None
    return int(row), claim


def _as_delivery(row: tuple[int, str, int, int], claim: str) -> Payload:
    """Build the payload kombu sees for a claimed row.

    The delivery tag carries the row id and the claim, so any channel can
    ack it and a stale tag cannot touch a later claim of the same row.
    """
    row_id, raw, count, redelivered = row
    payload: Payload = loads(raw)
    props = payload.setdefault("properties", {})
    props["delivery_tag"] = f"{row_id}:{claim}"
    info = props.get("delivery_info") or {}
    info["redelivered"] = bool(redelivered) or count > 1
    props["delivery_info"] = info
    headers = payload.get("headers") or {}
    headers[DELIVERY_COUNT_HEADER] = max(0, count - 1)
    payload["headers"] = headers
    return payload


def _mark_death(payload: Payload, queue: str, reason: str) -> None:
    """Add RabbitMQ-style ``x-death`` headers to a dead-lettered payload."""
    props = payload.setdefault("properties", {})
    info = props.get("delivery_info") or {}
    headers = payload.get("headers") or {}
    entry: dict[str, Any] = {
        "queue": queue,
        "reason": reason,
        "count": 1,
        "exchange": info.get("exchange") or "",
        "routing-keys": [info.get("routing_key") or ""],
        "time": datetime.now(UTC),
    }
    expiration = props.pop("expiration", None)  # must not expire again
    if expiration is not None:
        entry["original-expiration"] = expiration
    deaths = [dict(d) for d in headers.get("x-death") or []]
    for old in deaths:
        if old.get("queue") == queue and old.get("reason") == reason:
            entry["count"] = int(old.get("count", 0)) + 1
            deaths.remove(old)
            break
    headers["x-death"] = [entry, *deaths]
    for key, value in (("queue", queue), ("reason", reason), ("exchange", entry["exchange"])):
        headers.setdefault(f"x-first-death-{key}", value)
        headers[f"x-last-death-{key}"] = value
    payload["headers"] = headers


# ----------------------------------------------------------------- store ---


def _connect(path: str, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
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
def _immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
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
    if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
        return
    with _immediate(db):
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            return
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(f"embedded broker: unknown schema version {version}")
        for statement in _SCHEMA:
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


class Store:
    """Broker operations on one SQLite connection (one per kombu channel).

    Every public method holds a lock, because kombu lets other threads ack
    while the consuming thread polls on the same channel.
    """

    def __init__(
        self,
        path: str,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        synchronous: str = "NORMAL",
    ) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.db = _connect(path, busy_timeout, synchronous)

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # -- queues ---------------------------------------------------------

    def queue_arguments(self, queue: str) -> dict[str, Any] | None:
        row = self.db.execute(
            "SELECT arguments FROM broker_queues WHERE name = ?", (queue,)
        ).fetchone()
        return None if row is None else json.loads(row[0])

    def has_queue(self, queue: str) -> bool:
        with self.lock:
            return self.queue_arguments(queue) is not None

    def declare_queue(
        self,
        queue: str,
        arguments: dict[str, Any] | None,
        exclusive_owner: str | None = None,
        auto_delete: bool = False,
    ) -> None:
        """Create the queue, or check an existing one has the same arguments.

        INSERT OR IGNORE makes concurrent declares from several processes
        safe; a different set of arguments is refused as RabbitMQ does.
        """
        args = json.loads(_json_args(arguments))
        max_priority = int(args.get("x-max-priority") or 0)
        ttl = args.get("x-message-ttl")
        with self.lock, _immediate(self.db) as db:
            db.execute(
                "INSERT OR IGNORE INTO broker_queues (name, arguments, max_priority,"
                " message_ttl, exclusive_owner, auto_delete, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    queue,
                    _json_args(args),
                    max_priority,
                    None if ttl is None else int(ttl),
                    exclusive_owner,
                    int(auto_delete),
                    time.time(),
                ),
            )
            current = self.queue_arguments(queue)
        if current != args:
            raise _precondition(
                f"inequivalent arguments for queue '{queue}' in vhost '/':"
                f" received {args} but current is {current}",
                _QUEUE_DECLARE,
            )

    def delete_queue(self, queue: str, if_empty: bool = False) -> int:
        """Drop the queue, its bindings and messages; return ready count."""
        with self.lock, _immediate(self.db):
            count = self._ready_count(queue)
            if if_empty and count:
                raise _precondition(f"queue '{queue}' in vhost '/' is not empty", _QUEUE_DELETE)
            self._drop_queue(queue)
        return count

    def _drop_queue(self, queue: str) -> None:
        for table, column in (
            ("broker_messages", "queue"),
            ("broker_bindings", "queue"),
            ("broker_consumers", "queue"),
            ("broker_queues", "name"),
        ):
            self.db.execute(f"DELETE FROM {table} WHERE {column} = ?", (queue,))

    def consumer_count(self, queue: str) -> int:
        with self.lock:
            row = self.db.execute(
                "SELECT COUNT(*) FROM broker_consumers WHERE queue = ?", (queue,)
            ).fetchone()
        return int(row[0])

    def add_consumer(self, queue: str, owner: str, tag: str) -> None:
        with self.lock:
            self.db.execute(
                "INSERT OR REPLACE INTO broker_consumers (owner, tag, queue) VALUES (?, ?, ?)",
                (owner, tag, queue),
            )

    def remove_consumers(self, owner: str, tag: str | None = None) -> None:
        """Forget consumers; an auto-delete queue left without any goes too."""
        where, params = (
            ("owner = ?", (owner,)) if tag is None else ("owner = ? AND tag = ?", (owner, tag))
        )
        with self.lock, _immediate(self.db) as db:
            queues = {
                r[0]
                for r in db.execute(
                    f"DELETE FROM broker_consumers WHERE {where} RETURNING queue", params
                )
            }
            for queue in sorted(queues):
                if db.execute(
                    "SELECT 1 FROM broker_queues WHERE name = ? AND auto_delete = 1"
                    " AND NOT EXISTS (SELECT 1 FROM broker_consumers WHERE queue = ?)",
                    (queue, queue),
                ).fetchone():
                    self._drop_queue(queue)

    def _ready_count(self, queue: str) -> int:
        return int(
            self.db.execute(
                "SELECT COUNT(*) FROM broker_messages WHERE queue = ? AND claimed_by IS NULL",
                (queue,),
            ).fetchone()[0]
        )

    def size(self, queue: str) -> int:
        with self.lock:
            return self._ready_count(queue)

    def purge(self, queue: str) -> int:
        """Delete ready messages; unacked ones stay, as in RabbitMQ."""
        with self.lock:
            return self.db.execute(
                "DELETE FROM broker_messages WHERE queue = ? AND claimed_by IS NULL",
                (queue,),
            ).rowcount

    # -- exchanges and bindings ----------------------------------------

    def exchange_type(self, exchange: str) -> str | None:
        row = self.db.execute(
            "SELECT type FROM broker_exchanges WHERE name = ?", (exchange,)
        ).fetchone()
        return None if row is None else str(row[0])

    def declare_exchange(
        self,
        exchange: str,
        kind: str,
        durable: bool,
        auto_delete: bool,
        arguments: dict[str, Any] | None,
    ) -> None:
        if kind not in EXCHANGE_TYPES:
            raise ChannelError(
                f"NOT_IMPLEMENTED - exchange type '{kind}' is not supported by the embedded broker",
                _EXCHANGE_DECLARE,
                reply_code=540,
            )
        with self.lock, _immediate(self.db) as db:
            db.execute(
                "INSERT OR IGNORE INTO broker_exchanges (name, type, durable,"
                " auto_delete, arguments) VALUES (?, ?, ?, ?, ?)",
                (exchange, kind, int(durable), int(auto_delete), _json_args(arguments)),
            )
            current = self.exchange_type(exchange)
        if current != kind:
            raise _precondition(
                f"inequivalent arg 'type' for exchange '{exchange}' in vhost '/':"
                f" received '{kind}' but current is '{current}'",
                _EXCHANGE_DECLARE,
            )

    def has_exchange(self, exchange: str) -> bool:
        with self.lock:
            return self.exchange_type(exchange) is not None

    def delete_exchange(self, exchange: str, if_unused: bool = False) -> None:
        with self.lock, _immediate(self.db) as db:
            used = db.execute(
                "SELECT 1 FROM broker_bindings WHERE exchange = ? LIMIT 1", (exchange,)
            ).fetchone()
            if if_unused and used:
                raise _precondition(f"exchange '{exchange}' in vhost '/' in use", _EXCHANGE_DELETE)
            db.execute("DELETE FROM broker_bindings WHERE exchange = ?", (exchange,))
            db.execute("DELETE FROM broker_exchanges WHERE name = ?", (exchange,))

    def bind(
        self, queue: str, exchange: str, routing_key: str, arguments: dict[str, Any] | None
    ) -> None:
        with self.lock, _immediate(self.db) as db:
            if self.exchange_type(exchange) is None:
                raise _not_found("exchange", exchange, _QUEUE_BIND)
            if self.queue_arguments(queue) is None:
                raise _not_found("queue", queue, _QUEUE_BIND)
            db.execute(
                "INSERT OR IGNORE INTO broker_bindings (exchange, queue, routing_key,"
                " arguments) VALUES (?, ?, ?, ?)",
                (exchange, queue, routing_key, _json_args(arguments)),
            )

    def unbind(self, queue: str, exchange: str, routing_key: str) -> None:
        with self.lock:
            self.db.execute(
                "DELETE FROM broker_bindings WHERE exchange = ? AND queue = ? AND routing_key = ?",
                (exchange, queue, routing_key),
            )

    def bindings(self, exchange: str | None = None) -> list[tuple[str, str, str]]:
        """(queue, exchange, routing key) rows, of one exchange or all."""
        sql = "SELECT queue, exchange, routing_key FROM broker_bindings"
        with self.lock:
            if exchange is None:
                rows = self.db.execute(sql + " ORDER BY exchange, queue").fetchall()
            else:
                rows = self.db.execute(sql + " WHERE exchange = ?", (exchange,)).fetchall()
        return [(str(q), str(e), str(k)) for q, e, k in rows]

    def exchanges(self) -> list[str]:
        with self.lock:
            return [r[0] for r in self.db.execute("SELECT name FROM broker_exchanges")]

    def route(self, exchange: str, routing_key: str, method: tuple[int, int] | None) -> list[str]:
        """Queues a publish reaches; a missing exchange raises if `method` is given."""
        if not exchange:
            return [routing_key]
        kind = self.exchange_type(exchange)
        if kind is None:
            if method is None:
                return []  # e.g. a missing dead-letter exchange: dropped
            raise _not_found("exchange", exchange, method)
        rows = self.db.execute(
            "SELECT queue, routing_key FROM broker_bindings WHERE exchange = ? ORDER BY queue",
            (exchange,),
        ).fetchall()
        return sorted({q for q, key in rows if _binding_matches(kind, key, routing_key)})

    # -- messages -------------------------------------------------------

    def _insert(self, queue: str, payload: Payload, raw: str, now: float) -> int:
        props = payload.get("properties") or {}
        expires = _expires_at(props, now)
        return self.db.execute(
            _INSERT_MESSAGE,
            (_priority(props), raw, now, expires, expires, now, queue),
        ).rowcount

    def put(self, queue: str, payload: Payload) -> int:
        """Store into one queue; 0 if the queue does not exist (dropped)."""
        with self.lock:
            return self._insert(queue, payload, dumps(payload), time.time())

    def publish(self, exchange: str, routing_key: str, payload: Payload) -> int:
        """Route and store atomically; return how many queues took it."""
        raw = dumps(payload)
        now = time.time()
        with self.lock:
            if not exchange:
                return self._insert(routing_key, payload, raw, now)
            with _immediate(self.db):
                queues = self.route(exchange, routing_key, _BASIC_PUBLISH)
                return sum(self._insert(q, payload, raw, now) for q in queues)

    def claim(self, queue: str, owner: str, auto_ack: bool) -> Payload | None:
        """Claim (or, with auto_ack, take) the head of `queue`.

        A lock-free read first, so that polling an empty queue never takes
        the write lock; then expiry and the claim in one IMMEDIATE
        transaction.
        """
        with self.lock:
            if (
                self.db.execute(
                    "SELECT 1 FROM broker_messages WHERE queue = ? AND claimed_by IS NULL LIMIT 1",
                    (queue,),
                ).fetchone()
                is None
            ):
                return None
            claim = uuid.uuid4().hex
            now = time.time()
            with _immediate(self.db) as db:
                self._expire(queue, now)
                if auto_ack:
                    row = db.execute(_TAKE, (queue,)).fetchone()
                else:
                    row = db.execute(_CLAIM, (owner, claim, now, queue)).fetchone()
        return None if row is None else _as_delivery(row, claim)

    def _expire(self, queue: str, now: float) -> None:
        rows = self.db.execute(
            "DELETE FROM broker_messages WHERE queue = ? AND expires_at IS NOT NULL"
            " AND expires_at <= ? AND claimed_by IS NULL RETURNING id, payload",
            (queue, now),
        ).fetchall()
        if rows:
            self._dead_letter(queue, sorted(rows), "expired", now)

    def _dead_letter(
        self, queue: str, rows: list[tuple[int, str]], reason: str, now: float
    ) -> None:
        """Republish removed rows to the queue's dead-letter exchange, if any."""
        args = self.queue_arguments(queue) or {}
        dlx = args.get("x-dead-letter-exchange")
        if dlx is None:
            return
        for _, raw in rows:
            payload: Payload = loads(raw)
            info = payload.get("properties", {}).get("delivery_info") or {}
            key = args.get("x-dead-letter-routing-key") or info.get("routing_key") or ""
            _mark_death(payload, queue, reason)
            payload["properties"]["delivery_info"] = {"exchange": dlx, "routing_key": key}
            body = dumps(payload)
            for target in self.route(dlx, key, None):
                self._insert(target, payload, body, now)

    def ack(self, tags: list[tuple[int, str]]) -> None:
        with self.lock:
            self.db.executemany("DELETE FROM broker_messages WHERE id = ? AND claim = ?", tags)

    def requeue(self, tags: list[tuple[int, str]], counted: bool) -> None:
        """Unclaim in place (head of the queue).

        `counted` False undoes the claim's increment of delivery_count: a
        message handed back unprocessed (channel close, recover) was not a
        failed delivery.
        """
        with self.lock:
            self.db.executemany(
                _UNCLAIM, [(0 if counted else 1, row, claim) for row, claim in tags]
            )

    def reject(self, tags: list[tuple[int, str]]) -> None:
        """Delete rejected rows, dead-lettering them if their queue says so."""
        now = time.time()
        with self.lock, _immediate(self.db) as db:
            for row, claim in tags:
                found = db.execute(
                    "DELETE FROM broker_messages WHERE id = ? AND claim = ?"
                    " RETURNING queue, payload",
                    (row, claim),
                ).fetchone()
                if found is not None:
                    self._dead_letter(found[0], [(row, found[1])], "rejected", now)

    def release_dead_owners(self) -> int:
        """Unclaim messages, forget consumers, drop exclusive queues of the dead."""
        with self.lock:
            claimers = [
                r[0]
                for r in self.db.execute(
                    "SELECT DISTINCT claimed_by FROM broker_messages WHERE claimed_by IS NOT NULL"
                )
            ]
            owners = [
                r[0]
                for r in self.db.execute(
                    "SELECT DISTINCT exclusive_owner FROM broker_queues"
                    " WHERE exclusive_owner IS NOT NULL"
                )
            ]
            consumers = [
                r[0] for r in self.db.execute("SELECT DISTINCT owner FROM broker_consumers")
            ]
            released = 0
            for token in claimers:
                if not owner_alive(token):
                    released += self.db.execute(
                        "UPDATE broker_messages SET claimed_by = NULL, claim = NULL,"
                        " claimed_at = NULL, redelivered = 1 WHERE claimed_by = ?",
                        (token,),
                    ).rowcount
            for token in owners:
                if not owner_alive(token):
                    self._drop_exclusive(token)
            for token in consumers:
                if not owner_alive(token):
                    self.remove_consumers(token)
        if released:
            logger.info("embedded broker: released %d message(s) of dead consumers", released)
        return released

    def _drop_exclusive(self, token: str) -> None:
        names = [
            r[0]
            for r in self.db.execute(
                "SELECT name FROM broker_queues WHERE exclusive_owner = ?", (token,)
            )
        ]
        for name in names:
            self.delete_queue(name)

    def browse(self, queue: str) -> list[Payload]:
        with self.lock:
            rows = self.db.execute(
                "SELECT id, payload, delivery_count, redelivered, claimed_by"
                " FROM broker_messages WHERE queue = ?"
                " ORDER BY priority DESC, id",
                (queue,),
            ).fetchall()
        return [_browsed(row) for row in rows]


def _browsed(row: tuple[int, str, int, int, str | None]) -> Payload:
    """A stored row as tooling wants it: body decoded, claim state shown."""
    row_id, raw, count, redelivered, claimed_by = row
    payload = _as_delivery((row_id, raw, count + 1, redelivered), "browse")
    props = payload["properties"]
    body = payload.get("body")
    if body is not None and props.get("body_encoding") == "base64":
        body = base64.b64decode(body)
    elif isinstance(body, str):
        body = body.encode("utf-8")
    props.pop("body_encoding", None)
    props.pop("delivery_tag", None)
    payload["body"] = body
    payload["claimed"] = claimed_by is not None
    return payload


def browse(path: str, queue: str) -> list[Payload]:
    """Messages of `queue` in delivery order, without consuming them.

    Each item is a kombu payload dict (``body`` as bytes, ``headers`` with
    ``x-delivery-count``, ``properties``) plus ``claimed``: True while a
    consumer holds it.  A missing file yields [] and is not created.
    """
    path = db_path(path)
    if not os.path.exists(path):
        return []
    store = Store(path)
    try:
        return store.browse(queue)
    finally:
        store.close()


# ----------------------------------------------------------------- kombu ---


class Channel(virtual.Channel):
    """kombu channel whose state lives in the SQLite file, not in memory."""

    #: AMQP-style event handlers; ``basic_return`` gets unroutable mandatory
    #: publishes, as with py-amqp (kombu's Producer(on_return=...) uses it).
    events: defaultdict[str, set[Any]]

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)  # type: ignore[no-untyped-call]
        client = connection.client
        opts = client.transport_options
        self.events = defaultdict(set)
        self._no_ack_queues: set[str] = set()
        self._uid = uuid.uuid4().hex
        self._token = channel_token(self._uid)
        self._exclusive: set[str] = set()
        self._reclaim_interval = float(opts.get("reclaim_interval", DEFAULT_RECLAIM_INTERVAL))
        self._store: Store | None = Store(
            db_path(client.hostname),
            busy_timeout=float(opts.get("busy_timeout", DEFAULT_BUSY_TIMEOUT)),
            synchronous=str(opts.get("synchronous", "NORMAL")),
        )
        self._next_reclaim = 0.0
        _open_channels.add(self._uid)
        self._maybe_reclaim()

    @property
    def store(self) -> Store:
        if self._store is None:
            raise ChannelError("embedded broker: channel is closed")
        return self._store

    def _maybe_reclaim(self) -> None:
        """Release claims of dead processes, at most every few seconds."""
        now = time.monotonic()
        if now >= self._next_reclaim:
            self._next_reclaim = now + self._reclaim_interval
            self.store.release_dead_owners()

    # -- topology -------------------------------------------------------

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        kind = type or "direct"
        name = exchange or f"amq.{kind}"
        if passive:
            if not self.store.has_exchange(name):
                raise _not_found("exchange", name, _EXCHANGE_DECLARE)
            return
        self.store.declare_exchange(name, kind, durable, auto_delete, arguments)

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self.store.delete_exchange(exchange, if_unused=if_unused)

    def queue_declare(
        self,
        queue: str | None = None,
        passive: bool = False,
        arguments: dict[str, Any] | None = None,
        exclusive: bool = False,
        auto_delete: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Declare (persistently) or check a queue, like AMQP queue.declare."""
        name = queue or f"amq.gen-{uuid.uuid4()}"
        if passive:
            if not self.store.has_queue(name):
                raise _not_found("queue", name, _QUEUE_DECLARE)
        else:
            owner = self._token if exclusive else None
            self.store.declare_queue(name, arguments, owner, auto_delete)
            if exclusive:
                self._exclusive.add(name)
        return queue_declare_ok_t(name, self.store.size(name), self.store.consumer_count(name))

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> int:
        self._exclusive.discard(queue)
        return self.store.delete_queue(queue, if_empty=if_empty)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.store.bind(queue, exchange or "amq.direct", routing_key or "", arguments)

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.store.unbind(queue, exchange or "amq.direct", routing_key or "")

    def list_bindings(self) -> Iterator[tuple[str, str, str]]:
        return iter(self.store.bindings())

    def get_exchanges(self) -> list[str]:
        return self.store.exchanges()

    def get_table(self, exchange: str) -> list[tuple[str, None, str]]:
        return [(key, None, queue) for queue, _, key in self.store.bindings(exchange)]

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        with self.store.lock:
            kind = self.store.exchange_type(exchange)
        return self.exchange_types[kind or default]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        with self.store.lock:
            return self.store.route(exchange, routing_key, None)

    # -- virtual channel storage API --------------------------------------

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.store.declare_queue(queue, kwargs.get("arguments"))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _put(self, queue: str, message: Payload, **kwargs: Any) -> None:
        self.store.put(queue, message)

    def _get(self, queue: str, timeout: float | None = None) -> Payload:
        return self._fetch(queue, queue in self._no_ack_queues)

    def _fetch(self, queue: str, auto_ack: bool) -> Payload:
        self._maybe_reclaim()
        payload = self.store.claim(queue, self._token, auto_ack)
        if payload is None:
            raise Empty()
        return payload

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    # -- basic ------------------------------------------------------------

    def basic_publish(
        self, message: Payload, exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        """Route and store in one transaction; the publish is then durable.

        A mandatory publish nobody takes goes to ``basic_return`` handlers,
        or raises :class:`Unroutable` when there are none (py-amqp's way).
        """
        self._inplace_augment_message(  # type: ignore[no-untyped-call]
            message, exchange, routing_key
        )
        routed = self.store.publish(exchange or "", routing_key or "", message)
        if routed or not kwargs.get("mandatory"):
            return
        exc = Unroutable("NO_ROUTE", _BASIC_RETURN, reply_code=312)
        handlers = self.events.get("basic_return")
        if not handlers:
            raise exc
        returned = self.Message(message, channel=self)  # type: ignore[no-untyped-call]
        for handler in list(handlers):
            handler(exc, exchange, routing_key, returned)

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        """Consume; the consumer is recorded so auto-delete queues work."""
        if no_ack:
            self._no_ack_queues.add(queue)
        self.store.add_consumer(queue, self._token, consumer_tag)
        return super().basic_consume(  # type: ignore[no-untyped-call]
            queue, no_ack, callback, consumer_tag, **kwargs
        )

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)  # type: ignore[no-untyped-call]
        if queue is not None:
            if queue not in self._tag_to_queue.values():
                self._no_ack_queues.discard(queue)
            self.store.remove_consumers(self._token, consumer_tag)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        try:
            payload = self._fetch(queue, no_ack)
        except Empty:
            return None
        message = self.Message(payload, channel=self)  # type: ignore[no-untyped-call]
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def _settle(self, delivery_tag: Any, multiple: bool) -> list[tuple[int, str]]:
        """Tags to settle, marked done in QoS (which frees prefetch slots)."""
        tags = [delivery_tag]
        if multiple:
            self.qos._flush()
            pending = list(self.qos._delivered)
            if delivery_tag in pending:
                tags = pending[: pending.index(delivery_tag) + 1]
        for tag in tags:
            self.qos.ack(tag)
        return [t for t in map(_split_tag, tags) if t is not None]

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        self.store.ack(self._settle(delivery_tag, multiple))

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        self.basic_nack(delivery_tag, multiple=False, requeue=requeue)

    def basic_nack(self, delivery_tag: Any, multiple: bool = False, requeue: bool = True) -> None:
        """Requeue at the head (a counted failure) or drop/dead-letter."""
        tags = self._settle(delivery_tag, multiple)
        if requeue:
            self.store.requeue(tags, counted=True)
        else:
            self.store.reject(tags)

    def _restore(self, message: Any) -> None:
        """Hand back an unacked message (close, recover): unclaim in place.

        Replaces kombu's re-publish at the tail.  If the database refuses
        (locked past the busy timeout), the claim stays with this channel's
        token, which dies with the channel: the next reclaim in this process
        releases it, so there is nothing for kombu's emergency dump to save.
        """
        self.hand_back(message.delivery_tag)

    def hand_back(self, delivery_tag: Any) -> None:
        """Unclaim without counting a failed delivery."""
        tag = _split_tag(delivery_tag)
        if tag is None:
            return
        try:
            self.store.requeue([tag], counted=False)
        except (sqlite3.Error, ChannelError):
            logger.warning("embedded broker: could not hand back %s", delivery_tag, exc_info=True)

    def _restore_at_beginning(self, message: Any) -> None:
        tag = _split_tag(message.delivery_tag)
        if tag is not None:
            self.store.requeue([tag], counted=True)

    def close(self) -> None:
        """Unclaim unacked messages (via QoS), drop exclusive queues, close."""
        try:
            super().close()  # type: ignore[no-untyped-call]
        finally:
            store, self._store = self._store, None
            if store is not None:
                self._close_store(store)

    def _close_store(self, store: Store) -> None:
        try:
            for queue in self._exclusive:
                store.delete_queue(queue)
        except sqlite3.Error:
            logger.warning("embedded broker: could not delete exclusive queues", exc_info=True)
        finally:
            self._exclusive.clear()
            _open_channels.discard(self._uid)
            store.close()


class Transport(virtual.Transport):
    """kombu transport ``embedded://PATH``: a broker in one SQLite file."""

    Channel = Channel

    #: virtual transports poll; an empty poll is one indexed read.
    polling_interval = 0.05
    can_parse_url = True
    driver_type = "sqlite"
    driver_name = "sqlite3"

    #: "database is locked" past the busy timeout, I/O errors: transient,
    #: so kombu's ensure()/reconnect logic retries them.
    connection_errors = (  # type: ignore[assignment]
        *virtual.Transport.connection_errors,
        sqlite3.OperationalError,
    )
    channel_errors = (  # type: ignore[assignment]
        *virtual.Transport.channel_errors,
        sqlite3.IntegrityError,
    )

    implements = virtual.Transport.implements.extend(
        asynchronous=False,
        exchange_type=EXCHANGE_TYPES,
        heartbeats=False,
    )

    def driver_version(self) -> str:
        return sqlite3.sqlite_version

    def _reject_inbound_message(self, raw_message: Payload) -> None:
        """A message fetched for a queue whose consumer just went: hand it back.

        kombu would reject-requeue it, which here counts a failed delivery.
        """
        for channel in self.channels:
            if channel:
                channel.hand_back(raw_message["properties"]["delivery_tag"])
                return


# kombu resolves a URL scheme only through TRANSPORT_ALIASES, and refuses
# dotted module paths coming from URLs; registering the alias when this
# module is imported is what makes ``Connection("embedded:///path")`` work.
# It is this module's only import-time side effect.
TRANSPORT_ALIASES["embedded"] = "mdbcontainer.embedded:Transport"
