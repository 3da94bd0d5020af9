"""The tracing hooks with OpenTelemetry: the spans of the messaging semantic conventions.

Imported only when ``[container] tracing`` is on (``tracing.tracing_for``).
The SDK is set up from the standard ``OTEL_*`` variables as
``opentelemetry-instrument`` would (service name, resource attributes,
sampler, OTLP endpoint and headers, propagators), unless the process has a
tracer provider already, which is then used as it is.

- ``process {destination}`` (CONSUMER): one per delivery, current while the
  pipeline runs it, so the handler's own spans (instrumented SQLAlchemy,
  httpx) are its children; its parent is the message's ``traceparent``. One
  per batch instead, with a link to each message's context.
- ``publish {destination}`` (PRODUCER): one per publish, whose context the
  message then carries; its parent is the current span or, outside any span
  (the outbox relay, a replay), the context the message already carries.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from ..errors import SettingsError
from ..settings import mask_url
from .carriers import Publishable, Received
from .outgoing import Outgoing

P = TypeVar("P", bound=Publishable)
E = TypeVar("E")
SYSTEM = "rabbitmq"
# A batch span shows its worst outcome; a delivery, the last (a failure that backs out shows that).
_RANK = {"handled": 0, "duplicate_skipped": 1, "expired": 2, "failed": 3, "invalid_body": 4,
         "backed_out": 5}
_PROPAGATED = ("traceparent", "tracestate")
_lock = threading.Lock()
_configured: OtelTracing | None = None


class _Current:
    """A span made the thread's current one; ``end`` or ``drop`` restores the one before."""

    __slots__ = ("_token", "span")

    def __init__(self, span: Span, parent: otel_context.Context | None) -> None:
        self.span = span
        self._token: object | None = otel_context.attach(trace.set_span_in_context(span, parent))

    def end(self) -> None:
        if self._token is not None:
            self.drop()
            self.span.end()

    def drop(self) -> None:
        """Leave the span unended: never exported (a delivery that joined a batch has the batch's)."""
        token, self._token = self._token, None
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]


def _fail(span: Span, error: BaseException) -> None:
    """``error.type`` and an ERROR status with the error's first line (any URL password masked)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    span.set_attribute("error.type", type(error).__name__)
    span.set_status(Status(StatusCode.ERROR, mask_url(f"{type(error).__name__}: {text}" if text else
                                                      type(error).__name__)))


def _parent(headers: dict[str, Any]) -> otel_context.Context:
    """The context a message carries (an empty one, a new trace, when it carries none).

    Only text headers: a producer's binary or numeric ``traceparent`` is no context.
    """
    text = {key: value for key, value in headers.items() if isinstance(value, str)}
    return propagate.extract(text, context=otel_context.Context())


def _message_attributes(properties: dict[str, Any], body: bytes, routing_key: str) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.rabbitmq.destination.routing_key": routing_key,
        "messaging.message.body.size": len(body),
    }
    if properties.get("message_id"):
        attributes["messaging.message.id"] = str(properties["message_id"])
    if properties.get("correlation_id"):
        attributes["messaging.message.conversation_id"] = str(properties["correlation_id"])
    return attributes


class OtelPortTracing:
    """The spans of one port's deliveries."""

    def __init__(self, tracer: trace.Tracer, port: str, destination: str) -> None:
        self.tracer = tracer
        self.port = port
        self.destination = destination
        self.name = f"process {destination}"

    def _attributes(self) -> dict[str, Any]:
        return {"messaging.operation.type": "process", "messaging.operation.name": "process",
                "messaging.destination.name": self.destination, "mdb.port": self.port}

    def process(self, received: Received) -> _Current:
        parent = _parent(received.headers)
        attributes = _message_attributes(received.properties, received.body, received.routing_key)
        attributes.update(self._attributes())
        span = self.tracer.start_span(self.name, context=parent, kind=SpanKind.CONSUMER,
                                      attributes=attributes)
        return _Current(span, parent)

    def batch(self, received: Sequence[Received]) -> _Current:
        links = []
        for item in received:
            context = trace.get_current_span(_parent(item.headers)).get_span_context()
            if context.is_valid:
                links.append(Link(context))
        attributes = self._attributes()
        attributes["messaging.system"] = SYSTEM
        attributes["messaging.batch.message_count"] = len(received)
        empty = otel_context.Context()  # a batch starts a trace of its own, linked to its messages'
        span = self.tracer.start_span(self.name, context=empty, kind=SpanKind.CONSUMER,
                                      attributes=attributes, links=links)
        return _Current(span, empty)

    def counted(self, count: int) -> None:
        trace.get_current_span().set_attribute("mdb.redelivery_count", count)

    def failed(self, error: BaseException | None) -> None:
        """``error.type``; and ``mdb.outcome = failed`` until the pipeline records what followed."""
        span = trace.get_current_span()
        if error is not None:
            _fail(span, error)
        if "mdb.outcome" not in (getattr(span, "attributes", None) or {}):
            span.set_attribute("mdb.outcome", "failed")


class OtelTracing:
    """Spans through the process's tracer provider."""

    enabled = True

    def __init__(self, provider: trace.TracerProvider) -> None:
        from importlib.metadata import version

        self.provider = provider
        self.tracer = provider.get_tracer("mdbcontainer", version("mdbcontainer"))

    def for_port(self, port: str, destination: str) -> OtelPortTracing:
        return OtelPortTracing(self.tracer, port, destination)

    def outcome(self, outcome: str) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        before = getattr(span, "attributes", None) or {}
        if "messaging.batch.message_count" in before and _RANK.get(outcome, 0) < _RANK.get(
                str(before.get("mdb.outcome")), -1):
            return
        span.set_attribute("mdb.outcome", outcome)

    def carry(self, message: Outgoing) -> Outgoing:
        if not trace.get_current_span().get_span_context().is_valid:
            return message
        headers = {k: v for k, v in (message.properties.get("headers") or {}).items()
                   if k not in _PROPAGATED}
        propagate.inject(headers)
        return replace(message, properties={**message.properties, "headers": headers})

    def _start_publish(self, exchange: str, routing_key: str, body: bytes,
                       properties: dict[str, Any]) -> tuple[Span, dict[str, Any]]:
        """A publish span (its parent: the current span, else the message's context) and the
        properties carrying it."""
        headers = dict(properties.get("headers") or {})
        current = trace.get_current_span().get_span_context().is_valid
        parent = None if current else _parent(headers)
        destination = exchange or routing_key
        attributes = _message_attributes(properties, body, routing_key)
        attributes.update({"messaging.operation.type": "send", "messaging.operation.name": "publish",
                           "messaging.destination.name": destination})
        span = self.tracer.start_span(f"publish {destination}", context=parent, kind=SpanKind.PRODUCER,
                                      attributes=attributes)
        for key in _PROPAGATED:  # the message names this span, not the one it came with
            headers.pop(key, None)
        propagate.inject(headers, context=trace.set_span_in_context(span))
        return span, {**properties, "headers": headers}

    @contextmanager
    def publishing(self, exchange: str, routing_key: str, body: bytes,
                   properties: dict[str, Any]) -> Iterator[dict[str, Any]]:
        span, traced = self._start_publish(exchange, routing_key, body, properties)
        try:
            yield traced
        except BaseException as exc:
            _fail(span, exc)
            raise
        finally:
            span.end()

    @contextmanager
    def publishing_many(self, items: list[P]) -> Iterator[_Spans[P]]:
        spans = _Spans(self, items)
        try:
            yield spans
        except BaseException as exc:
            for span in spans.spans:
                _fail(span, exc)
            raise
        finally:
            for span in spans.spans:
                span.end()


class _Spans(Generic[P]):
    """The publish spans of a publish of several, one per item."""

    def __init__(self, tracing: OtelTracing, items: list[P]) -> None:
        self.spans: list[Span] = []
        self.items: list[P] = []
        for item in items:
            span, properties = tracing._start_publish(item.exchange, item.routing_key, item.body,
                                                      item.properties)
            self.spans.append(span)
            self.items.append(replace(item, properties=properties))  # type: ignore[type-var]  # a dataclass

    def settle(self, errors: list[E]) -> list[E]:
        for span, error in zip(self.spans, errors, strict=True):
            if isinstance(error, BaseException):
                _fail(span, error)
        return errors


def _exporters() -> list[SpanExporter]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (default ``otlp``: OTLP over HTTP)."""
    from importlib.metadata import entry_points

    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                      os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
            name = "otlp_proto_grpc" if protocol == "grpc" else "otlp_proto_http"
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            raise SettingsError(
                f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed "
                "(the otel extra brings 'otlp' over http/protobuf, and 'console')"
            )
        exporters.append(next(iter(found)).load()())
    return exporters


def configured() -> OtelTracing:
    """The process's tracing, the SDK set up from the environment on first use."""
    global _configured
    with _lock:
        if _configured is None:
            _configured = OtelTracing(_provider())
        return _configured


def _provider() -> trace.TracerProvider:
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider) or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return current  # set up by opentelemetry-instrument or the application: theirs to export
    provider = TracerProvider(resource=Resource.create())  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider
