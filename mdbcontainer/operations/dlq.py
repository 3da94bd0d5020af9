"""Backout queues for people: browse, show, replay and purge (``mdb dlq``).

A backout queue is where a person looks at what failed and decides, so looking
must change nothing: browsing takes every message without acknowledging it and
then closes the channel, which hands them all back at their places (the
embedded broker is read directly). Replay is a move with the backout's own
order of durability, so an interruption may duplicate a message and never
loses one:

1. reset the durable redelivery count of (destination, message id),
2. publish a copy (body, id, properties intact, ``x-mdb-*`` headers removed)
   and wait for the broker's confirm,
3. only then acknowledge the original on the backout queue.

A duplicate from a crash between 2 and 3 is absorbed by the once-only dedup
table downstream; a backed-out message never committed there, so its copy is
not taken for one already processed. Messages not selected are never
acknowledged: closing the channel puts them back in their order.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from ..errors import BrokerUnavailable, DatabaseError, DlqError, MdbError, PublishError
from ..message import content_type_of
from ..settings import Settings
from ..state.database import database_errors
from ..state.history import record_cli
from ..support.crash import crash_point
from ..support.failures import describe
from ..support.outgoing import Outgoing
from ..wire.connection import Broker, connection_errors
from ..wire.delivery import Delivery, HeldMessages
from ..wire.headers import (
    BACKOUT_REASON,
    BROKER_DELIVERY_COUNT,
    EXCEPTION,
    FAILED_AT,
    ORIGINAL_DESTINATION,
    PORT,
    PREFIX,
    REASON_INVALID,
    REASONS,
    REDELIVERY_COUNT,
)
from ..wire.publisher import Publisher
from ..wire.queues import Browsed, QueueSession

# The exception's last line, whole in the table's second line up to this many characters
# (``mdb dlq show ID`` prints all of it).
SUMMARY_WIDTH = 300
# ``mdb dlq show`` prints this much of a body unless asked for --full: a 2 MB body
# would scroll the headers and the exception out of sight.
BODY_PREVIEW = 2000
# Backouts the container makes itself (a failed delivery's work never committed).
CONTAINER_REASONS = frozenset(REASONS)


@dataclass(frozen=True)
class BackedOutMessage:
    """One message on a backout queue, as a person inspecting it wants to see it.

    The command is ``mdb dlq`` and the default queue the setting ``dead_letter_queue``
    (IBM MQ's names, fixed by the contract), but the message was backed out:
    dead-lettering is the broker's own move of an expired or rejected message.
    """

    queue: str
    id: str | None
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: bytes
    content_type: str

    @property
    def original_destination(self) -> str | None:
        return _text_or_none(self.headers.get(ORIGINAL_DESTINATION))

    @property
    def exception(self) -> str:
        return str(self.headers.get(EXCEPTION) or "")

    def summary(self) -> str:
        """The exception in one line: a traceback's last line names the type and message."""
        lines = [line for line in self.exception.splitlines() if line.strip()]
        text = lines[-1].strip() if lines else ""
        return text if len(text) <= SUMMARY_WIDTH else text[: SUMMARY_WIDTH - 1] + "…"

    def to_json(self) -> dict[str, Any]:
        """The ``mdb dlq list --json`` object (README: The mdb command), plus queue and encodings."""
        body, encoding = decode_for_display(self.body, self.content_type)
        count = self.headers.get(REDELIVERY_COUNT)
        return {
            "id": self.id,
            "original_destination": self.original_destination,
            "port": _text_or_none(self.headers.get(PORT)),
            "reason": _text_or_none(self.headers.get(BACKOUT_REASON)),
            "redelivery_count": count if isinstance(count, int) else None,
            "failed_at": _text_or_none(self.headers.get(FAILED_AT)),
            "headers": self.headers,
            "body": body,
            "queue": self.queue,
            "content_type": self.content_type,
            "body_encoding": encoding,
        }


@dataclass
class ReplayResult:
    """What a replay did: how many moved, which ids it did not find, why it stopped."""

    replayed: int = 0
    invalid: list[str] = field(default_factory=list)  # replayed invalid bodies: they come straight back
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def decode_for_display(body: bytes, content_type: str) -> tuple[Any, str]:
    """JSON when it is JSON, else text; bytes that are not UTF-8 as base64 (and says which)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(body).decode("ascii"), "base64"
    if content_type_of(content_type).endswith("json"):
        with suppress(ValueError):
            return json.loads(text), "json"
    return text, "text"


def _json_default(value: Any) -> Any:
    """Header values JSON has no type for (AMQP timestamps, decimals, byte strings)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return decode_for_display(value, "")[0]
    return str(value)


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=_json_default, ensure_ascii=False)


def header_text(value: Any) -> str:
    """One header value as one line of JSON (``mdb dlq show``)."""
    return json.dumps(value, default=_json_default, ensure_ascii=False)


# -- reading messages ------------------------------------------------------------


def _backed_out(queue: str, message: Browsed) -> BackedOutMessage:
    return BackedOutMessage(
        queue=queue,
        id=_text_or_none(message.properties.get("message_id")),
        headers=message.headers,
        properties=message.properties,
        body=message.body,
        content_type=message.content_type,
    )


@contextmanager
def _session(broker: Broker) -> Iterator[QueueSession]:
    """A dedicated connection and channel; closing it hands back whatever was not acknowledged."""
    queues = QueueSession(broker)
    try:
        yield queues
    except connection_errors() as exc:
        lost = f"broker {broker.masked_url}: connection lost: {describe(exc)}"
        raise BrokerUnavailable(lost) from exc
    finally:
        queues.close()


def _open_queue(broker: Broker, queues: QueueSession, queue: str) -> None:
    """Declare a backout queue the settings name; any other queue must already exist."""
    if queue in broker.settings.backout_queues():
        try:
            queues.declare(queue)
        except connection_errors():
            raise
        except Exception as exc:  # it exists with other arguments: the broker closed the channel
            raise DlqError(f"backout queue {queue!r} cannot be declared as the settings say: "
                           f"{describe(exc)}") from exc
        return
    try:
        queues.status(queue)
    except connection_errors():
        raise
    except Exception as exc:
        raise DlqError(f"queue {queue!r} does not exist on broker {broker.masked_url}") from exc


def _browse_one(broker: Broker, queues: QueueSession, queue: str,
                limit: int | None = None) -> tuple[list[BackedOutMessage], int]:
    """The first ``limit`` messages of ``queue`` (all with None), and how many it holds."""
    _open_queue(broker, queues, queue)
    taken, total = queues.browse(queue, limit)
    return [_backed_out(queue, m) for m in taken], total


def browse(settings: Settings, queue: str | None = None, limit: int | None = None) -> list[BackedOutMessage]:
    """The messages of a backout queue (default: the dead-letter queue), in order; all stay."""
    return browse_page(settings, queue, limit)[0]


def browse_page(settings: Settings, queue: str | None = None,
                limit: int | None = None) -> tuple[list[BackedOutMessage], int]:
    """The first ``limit`` messages of a backout queue and how many it holds; all stay."""
    broker = Broker(settings)
    with _session(broker) as queues:
        return _browse_one(broker, queues, queue or settings.container.dead_letter_queue, limit)


def _sources(settings: Settings, queue: str | None) -> list[str]:
    return [queue] if queue else settings.backout_queues()


def find(settings: Settings, message_id: str, queue: str | None = None) -> list[BackedOutMessage]:
    """Every copy of ``message_id`` on ``queue``, else on the backout queues the settings name."""
    broker = Broker(settings)
    sources = _sources(settings, queue)
    found: list[BackedOutMessage] = []
    for source in sources:
        with _session(broker) as queues:  # one channel each: hand back before the next
            found += [d for d in _browse_one(broker, queues, source)[0] if d.id == message_id]
    if not found:
        raise DlqError(f"message {message_id!r} not found on {', '.join(sources)}")
    return found


# -- replay and purge ------------------------------------------------------------------


def replay_headers(headers: dict[str, Any]) -> dict[str, Any]:
    """The headers the message had before it failed: no ``x-mdb-*``, not the broker's count.

    The broker's count is of deliveries from the backout queue, not the message's own.
    """
    return {k: v for k, v in headers.items() if not k.startswith(PREFIX) and k != BROKER_DELIVERY_COUNT}


class Replayer:
    """Moves messages off backout queues: count reset, confirmed copy, then the acknowledgment."""

    def __init__(self, settings: Settings, to: str | None) -> None:
        from ..state.counts import DeliveryCounter
        from ..state.dedup import Dedup
        from ..state.store import Store

        self.settings = settings
        self.broker = Broker(settings)
        self.to = to
        self.store = Store(settings.container)
        try:
            with database_errors():
                self.store.create_tables()
        except DatabaseError as exc:
            raise DlqError(f"database: {exc}") from exc.__cause__
        self.counter = DeliveryCounter(self.store)
        self.dedup = Dedup(self.store)
        self.publisher = Publisher(self.broker)

    def move(self, held: HeldMessages, message: Delivery) -> str | None:
        """Replay one message; return why it stayed on its queue, or None once it moved."""
        source = held.queue
        mid = message.message_id
        destination = self.to or _text_or_none(message.headers.get(ORIGINAL_DESTINATION))
        if not destination:
            return f"message {mid!r} on {source} has no {ORIGINAL_DESTINATION} header: use --to"
        try:
            with database_errors():
                if mid:
                    self.counter.reset(destination, str(mid))
                    self._forget_handled(message, str(mid), destination)
                self._publish(message.copy_to(destination, replay_headers(message.headers), replace=True))
        except DatabaseError as exc:
            raise DlqError(f"cannot reset the redelivery count: {exc}") from exc.__cause__
        except connection_errors() as exc:
            raise PublishError(f"publish to {destination!r} failed: {describe(exc)}") from exc
        crash_point("mid-replay")
        held.remove(message)  # only after the confirm: a crash before this duplicates, never loses
        return None

    def _forget_handled(self, message: Delivery, mid: str, destination: str) -> None:
        """A message the handler moved (``ctx.move_to``) was handled: its dedup row committed.

        Without deleting it, the copy replayed to its port would be acknowledged
        as a duplicate and never reach the handler. A message the container
        backed out never committed a row; one found there was written by a copy
        of an earlier, interrupted replay, and must stay to absorb this one.
        """
        headers = message.headers
        port = _text_or_none(headers.get(PORT))
        reason = _text_or_none(headers.get(BACKOUT_REASON))
        if (port and reason not in CONTAINER_REASONS
                and destination == _text_or_none(headers.get(ORIGINAL_DESTINATION))):
            self.dedup.forget_once(port, mid, replay_key(port, mid, headers))

    def _publish(self, copy: Outgoing) -> None:
        """Declare the destination as the container does; publish confirmed, mandatory to queues."""
        exchange, routing_key, mandatory = self.publisher.route(copy.destination)
        self.publisher.publish(exchange=exchange, routing_key=routing_key, body=copy.body,
                               properties=copy.properties, mandatory=mandatory)

    def close(self) -> None:
        self.publisher.close()
        self.store.dispose()


def replay_key(port: str, mid: str, headers: dict[str, Any]) -> str:
    """What names one move of a message to a backout queue: port, id and when it was moved.

    A hash, to fit the dedup table's id column whatever the id's length. The
    same message moved again later (handled, then moved once more) has a new
    ``x-mdb-failed-at``, so its replay forgets the row of that handling.
    """
    moved = _text_or_none(headers.get(FAILED_AT)) or ""
    return hashlib.sha256("\x00".join((port, mid, moved)).encode()).hexdigest()


def replay(
    settings: Settings, ids: list[str], *, replay_all: bool = False, queue: str | None = None,
    to: str | None = None, into: ReplayResult | None = None,
) -> ReplayResult:
    """Move the messages ``ids`` (or all) from ``queue``, else the settings' backout queues, back.

    Stops at the first message it cannot move (a refused publish, a database
    error); that one and every message not selected stay where they were. A
    queue it cannot open, or a lost connection, raises: ``into`` is the result
    to fill, so that the caller still sees what moved before.
    """
    broker = Broker(settings)
    result = into if into is not None else ReplayResult()
    seen: set[str] = set()
    replayer = Replayer(settings, to)
    try:
        for source in _sources(settings, queue):
            with _session(broker) as queues:
                _open_queue(broker, queues, source)
                if not _replay_from(replayer, queues, source, ids, replay_all, result, seen):
                    break
    finally:
        replayer.close()
    result.missing = [i for i in dict.fromkeys(ids) if i not in seen]
    return result


def _replay_from(replayer: Replayer, queues: QueueSession, source: str, ids: list[str], replay_all: bool,
                 result: ReplayResult, seen: set[str]) -> bool:
    """Replay the selected messages of one queue; False when a failure says stop."""
    held = queues.hold(source)
    for message in held.take_all():
        mid = message.message_id
        if not (replay_all or mid in ids):
            continue  # never acknowledged: back in its place when the channel closes
        seen.add(str(mid))
        try:
            problem = replayer.move(held, message)
        except MdbError as exc:
            result.problems.append(f"message {mid!r} stays on {source}: {exc}")
            return False
        if problem:
            result.problems.append(problem)
        else:
            result.replayed += 1
            if message.headers.get(BACKOUT_REASON) == REASON_INVALID:
                result.invalid.append(str(mid))
    return True


def purge(settings: Settings, queue: str | None = None) -> tuple[str, int]:
    """Empty a backout queue (default: the dead-letter queue); return its name and how many went."""
    broker = Broker(settings)
    name = queue or settings.container.dead_letter_queue
    with _session(broker) as queues:
        _open_queue(broker, queues, name)
        return name, queues.purge(name)


# -- what the commands do, recorded in the history ------------------------------------


def replay_recorded(
    settings: Settings, ids: list[str], replay_all: bool, queue: str | None, to: str | None,
    record: Callable[[str, str], None] | None = None,
) -> ReplayResult:
    """Replay, and write what happened to the history: ``record(target, detail)``, else as the CLI.

    Also when the replay raises part-way (a backout queue it cannot open, a
    lost connection): the messages moved before it are moved for good, and the
    history says so and why it stopped. A history that cannot be written then does not hide that error.
    """
    write = record or (lambda target, detail: record_cli(settings, "replay", target, detail))
    target = queue or ", ".join(settings.backout_queues())
    result = ReplayResult()
    try:
        replay(settings, ids, replay_all=replay_all, queue=queue, to=to, into=result)
    except Exception as exc:
        with suppress(Exception):
            write(target, f"{replay_detail(result, ids, replay_all, to)}; stopped: {describe(exc)}")
        raise
    write(target, replay_detail(result, ids, replay_all, to))
    return result


def replay_problems(settings: Settings, result: ReplayResult, queue: str | None) -> list[str]:
    """Why a replay is a failure (exit 1): the ids not found, then the refused publishes."""
    problems = list(result.problems)
    if result.missing:
        where = queue or ", ".join(settings.backout_queues())
        problems.insert(0, f"not found on {where}: {', '.join(result.missing)}")
    return problems


def replay_detail(result: ReplayResult, ids: list[str], replay_all: bool, to: str | None) -> str:
    """A replay as the history shows it: how many moved, of which ids, where, what stayed."""
    which = "all" if replay_all else ", ".join(ids)
    text = f"replayed {result.replayed} message(s) ({which})" + (f" to {to}" if to else "")
    if result.missing:
        text += f"; not found: {', '.join(result.missing)}"
    return "; ".join([text, *result.problems])


def purge_recorded(settings: Settings, queue: str | None) -> tuple[str, int]:
    """``mdb dlq purge``: empty the queue, and write how many went to the history."""
    name, count = purge(settings, queue)
    record_cli(settings, "purge", name, f"purged {count} message(s)")
    return name, count
