"""The per-delivery pipeline, step by step, as contract section 4 reads.

1. hand back        a stopping consumer returns what it was still sent
2. expire           an expired message never reaches the handler
3. identify         the message id (or the port's ``missing_id`` rule)
4. count            redeliveries only: dedup check, then the durable count
5. back out         a message delivered ``backout_threshold`` times leaves
6. decode           poison the container can see: ``invalid-body``
7. unit of work     the handler inside its transaction (CMT, BMT or none)
8. settle           publish the sends, acknowledge, or count the failure

Nothing is acknowledged before the outcome it stands for is durable: the
commit for handled work, the broker's confirm for a backed-out copy, the
failure count before a requeue.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from .backout import (
    REASON_INVALID,
    REASON_MISSING_ID,
    REASON_THRESHOLD,
    backout_headers,
    exception_text,
    redelivery_wait,
)
from .broker import DELIVERY_MODE_PERSISTENT, connection_errors, describe
from .context import MessageContext
from .crash import crash_point
from .errors import PublishError
from .handlers import Invoker
from .logs import fields
from .message import InvalidBody, Message, accepted, body_hash_id, decode_body, from_epoch
from .producer import Outgoing
from .transactions import Outcome, is_infrastructure, unit_class

if TYPE_CHECKING:
    from .port import Consumer, ListenerPort

log = logging.getLogger("mdbcontainer.delivery")

_TIMESTAMP_GRAIN = timedelta(seconds=1)
_PROPERTY_KEYS = (
    "content_type", "content_encoding", "delivery_mode", "priority", "correlation_id",
    "reply_to", "message_id", "timestamp", "type", "user_id", "app_id",
)


class Pipeline:
    """Runs every delivery of one consumer (one thread, one channel, one bean instance)."""

    def __init__(self, port: ListenerPort, consumer: Consumer) -> None:
        self.port = port
        self.consumer = consumer
        self.settings = port.settings
        self.queue = port.queue
        self.invoker = Invoker.for_spec(port.spec)
        self.unit_class = unit_class(self.settings.transaction, self.settings.transaction_attribute)
        self.once_only = self.settings.is_once_only
        self.threshold = port.queue_settings.backout_threshold
        self.accept = accepted(self.settings.accept)
        self.first_implicit = port.resources.capabilities.redelivered_flag
        self._started = time.monotonic()  # of the current delivery, for its log lines

    # -- the pipeline ------------------------------------------------------

    def __call__(self, raw: Any) -> None:
        """Process one delivery, marked in flight for /healthz and the in-flight gauge."""
        consumer = self.consumer
        consumer.delivering_since = self._started = time.monotonic()
        try:
            self._attempt(raw)
        finally:
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _attempt(self, raw: Any) -> None:
        """Database outages hold the delivery; broker outages reconnect."""
        waited = False
        attempt = 0
        while True:
            try:
                self._process(raw)
                if waited:
                    self.port.outage_over()
                return
            except connection_errors():
                raise
            except Exception as exc:
                if not is_infrastructure(exc):
                    self._internal_error(raw, exc)
                    return
                attempt += 1
                if not self.port.wait_out_outage(exc, attempt):
                    self.consumer.hand_back(raw)
                    return
                waited = True

    def _internal_error(self, raw: Any, exc: Exception) -> None:
        """A fault of the container itself (not the handler): requeue and stop the port, visibly."""
        log.exception("port %s: container error on message %s", self.port.name,
                      raw.properties.get("message_id"))
        raw.reject(requeue=True)
        self.port.stop_for_failures(str(raw.properties.get("message_id")), exc, internal=True)

    def _process(self, raw: Any) -> None:
        if self.consumer.handing_back or self.port.stopping:
            self.consumer.hand_back(raw)
            return
        if self._expired(raw):
            return
        message_id = self._identify(raw)
        if message_id is None:
            return
        count, last_error = self._count(raw, message_id)
        if count is None:
            return
        if self.threshold and count >= self.threshold:
            self.backout(raw, REASON_THRESHOLD, count, last_error)
            self.port.after_backout()
            return
        message = self._decode(raw, message_id, count)
        if message is None:
            return
        self._deliver(raw, message)

    def _expired(self, raw: Any) -> bool:
        expires_at = _expires_at(raw)
        # The AMQP timestamp has whole seconds: allow one, so nothing expires early.
        if expires_at is None or expires_at + _TIMESTAMP_GRAIN > datetime.now(UTC):
            return False
        expiry_queue = self.port.queue_settings.expiry_queue
        if expiry_queue:
            self._publish_copy(raw, expiry_queue, {"x-mdb-expired-at": datetime.now(UTC).isoformat()})
        raw.ack()
        self.port.record("expired")
        return True

    def _identify(self, raw: Any) -> str | None:
        message_id = raw.properties.get("message_id")
        if message_id:
            return str(message_id)
        if self.once_only and self.settings.missing_id == "backout":
            self.backout(raw, REASON_MISSING_ID, 0, "a once-only port needs an AMQP message_id")
            return None
        return body_hash_id(body_bytes(raw), raw.delivery_info.get("routing_key", ""))

    def _count(self, raw: Any, message_id: str) -> tuple[int | None, str | None]:
        """Earlier failed deliveries; free on a first delivery, one round trip on a redelivery."""
        redelivered = bool(raw.delivery_info.get("redelivered"))
        if not redelivered and self.first_implicit:
            return 0, None
        if self.once_only and self.port.resources.dedup_seen(self.port.name, message_id):
            raw.ack()
            self.port.record("duplicate_skipped")
            self._log(logging.INFO, "duplicate_skipped", message_id, None, "already handled, not again")
            return None, None
        attempt = self.port.resources.counter.open(
            self.queue, message_id, first_implicit=self.first_implicit
        )
        return attempt.count, attempt.last_exception

    def _decode(self, raw: Any, message_id: str, count: int) -> Message | None:
        try:
            message = envelope(raw, message_id, count, self.accept,
                               self.settings.max_message_bytes, self.queue)
            argument = self.invoker.argument(message)
        except InvalidBody as exc:
            self.backout(raw, REASON_INVALID, count, f"InvalidBody: {exc}", outcome="invalid_body")
            return None
        self._argument = argument
        return message

    def _deliver(self, raw: Any, message: Message) -> None:
        started = time.perf_counter()
        crash_point("before-handler")
        outcome = self._run(raw, message)
        waited = False
        attempt = 0
        while outcome.kind == "infrastructure":
            assert outcome.error is not None
            attempt += 1
            if not self.port.wait_out_outage(outcome.error, attempt):
                self.consumer.hand_back(raw, message.id)
                return
            waited = True
            outcome = self._run(raw, message)
        if waited:  # only a delivery that waited knows the database is back
            self.port.outage_over()
        self.port.observe(time.perf_counter() - started)
        if outcome.kind == "failed":
            self._failed(raw, message, outcome)
        else:
            self._settle(raw, message, outcome)

    def _run(self, raw: Any, message: Message) -> Outcome:
        assert message.id is not None
        unit = self.unit_class(
            self.port.name, message.id, self.port.resources.units,
            once_only=self.once_only,
            move_copy=lambda queue, reason: self._move_copy(raw, queue, reason),
            client_ack=self.consumer.acks.begin(raw, message.id),
        )
        ctx = MessageContext(message, self.port.name, unit)
        argument = self._argument
        return unit.run(lambda: self.invoker(argument, ctx))

    # -- outcomes ----------------------------------------------------------

    def _settle(self, raw: Any, message: Message, outcome: Outcome) -> None:
        publisher = self.consumer.publisher
        if outcome.pending:
            try:
                self.port.resources.outbox_dispatch(publisher, outcome.pending)
            except Exception as exc:  # the rows are committed: the relay sends them later
                log.warning("port %s: outbox publish deferred to the relay: %s",
                            self.port.name, describe(exc))
        try:
            for send in outcome.direct:
                self.consumer.publish(send)
        except PublishError as exc:  # not routed or not confirmed: the delivery is not done
            self._failed(raw, message, Outcome("failed", exc))
            return
        self.consumer.acks.settle(raw)  # now, or later: the port's acknowledge mode
        crash_point("after-ack")
        self.port.record("handled" if outcome.kind == "handled" else "duplicate_skipped")
        if outcome.kind != "handled":
            self._log(logging.INFO, "duplicate_skipped", message.id, None, "already handled, not again")
        if outcome.kind == "handled":
            self.port.after_success()
            self.port.resources.metrics.end_to_end(self.port.name, raw.properties.get("timestamp"))
            if log.isEnabledFor(logging.DEBUG):  # per successful message only when asked
                self._log(logging.DEBUG, "handled", raw.properties.get("message_id"), None, "")

    def _failed(self, raw: Any, message: Message, outcome: Outcome) -> None:
        assert outcome.error is not None and message.id is not None
        if self.consumer.acks.consumed(raw):  # ctx.acknowledge() came before the failure
            self._failed_consumed(message, outcome.error)
            return
        text = exception_text(outcome.error)
        count = message.redelivery_count + 1
        self._log(logging.WARNING, "failed", message.id, message.redelivery_count,
                  describe(outcome.error))
        self.port.resources.counter.fail(self.queue, message.id, text)
        self.port.record("failed")
        decision = self.port.after_failure()
        if decision == "stop":
            raw.reject(requeue=True)
            self.port.stop_for_failures(message.id, outcome.error)
        elif self.threshold and count >= self.threshold:
            self.backout(raw, REASON_THRESHOLD, count, text)
            self.port.after_backout()
        else:
            self._requeue(raw, count)

    def _failed_consumed(self, message: Message, error: BaseException) -> None:
        """A failure after the handler acknowledged: counted, but the message cannot go back."""
        log.warning("port %s: delivery failed after ctx.acknowledge(): message %s stays consumed: %s",
                    self.port.name, message.id, describe(error))
        self.port.record("failed")
        if self.port.after_failure() == "stop":
            self.port.stop_for_failures(str(message.id), error)

    def _requeue(self, raw: Any, failures: int) -> None:
        q = self.port.queue_settings
        wait = redelivery_wait(q.redelivery_delay, q.redelivery_backoff, q.redelivery_delay_max, failures)
        if wait:
            self.consumer.sleep(wait)
        raw.reject(requeue=True)

    def backout(self, raw: Any, reason: str, count: int, exception: str | None,
                outcome: str = "backed_out") -> None:
        """Move the message to its backout queue: confirmed copy first, then the acknowledgment.

        ``outcome`` is what the move counts as: an invalid body counts as
        ``invalid_body`` only, not also as ``backed_out``.
        """
        headers = backout_headers(
            dict(raw.headers or {}), reason=reason, destination=self.queue,
            port=self.port.name, count=count, exception=exception,
        )
        self._publish_copy(raw, self.port.backout_queue, headers, replace=True)
        crash_point("mid-backout")
        raw.ack()
        self.port.record(outcome)
        self._log(logging.WARNING, outcome, raw.properties.get("message_id"), count,
                  f"moved to {self.port.backout_queue} ({reason})")

    def _log(self, level: int, outcome: str, message_id: Any, count: int | None, detail: str) -> None:
        """One line per failed or backed-out delivery: its facts in the text and as fields."""
        duration = time.monotonic() - self._started
        label = {"failed": "delivery failed", "backed_out": "backed out",
                 "invalid_body": "invalid body, backed out"}.get(outcome, outcome)
        counted = "" if count is None else f", redelivery count {count}"
        log.log(level, "port %s: %s: message %s%s, after %.3fs%s", self.port.name, label, message_id,
                counted, duration, f": {detail}" if detail else "",
                extra=fields(port=self.port.name, message_id=message_id, redelivery_count=count,
                             outcome=outcome, duration=round(duration, 6)))

    def _publish_copy(self, raw: Any, queue: str, headers: dict[str, Any], replace: bool = False) -> None:
        self.consumer.publish(copy_of(raw, queue, headers, replace=replace))

    def _move_copy(self, raw: Any, queue: str, reason: str) -> Outgoing:
        headers = backout_headers(
            dict(raw.headers or {}), reason=reason, destination=self.queue, port=self.port.name,
            count=0, exception=None,
        )
        return copy_of(raw, queue, headers, replace=True)


def copy_of(raw: Any, queue: str, headers: dict[str, Any], replace: bool = False) -> Outgoing:
    """The message with body, id and properties intact, bound for ``queue``.

    The expiration is dropped: a message kept for a person to inspect must not
    vanish from the backout queue.
    """
    props = {k: raw.properties[k] for k in _PROPERTY_KEYS if raw.properties.get(k) is not None}
    props["headers"] = headers if replace else {**dict(raw.headers or {}), **headers}
    props.setdefault("content_type", raw.content_type or "application/octet-stream")
    return Outgoing(queue, body_bytes(raw), props)


def _expires_at(raw: Any) -> datetime | None:
    expiration = raw.properties.get("expiration")
    if not expiration:  # the common case: no datetime work at all
        return None
    stamp = from_epoch(raw.properties.get("timestamp"))
    if stamp is None:
        return None
    try:
        return stamp + timedelta(milliseconds=int(expiration))
    except (TypeError, ValueError, OverflowError):
        return None


def envelope(raw: Any, message_id: str, count: int, accept: list[str] | frozenset[str],
             max_bytes: int, destination: str) -> Message:
    """Build the handler's Message from a kombu message (decoding the body; may raise InvalidBody)."""
    props = raw.properties
    data = body_bytes(raw)
    body = decode_body(data, raw.content_type or "", accept, max_bytes)
    priority = props.get("priority")
    return Message(
        id=message_id,
        body=body,
        headers=dict(raw.headers or {}),
        redelivery_count=count,
        redelivered=bool(raw.delivery_info.get("redelivered")) or count > 0,
        priority=priority if isinstance(priority, int) and 0 <= priority <= 255 else 0,
        expires_at=_expires_at(raw),
        persistent=props.get("delivery_mode") == DELIVERY_MODE_PERSISTENT,  # AMQP: absent is transient
        reply_to=props.get("reply_to"),
        correlation_id=props.get("correlation_id"),
        timestamp=from_epoch(props.get("timestamp")),
        destination=destination,
        content_type=raw.content_type or "",
        raw=data,
    )


def body_bytes(raw: Any) -> bytes:
    """The body as bytes (py-amqp decodes it to str when the producer set a content encoding)."""
    body = raw.body
    if isinstance(body, bytes):
        return body
    return str(body).encode(raw.content_encoding or "utf-8", errors="surrogateescape")
