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
from datetime import timedelta
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import tenacity

from ..errors import PublishError
from ..handlers.registry import HandlerSpec, Invoker, Running, refuse_awaitable
from ..message import InvalidBody, Message, accepted, body_hash_id
from ..settings import PortSettings, QueueSettings
from ..state.database import is_infrastructure
from ..state.metrics import Tally
from ..support import clock, crash
from ..support.crash import crash_point
from ..support.failures import describe, exception_text
from ..support.logs import fields
from ..support.outgoing import Outgoing
from ..support.retry import DEFAULT as RETRY
from ..support.retry import RetryCondition
from ..support.tracing import is_off
from ..units.context import MessageContext
from ..units.sequence import RollbackOnly
from ..units.single import Outcome, UnitOfWork, failure, unit_class
from ..wire.connection import connection_errors
from ..wire.delays import Delays, came_back, carried_failure, left_after
from ..wire.delivery import Delivery, envelope
from ..wire.headers import (
    EXPIRED_AT,
    REASON_INVALID,
    REASON_MISSING_ID,
    REASON_THRESHOLD,
    WAIT_EXPIRES_AT,
    WAITED,
)
from ..wire.publisher import Publisher
from .acknowledge import Acknowledger, Seen
from .attempt import Attempt
from .backout import Backout
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
    """Runs every delivery of one consumer (one thread, one channel, one bean instance).

    It keeps nothing of one delivery on itself: each delivery's state is its
    :class:`Attempt`, handed from step to step.
    """

    # Whether it gathers deliveries (``wait_limit``, ``due`` and ``tick`` have work): the consumer's
    # loop asks only a pipeline that says so, not every one once a delivery.
    gathers: ClassVar[bool] = False

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
        self.tracing = port.resources.broker.tracing.for_port(port.name, port.settings.topic or port.queue)
        self._outcomes = port.resources.broker.tracing  # the current span's mdb.outcome
        # A first delivery on a port without a transaction, acknowledged as its handler returns,
        # untraced, takes the flat path (_first): the same steps, without a call for each. Not in
        # a subclass (a batch gathers its deliveries in its own _deliver).
        self._flat = (type(self) is Pipeline and self.unit_class is UnitOfWork
                      and type(self.acks) is Acknowledger and is_off(self.tracing))
        if type(self) is Pipeline:  # one delivery after the other, each settled before the next
            self.acks.coalesce_in_order()

    # -- the pipeline ------------------------------------------------------

    def __call__(self, delivery: Delivery) -> None:
        """Process one delivery, marked in flight for /healthz and the in-flight gauge."""
        consumer = self.consumer
        consumer.delivering_since = started = time.monotonic()
        if self._flat:
            properties, headers, redelivered = delivery.at_a_glance()
            # Steps 1-4 of a first delivery, checked where they cost nothing: not handed back,
            # no expiry (nor one kept by a wait), an id, not redelivered (nor back from a wait).
            if (not consumer.handing_back and not self.stop_event.is_set()
                    and not properties.get("expiration") and (message_id := properties.get("message_id"))
                    and not redelivered
                    and (not headers or (WAITED not in headers and WAIT_EXPIRES_AT not in headers))):
                self._flat_call(delivery, message_id if type(message_id) is str else str(message_id),
                                started)
                return
        attempt = Attempt(delivery, started, self.tracing.process(delivery))
        try:
            if self._through_outages(self._process, attempt) is _GAVE_UP:
                self.acks.hand_back(delivery, delivery.message_id)
        except connection_errors():
            raise  # the broker is gone: the consumer reconnects; the broker requeues
        except Exception as exc:
            self._internal_error(delivery, exc)
        finally:
            attempt.span.end()
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _flat_call(self, delivery: Delivery, message_id: str, started: float) -> None:
        """:meth:`__call__` for a delivery that :meth:`_first` runs (tracing is off)."""
        consumer = self.consumer
        try:
            try:
                self._first(delivery, message_id, started)
            except Exception as exc:  # as _through_outages: the database away holds the delivery
                if not is_infrastructure(exc):
                    raise
                if self._wait_out(lambda: self._first(delivery, message_id, started), None,
                                  exc) is _GAVE_UP:
                    self.acks.hand_back(delivery, message_id)
        except connection_errors():
            raise  # the broker is gone: the consumer reconnects; the broker requeues
        except Exception as exc:
            self._internal_error(delivery, exc)
        finally:
            consumer.delivering_since = None
            consumer.alive_at = time.monotonic()

    def _first(self, delivery: Delivery, message_id: str, started: float) -> None:
        """Steps 6-8 of a first delivery on a ``transaction = "none"``, ``acknowledge = "auto"``
        port, in one function: the hot path of a port without a transaction.

        The caller checked steps 1-4 (not handed back, not expired, an id, a first
        delivery: count 0, so step 5 cannot back it out). The same thing happens
        as on :meth:`_process`'s way, crash points included, with a handler that
        returns; anything else (a failure, the database away, sends to publish)
        goes on through the pipeline's own steps from where it stands, in an
        :class:`Attempt` made then. ``started``: the delivery's start, from which the
        handler's time counts too (one clock read).
        """
        try:
            message = envelope(delivery, message_id, 0, self.accept, self.settings.max_message_bytes,
                               self.queue)
            invoker = self.invoker
            argument = message if invoker.adapter is None else invoker.argument(message)
        except InvalidBody as exc:
            self._back_out(Attempt(delivery, started), REASON_INVALID, 0, f"InvalidBody: {exc}",
                           outcome="invalid_body")
            return
        if crash.ARMED:
            crash_point("before-handler")
        name = self.port.name
        unit = UnitOfWork(name, message_id, self.resources.units, once_only=self.once_only,
                          move_copy=lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None))
        ctx = MessageContext(message, name, unit)
        running = invoker.running  # Invoker.__call__ and UnitOfWork.run, inline
        running.ctx, running.warned, running.since = ctx, False, started
        function = invoker.function
        try:
            if function is None:
                invoker.call_bean(argument, ctx)
            else:
                result = function(argument, ctx) if invoker.takes_context else function(argument)
                if result is not None:  # an awaitable from a def: its work never ran
                    refuse_awaitable(invoker.spec.name, result)
            running.since = None
            if crash.ARMED:
                crash_point("in-handler")
            if unit.rollback_only:
                raise RollbackOnly
        except Exception as exc:
            running.since = None
            attempt = Attempt(delivery, started, argument=argument)
            outcome = failure(exc)
            if outcome.kind == "infrastructure":  # as _through_outages around _run
                outcome = self._wait_out(lambda: self._run(attempt, message), _infrastructure, exc)
            self._conclude(attempt, message, outcome, started)
            return
        if sends := unit.sends:  # they leave before the acknowledgment: step 8's own way
            self._conclude(Attempt(delivery, started, argument=argument), message,
                           Outcome("handled", direct=list(sends)), started)
            return
        self._handled(delivery, message_id, started, delivery.timestamp, time.monotonic() - started)

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

    def release(self) -> Seen:
        """The channel is gone: forget what was received and not ended, and return it (the
        consumer records its hand-back)."""
        return Seen()

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

    def _process(self, attempt: Attempt) -> None:
        message = self._prepare(attempt)
        if message is not None:
            self._deliver(attempt, message)

    def _prepare(self, attempt: Attempt) -> Message | None:
        """Steps 1-6; the message (its handler argument in ``attempt.argument``) when it goes on to 7.

        The async pipeline (``pipeline/async_single.py``) runs these same steps before its task awaits
        the unit of work.
        """
        delivery = attempt.delivery
        if self.consumer.handing_back or self.stop_event.is_set():
            self.acks.hand_back(delivery, delivery.message_id, counted=False)
            return None
        if self._expired(delivery):
            return None
        message_id = self._identify(attempt)
        if message_id is None:
            return None
        count, last_error = self._count(attempt, message_id)
        if count is None:
            return None
        self.tracing.counted(count)
        if self.threshold and count >= self.threshold:
            self._back_out(attempt, REASON_THRESHOLD, count, last_error)
            self.port.after_backout()
            return None
        return self._decode(attempt, message_id, count)

    def _expired(self, delivery: Delivery) -> bool:
        # The AMQP timestamp has whole seconds: allow one, so nothing expires early.
        expires_at = delivery.expires_at()
        if expires_at is None or expires_at + _TIMESTAMP_GRAIN > clock.now():
            return False
        expiry_queue = self.port.queue_settings.expiry_queue
        if expiry_queue:
            self.consumer.publish(
                delivery.copy_to(expiry_queue, {EXPIRED_AT: clock.now().isoformat()}))
        self.acks.discard(delivery)
        self._record("expired")
        return True

    def _identify(self, attempt: Attempt) -> str | None:
        delivery = attempt.delivery
        message_id = delivery.message_id
        if message_id:
            return message_id
        if self.once_only and self.settings.missing_id == "backout":
            self._back_out(attempt, REASON_MISSING_ID, 0, "a once-only port needs an AMQP message_id")
            return None
        return body_hash_id(delivery.body, delivery.routing_key)

    def _count(self, attempt: Attempt, message_id: str) -> tuple[int | None, str | None]:
        """Earlier failed deliveries; free on a first delivery, one round trip on a redelivery."""
        delivery = attempt.delivery
        if not delivery.redelivered and not came_back(delivery):
            return 0, None
        return self._recount(attempt, message_id)

    def _recount(self, attempt: Attempt, message_id: str) -> tuple[int | None, str | None]:
        """A redelivery's count: handled already (a duplicate), a stale copy, or its failures."""
        delivery = attempt.delivery
        if self.once_only and self.resources.dedup.seen(self.port.name, message_id):
            self.acks.discard(delivery)
            self._record("duplicate_skipped")
            self._log(logging.INFO, "duplicate_skipped", message_id, None, "already handled, not again",
                      attempt.started)
            return None, None
        if self._stale(attempt, message_id):
            return None, None
        opened = self.resources.counter.open(self.queue, message_id)
        return opened.count, opened.last_exception or carried_failure(delivery)

    def _stale(self, attempt: Attempt, message_id: str) -> bool:
        """A copy back from a wait whose message failed again since it left: an extra one (delays.py)."""
        left = left_after(attempt.delivery)
        if left is None or self.resources.counter.failures(self.queue, message_id) <= left:
            return False
        self.acks.discard(attempt.delivery)
        self._record("duplicate_skipped")
        self._log(logging.INFO, "duplicate_skipped", message_id, left,
                  "a stale copy back from its redelivery delay (the message failed again since)",
                  attempt.started)
        return True

    def _decode(self, attempt: Attempt, message_id: str, count: int) -> Message | None:
        try:
            message = envelope(attempt.delivery, message_id, count, self.accept,
                               self.settings.max_message_bytes, self.queue)
            invoker = self.invoker
            attempt.argument = message if invoker.adapter is None else invoker.argument(message)
        except InvalidBody as exc:
            self._back_out(attempt, REASON_INVALID, count, f"InvalidBody: {exc}", outcome="invalid_body")
            return None
        return message

    def _deliver(self, attempt: Attempt, message: Message) -> None:
        started = time.perf_counter()
        crash_point("before-handler")
        outcome = self._through_outages(self._run, attempt, message, failed=_infrastructure)
        self._conclude(attempt, message, outcome, started)

    def _conclude(self, attempt: Attempt, message: Message, outcome: Any, started: float) -> None:
        """Step 8 for the outcome of step 7 (``_GAVE_UP``: the port stopped during an outage)."""
        if outcome is _GAVE_UP:
            self.acks.hand_back(attempt.delivery, message.id)
            return
        self.tally.handler.observe(time.perf_counter() - started)
        if outcome.kind == "failed":
            self._failed(attempt, message, outcome)
        else:
            self._settle(attempt, message, outcome)

    def _run(self, attempt: Attempt, message: Message) -> Outcome:
        delivery = attempt.delivery
        unit = self.unit_class(
            self.port.name, message.id, self.resources.units,
            once_only=self.once_only,
            move_copy=lambda queue, reason: self.backout.copy(delivery, queue, reason, 0, None),
            client_ack=self.acks.begin(delivery, message.id),
        )
        return unit.run(self.invoker, attempt.argument, MessageContext(message, self.port.name, unit))

    # -- outcomes ----------------------------------------------------------

    def _settle(self, attempt: Attempt, message: Message, outcome: Outcome) -> None:
        delivery = attempt.delivery
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
            self._failed(attempt, message, Outcome("failed", exc))
            return
        if outcome.kind == "handled":
            self._handled(delivery, message.id, attempt.started, delivery.timestamp)
            return
        self.acks.settle(delivery)  # now, or later: the port's acknowledge mode (after-ack there)
        self._record("duplicate_skipped")
        self._log(logging.INFO, "duplicate_skipped", message.id, None, "already handled, not again",
                  attempt.started)

    def _handled(self, delivery: Delivery, message_id: str, started: float, timestamp: Any,
                 seconds: float | None = None) -> None:
        """A handled delivery whose sends are out: acknowledge it, then count and log it.

        The one way out of a handled delivery, for :meth:`_first` and :meth:`_settle`.
        ``seconds``: the handler's time, counted here with the rest in one call (the
        fast path, tracing off); None when :meth:`_conclude` counted it already.
        """
        self.acks.settle(delivery)  # now, or later: the port's acknowledge mode (after-ack there)
        if seconds is None:
            self._record("handled")
            self.tally.end_to_end(timestamp)
        else:
            self.tally.handled(seconds, timestamp)
        self.port.after_success()
        if log.isEnabledFor(logging.DEBUG):  # per successful message only when asked
            self._log(logging.DEBUG, "handled", message_id, None, "", started)

    def _failed(self, attempt: Attempt, message: Message, outcome: Outcome) -> None:
        text = self._failing(attempt, message, outcome)
        if text is None:
            return
        # Counted before the requeue; while the database is away the count (and the message) waits.
        counted = self._through_outages(self.resources.counter.fail, self.queue, message.id, text)
        self._after_count(attempt, message, outcome, text, counted)

    def _failing(self, attempt: Attempt, message: Message, outcome: Outcome) -> str | None:
        """A failed delivery, before its count: the text to count, or None when it cannot go back."""
        assert outcome.error is not None
        self.tracing.failed(outcome.error)
        if self.acks.consumed(attempt.delivery):  # ctx.acknowledge() came before the failure
            self._failed_consumed(message, outcome.error)
            return None
        self._log(logging.WARNING, "failed", message.id, message.redelivery_count,
                  describe(outcome.error), attempt.started, error=outcome.error)
        return exception_text(outcome.error)

    def _after_count(self, attempt: Attempt, message: Message, outcome: Outcome, text: str,
                     counted: Any) -> None:
        """A failed delivery, counted (``counted``: its failures now, or ``_GAVE_UP``): where it goes."""
        assert outcome.error is not None
        delivery = attempt.delivery
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
            self._back_out(attempt, REASON_THRESHOLD, count, text)
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

    def _back_out(self, attempt: Attempt, reason: str, count: int, exception: str | None,
                  outcome: str = "backed_out") -> None:
        """Move the message to its backout queue (backout.py), then count and log the move.

        ``outcome`` is what the move counts as: an invalid body counts as
        ``invalid_body`` only, not also as ``backed_out``.
        """
        delivery = attempt.delivery
        self.backout.move(delivery, reason, count, exception)
        self._record(outcome)
        self._log(logging.WARNING, outcome, delivery.message_id, count,
                  f"moved to {self.port.backout_queue} ({reason})", attempt.started)

    def _record(self, outcome: str) -> None:
        """Count the delivery's outcome in the consumer's tally, and tell its trace span."""
        self._outcomes.outcome(outcome)
        self.tally.outcomes[outcome] += 1

    def _log(self, level: int, outcome: str, message_id: Any, count: int | None, detail: str,
             started: float, error: BaseException | None = None) -> None:
        """One line per failed or backed-out delivery: its facts in the text and as fields.

        ``started``: the delivery's start (its :class:`Attempt`'s), for the duration.

        Nothing is formatted for a level that is off (a storm of skipped duplicates at INFO
        with the level at WARNING costs one check each). A failure's exception rides on the
        record as ``mdb_error`` (no formatter prints it): ``mdbcontainer.testing`` shows its
        traceback beside the outcome in a failing test."""
        if not log.isEnabledFor(level):
            return
        duration = time.monotonic() - started
        label = {"failed": "delivery failed", "backed_out": "backed out",
                 "invalid_body": "invalid body, backed out"}.get(outcome, outcome)
        counted = "" if count is None else f", redelivery count {count}"
        log.log(level, "port %s: %s: message %s%s, after %.3fs%s", self.port.name, label, message_id,
                counted, duration, f": {detail}" if detail else "",
                extra=fields(port=self.port.name, message_id=message_id, redelivery_count=count,
                             outcome=outcome, duration=round(duration, 6), mdb_error=error))
