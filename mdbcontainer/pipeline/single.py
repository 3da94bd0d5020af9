"""The per-delivery pipeline, step by step, as the README's guarantees read (docs/architecture.md walks it).

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
failure count before a requeue. The pipeline decides *what* becomes of a
delivery; the port's acknowledgment mode (``acknowledge.py``) tells the
broker. It calls up into its port and consumer only through the two
Protocols below, which ``port.py`` meets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar

import tenacity

from ..errors import PublishError
from ..handlers.registry import HandlerSpec, Invoker, Running
from ..message import InvalidBody, Message, accepted, body_hash_id
from ..settings import PortSettings, QueueSettings
from ..state.metrics import Tally
from ..support import crash
from ..support.crash import crash_point
from ..support.failures import describe, exception_text
from ..support.logs import fields
from ..support.outgoing import Outgoing
from ..support.retry import DEFAULT as RETRY
from ..support.retry import RetryCondition
from ..support.tracing import NOTHING, Active, is_off
from ..units.context import MessageContext
from ..units.single import Outcome, RollbackOnly, UnitOfWork, failure, is_infrastructure, unit_class
from ..wire.connection import connection_errors
from ..wire.delays import Delays, came_back, carried_failure, left_after
from ..wire.delivery import WAIT_EXPIRES_AT, WAITED, Delivery, envelope
from ..wire.publisher import Publisher
from .acknowledge import Acknowledger
from .backout import REASON_INVALID, REASON_MISSING_ID, REASON_THRESHOLD, Backout
from .resources import SharedResources

log = logging.getLogger("mdbcontainer.pipeline")

_TIMESTAMP_GRAIN = timedelta(seconds=1)
_GAVE_UP = object()  # the port stopped while the database was away
T = TypeVar("T")
Decision = Literal["stop", "continue"]


def _infrastructure(outcome: Outcome) -> bool:
    return outcome.kind == "infrastructure"


class PortView(Protocol):
    """What the pipeline needs of its listener port (met by ``port.ListenerPort``)."""

    name: str
    settings: PortSettings
    spec: HandlerSpec
    resources: SharedResources
    queue_settings: QueueSettings
    backout_queue: str
    queue: str
    stop_event: threading.Event  # set when the port stops: every wait of a delivery ends early

    @property
    def stopping(self) -> bool: ...

    def after_success(self) -> None: ...

    def after_backout(self) -> None: ...

    def after_failure(self) -> Decision: ...

    def stop_for_failures(self, message_id: str, error: BaseException, *, internal: bool = False,
                          reason: str | None = None) -> None: ...


class ConsumerView(Protocol):
    """What the pipeline needs of the consumer it runs in (met by ``port.PortConsumer``)."""

    acks: Acknowledger
    running: Running  # the handler call in progress (an async port shows its oldest)
    tally: Tally  # the consumer's counts; only its own thread writes them
    handing_back: bool
    delivering_since: float | None
    alive_at: float

    @property
    def publisher(self) -> Publisher: ...

    def publish(self, message: Outgoing) -> None: ...


class Pipeline:
    """Runs every delivery of one consumer (one thread, one channel, one bean instance)."""

    def __init__(self, port: PortView, consumer: ConsumerView) -> None:
        self.port = port
        self.consumer = consumer
        self.acks = consumer.acks
        self.tally = consumer.tally
        self.stop_event = port.stop_event
        self.settings = port.settings
        self.queue = port.queue
        self.resources = port.resources
        self.invoker = Invoker.for_spec(port.spec)
        self.unit_class = unit_class(self.settings.transaction, self.settings.transaction_attribute)
        self.once_only = self.settings.is_once_only
        self.threshold = port.queue_settings.backout_threshold
        self.accept = accepted(self.settings.accept)
        self.backout = Backout(port.name, port.queue, port.backout_queue,
                               publish=consumer.publish, discard=self.acks.discard)
        self.delays = Delays(port.name, port.queue, port.queue_settings,
                             publish=consumer.publish, discard=self.acks.discard)
        self._started = time.monotonic()  # of the current delivery, for its log lines
        self._argument: Any = None
        self.tracing = port.resources.broker.tracing.for_port(port.name, port.settings.topic or port.queue)
        self._outcomes = port.resources.broker.tracing  # the current span's mdb.outcome
        self._span: Active = NOTHING  # the current delivery's (tracing.py)
        # A first delivery on a port without a transaction, acknowledged as its handler returns,
        # untraced, takes the flat path (_first): the same steps, without a call for each. Not in
        # a subclass (a batch gathers its deliveries in its own _deliver).
        self._flat = (type(self) is Pipeline and self.unit_class is UnitOfWork
                      and type(self.acks) is Acknowledger and is_off(self.tracing))

    # -- the pipeline ------------------------------------------------------

    def __call__(self, delivery: Delivery) -> None:
        """Process one delivery, marked in flight for /healthz and the in-flight gauge."""
        consumer = self.consumer
        consumer.delivering_since = self._started = time.monotonic()
        if self._flat:
            raw = delivery._raw
            properties, headers = raw.properties, raw.headers
            # Steps 1-4 of a first delivery, checked where they cost nothing: not handed back,
            # no expiry (nor one kept by a wait), an id, not redelivered (nor back from a wait).
            if (not consumer.handing_back and not self.stop_event.is_set()
                    and not properties.get("expiration") and (message_id := properties.get("message_id"))
                    and not raw.delivery_info.get("redelivered")
                    and (not headers or (WAITED not in headers and WAIT_EXPIRES_AT not in headers))):
                self._flat_call(delivery, message_id if type(message_id) is str else str(message_id))
                return
        self._span = self.tracing.process(delivery)
        try:
            if self._through_outages(self._process, delivery) is _GAVE_UP:
                self.acks.hand_back(delivery, delivery.message_id)
        except connection_errors():
            raise  # the broker is gone: the consumer reconnects; the broker requeues
        except Exception as exc:
            self._internal_error(delivery, exc)
        finally:
            self._span.end()
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _flat_call(self, delivery: Delivery, message_id: str) -> None:
        """:meth:`__call__` for a delivery that :meth:`_first` runs (tracing is off)."""
        consumer = self.consumer
        try:
            try:
                self._first(delivery, message_id)
            except Exception as exc:  # as _through_outages: the database away holds the delivery
                if not is_infrastructure(exc):
                    raise
                if self._wait_out(lambda: self._first(delivery, message_id), None, exc) is _GAVE_UP:
                    self.acks.hand_back(delivery, message_id)
        except connection_errors():
            raise  # the broker is gone: the consumer reconnects; the broker requeues
        except Exception as exc:
            self._internal_error(delivery, exc)
        finally:
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _first(self, delivery: Delivery, message_id: str) -> None:
        """Steps 6-8 of a first delivery on a ``transaction = "none"``, ``acknowledge = "auto"``
        port, in one function: the hot path of a port without a transaction.

        The caller checked steps 1-4 (not handed back, not expired, an id, a first
        delivery: count 0, so step 5 cannot back it out). The same thing happens
        as on :meth:`_process`'s way, crash points included, with a handler that
        returns; anything else (a failure, the database away, sends to publish)
        goes on through the pipeline's own steps from where it stands.
        """
        try:
            message = envelope(delivery, message_id, 0, self.accept, self.settings.max_message_bytes,
                               self.queue)
            invoker = self.invoker
            argument = self._argument = message if invoker.adapter is None else invoker.argument(message)
        except InvalidBody as exc:
            self._back_out(delivery, REASON_INVALID, 0, f"InvalidBody: {exc}", outcome="invalid_body")
            return
        started = self._started  # the handler's time counts from the delivery's start: one clock read
        if crash.ARMED:
            crash_point("before-handler")
        name = self.port.name
        unit = UnitOfWork(name, message_id, self.resources.units, once_only=self.once_only,
                          move_copy=lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None))
        ctx = MessageContext(message, name, unit)
        running = invoker.running  # Invoker.__call__ and UnitOfWork.run, inline
        running._ctx, running.warned, running.since = ctx, False, started
        function = invoker._function
        try:
            if function is None:
                invoker._call_bean(argument, ctx)
            elif invoker.takes_context:
                function(argument, ctx)
            else:
                function(argument)
            running.since = None
            if crash.ARMED:
                crash_point("in-handler")
            if unit.rollback_only:
                raise RollbackOnly
        except Exception as exc:
            running.since = None
            outcome = failure(exc)
            if outcome.kind == "infrastructure":  # as _through_outages around _run
                outcome = self._wait_out(lambda: self._run(delivery, message), _infrastructure, exc)
            self._conclude(delivery, message, outcome, started)
            return
        if unit._sends:  # they leave before the acknowledgment: step 8's own way
            self._conclude(delivery, message, Outcome("handled", direct=list(unit._sends)), started)
            return
        seconds = time.monotonic() - started
        self.acks.settle(delivery)
        if crash.ARMED:
            crash_point("after-ack")
        self.tally.handled(seconds, delivery._raw.properties.get("timestamp"))
        self.port.after_success()
        if log.isEnabledFor(logging.DEBUG):
            self._log(logging.DEBUG, "handled", message_id, None, "")

    # -- the consumer loop's hooks (the batch pipeline gathers; one delivery never waits) --

    def wait_limit(self, idle: float) -> float:
        """How long the consumer may block waiting for the next delivery."""
        return idle

    def due(self) -> bool:
        """Whether :meth:`tick` has work now (the consumer asks between deliveries, cheaply)."""
        return False

    def tick(self) -> None:
        """Called between deliveries when :meth:`due` (a batch whose linger is up runs here)."""

    def hand_back_gathered(self) -> None:
        """Graceful stop: hand back what was received but not started."""

    def release(self) -> None:
        """The channel is gone: forget what was received but not started."""

    def close(self) -> None:
        """The consumer ends: tear down its bean instance."""
        self.invoker.discard()

    def _through_outages(self, call: Callable[..., T], *args: Any,
                         failed: Callable[[T], bool] | None = None) -> Any:
        """Run ``call(*args)``, holding the delivery while the database is away (returns
        ``_GAVE_UP`` when the port stops meanwhile). The first try is outside tenacity, and
        makes no closure: the hot path."""
        try:
            result = call(*args)
        except Exception as exc:
            if not is_infrastructure(exc):
                raise
            return self._wait_out(lambda: call(*args), failed, exc)
        if failed is not None and failed(result):
            return self._wait_out(lambda: call(*args), failed, getattr(result, "error", None))
        return result

    def _wait_out(self, call: Callable[[], T], failed: Callable[[T], bool] | None,
                  error: BaseException | None) -> Any:
        self.resources.outage("database", error)
        retry: RetryCondition = tenacity.retry_if_exception(is_infrastructure)
        if failed is not None:
            retry = retry | tenacity.retry_if_result(failed)

        def away(state: tenacity.RetryCallState) -> None:
            if state.outcome is not None and state.outcome.failed:
                self.resources.outage("database", state.outcome.exception())

        result = RETRY.until_stopped(self.port.stop_event, retry=retry, before_sleep=away,
                                     give_up=lambda _state: _GAVE_UP)(call)
        if result is not _GAVE_UP:  # only a delivery that waited knows the database is back
            self.resources.recovered("database")
        return result

    def _internal_error(self, delivery: Delivery, exc: Exception) -> None:
        """A fault of the container itself (not the handler): requeue and stop the port, visibly."""
        log.exception("port %s: container error on message %s", self.port.name, delivery.message_id)
        self.tracing.failed(exc)
        self.acks.failed(delivery)
        self.port.stop_for_failures(str(delivery.message_id), exc, internal=True)

    def _process(self, delivery: Delivery) -> None:
        message = self._prepare(delivery)
        if message is not None:
            self._deliver(delivery, message)

    def _prepare(self, delivery: Delivery) -> Message | None:
        """Steps 1-6; the message (its handler argument in ``_argument``) when it goes on to 7.

        The async pipeline (``pipeline/async_single.py``) runs these same steps before its task awaits
        the unit of work.
        """
        if self.consumer.handing_back or self.stop_event.is_set():
            self.acks.hand_back(delivery, delivery.message_id)
            return None
        if self._expired(delivery):
            return None
        message_id = self._identify(delivery)
        if message_id is None:
            return None
        count, last_error = self._count(delivery, message_id)
        if count is None:
            return None
        self.tracing.counted(count)
        if self.threshold and count >= self.threshold:
            self._back_out(delivery, REASON_THRESHOLD, count, last_error)
            self.port.after_backout()
            return None
        return self._decode(delivery, message_id, count)

    def _expired(self, delivery: Delivery) -> bool:
        # The AMQP timestamp has whole seconds: allow one, so nothing expires early.
        expires_at = delivery.expires_at()
        if expires_at is None or expires_at + _TIMESTAMP_GRAIN > datetime.now(UTC):
            return False
        expiry_queue = self.port.queue_settings.expiry_queue
        if expiry_queue:
            self.consumer.publish(
                delivery.copy_to(expiry_queue, {"x-mdb-expired-at": datetime.now(UTC).isoformat()}))
        self.acks.discard(delivery)
        self._record("expired")
        return True

    def _identify(self, delivery: Delivery) -> str | None:
        message_id = delivery.message_id
        if message_id:
            return message_id
        if self.once_only and self.settings.missing_id == "backout":
            self._back_out(delivery, REASON_MISSING_ID, 0, "a once-only port needs an AMQP message_id")
            return None
        return body_hash_id(delivery.body, delivery.routing_key)

    def _count(self, delivery: Delivery, message_id: str) -> tuple[int | None, str | None]:
        """Earlier failed deliveries; free on a first delivery, one round trip on a redelivery."""
        if not delivery.redelivered and not came_back(delivery):
            return 0, None
        if self.once_only and self.resources.dedup.seen(self.port.name, message_id):
            self.acks.discard(delivery)
            self._record("duplicate_skipped")
            self._log(logging.INFO, "duplicate_skipped", message_id, None, "already handled, not again")
            return None, None
        if self._stale(delivery, message_id):
            return None, None
        attempt = self.resources.counter.open(self.queue, message_id)
        return attempt.count, attempt.last_exception or carried_failure(delivery)

    def _stale(self, delivery: Delivery, message_id: str) -> bool:
        """A copy back from a wait whose message failed again since it left: an extra one (delays.py)."""
        left = left_after(delivery)
        if left is None or self.resources.counter.failures(self.queue, message_id) <= left:
            return False
        self.acks.discard(delivery)
        self._record("duplicate_skipped")
        self._log(logging.INFO, "duplicate_skipped", message_id, left,
                  "a stale copy back from its redelivery delay (the message failed again since)")
        return True

    def _decode(self, delivery: Delivery, message_id: str, count: int) -> Message | None:
        try:
            message = envelope(delivery, message_id, count, self.accept,
                               self.settings.max_message_bytes, self.queue)
            invoker = self.invoker
            self._argument = message if invoker.adapter is None else invoker.argument(message)
        except InvalidBody as exc:
            self._back_out(delivery, REASON_INVALID, count, f"InvalidBody: {exc}", outcome="invalid_body")
            return None
        return message

    def _deliver(self, delivery: Delivery, message: Message) -> None:
        started = time.perf_counter()
        crash_point("before-handler")
        outcome = self._through_outages(self._run, delivery, message, failed=_infrastructure)
        self._conclude(delivery, message, outcome, started)

    def _conclude(self, delivery: Delivery, message: Message, outcome: Any, started: float) -> None:
        """Step 8 for the outcome of step 7 (``_GAVE_UP``: the port stopped during an outage)."""
        if outcome is _GAVE_UP:
            self.acks.hand_back(delivery, message.id)
            return
        self.tally.handler.observe(time.perf_counter() - started)
        if outcome.kind == "failed":
            self._failed(delivery, message, outcome)
        else:
            self._settle(delivery, message, outcome)

    def _run(self, delivery: Delivery, message: Message) -> Outcome:
        unit = self.unit_class(
            self.port.name, message.id, self.resources.units,
            once_only=self.once_only,
            move_copy=lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None),
            client_ack=self.acks.begin(delivery, message.id),
        )
        return unit.run(self.invoker, self._argument, MessageContext(message, self.port.name, unit))

    # -- outcomes ----------------------------------------------------------

    def _settle(self, delivery: Delivery, message: Message, outcome: Outcome) -> None:
        if outcome.pending:
            try:
                self.resources.outbox.dispatch(self.consumer.publisher, outcome.pending)
            except Exception as exc:  # the rows are committed: the relay sends them later
                log.warning("port %s: outbox publish deferred to the relay: %s",
                            self.port.name, describe(exc))
        try:
            for send in outcome.direct:
                self.consumer.publish(send)
        except PublishError as exc:  # not routed or not confirmed: the delivery is not done
            self._failed(delivery, message, Outcome("failed", exc))
            return
        self.acks.settle(delivery)  # now, or later: the port's acknowledge mode
        crash_point("after-ack")
        if outcome.kind != "handled":
            self._record("duplicate_skipped")
            self._log(logging.INFO, "duplicate_skipped", message.id, None, "already handled, not again")
            return
        self._record("handled")
        self.port.after_success()
        self.tally.end_to_end(delivery.timestamp)
        if log.isEnabledFor(logging.DEBUG):  # per successful message only when asked
            self._log(logging.DEBUG, "handled", message.id, None, "")

    def _failed(self, delivery: Delivery, message: Message, outcome: Outcome) -> None:
        assert outcome.error is not None
        self.tracing.failed(outcome.error)
        if self.acks.consumed(delivery):  # ctx.acknowledge() came before the failure
            self._failed_consumed(message, outcome.error)
            return
        text = exception_text(outcome.error)
        self._log(logging.WARNING, "failed", message.id, message.redelivery_count,
                  describe(outcome.error))
        # Counted before the requeue; while the database is away the count (and the message) waits.
        counted = self._through_outages(self.resources.counter.fail, self.queue, message.id, text)
        if counted is _GAVE_UP:  # the port stopped meanwhile: back uncounted, as a hand-back
            self.acks.hand_back(delivery, message.id)
            return
        # The recorded count, not this delivery's plus one: another copy may have failed while it
        # ran, and a copy that left to wait with fewer failures than recorded is taken for stale.
        count = max(message.redelivery_count + 1, int(counted))
        self._record("failed")
        decision = self.port.after_failure()
        if decision == "stop":
            self.acks.failed(delivery)
            self.port.stop_for_failures(message.id, outcome.error)
        elif self.threshold and count >= self.threshold:
            self._back_out(delivery, REASON_THRESHOLD, count, text)
            self.port.after_backout()
        else:
            self._requeue(delivery, count, text)

    def _failed_consumed(self, message: Message, error: BaseException) -> None:
        """A failure after the handler acknowledged: counted, but the message cannot go back."""
        log.warning("port %s: delivery failed after ctx.acknowledge(): message %s stays consumed: %s",
                    self.port.name, message.id, describe(error))
        self._record("failed")
        if self.port.after_failure() == "stop":
            self.port.stop_for_failures(message.id, error)

    def _requeue(self, delivery: Delivery, failures: int, text: str) -> None:
        """Back to its queue: at once, or to wait out the queue's redelivery delay (delays.py)."""
        if not self.delays.move(delivery, failures, text):
            self.acks.failed(delivery)

    def _back_out(self, delivery: Delivery, reason: str, count: int, exception: str | None,
                  outcome: str = "backed_out") -> None:
        """Move the message to its backout queue (backout.py), then count and log the move.

        ``outcome`` is what the move counts as: an invalid body counts as
        ``invalid_body`` only, not also as ``backed_out``.
        """
        self.backout.move(delivery, reason, count, exception)
        self._record(outcome)
        self._log(logging.WARNING, outcome, delivery.message_id, count,
                  f"moved to {self.port.backout_queue} ({reason})")

    def _record(self, outcome: str) -> None:
        """Count the delivery's outcome in the consumer's tally, and tell its trace span."""
        self._outcomes.outcome(outcome)
        self.tally.outcomes[outcome] += 1

    def _log(self, level: int, outcome: str, message_id: Any, count: int | None, detail: str) -> None:
        """One line per failed or backed-out delivery: its facts in the text and as fields.

        Nothing is formatted for a level that is off (a storm of skipped duplicates at INFO
        with the level at WARNING costs one check each)."""
        if not log.isEnabledFor(level):
            return
        duration = time.monotonic() - self._started
        label = {"failed": "delivery failed", "backed_out": "backed out",
                 "invalid_body": "invalid body, backed out"}.get(outcome, outcome)
        counted = "" if count is None else f", redelivery count {count}"
        log.log(level, "port %s: %s: message %s%s, after %.3fs%s", self.port.name, label, message_id,
                counted, duration, f": {detail}" if detail else "",
                extra=fields(port=self.port.name, message_id=message_id, redelivery_count=count,
                             outcome=outcome, duration=round(duration, 6)))
