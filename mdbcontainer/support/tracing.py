"""Tracing hooks: OpenTelemetry spans for deliveries and publishes, or nothing at all.

The broker seam, the outbox and the pipeline call the hooks of a
:class:`Tracing`. With ``[container] tracing`` off they get :data:`OFF`,
whose hooks do nothing: opentelemetry is never imported, and a delivery
pays a handful of empty calls. With it on, :func:`tracing_for` returns the
OpenTelemetry implementation in ``spans.py`` (the ``otel`` extra). What a
trace then holds is in the README, "Tracing".
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..errors import SettingsError
from .carriers import Publishable, Received

if TYPE_CHECKING:
    from ..settings import Settings
    from .outgoing import Outgoing


P = TypeVar("P", bound=Publishable)
E = TypeVar("E")


class Active(Protocol):
    """A span that is the thread's current one until it ends (or is dropped unended)."""

    def end(self) -> None: ...

    def drop(self) -> None: ...


class _Nothing:
    """The span of tracing off: ending or dropping it does nothing."""

    __slots__ = ()

    def end(self) -> None:
        """Nothing to end."""

    def drop(self) -> None:
        """Nothing to drop."""


NOTHING = _Nothing()


class Published(Protocol[P]):
    """A publish of several items under way: the items as sent, and their results to report."""

    items: list[P]

    def settle(self, errors: list[E]) -> list[E]: ...


T = TypeVar("T")


class _Same(AbstractContextManager[T]):
    """A context manager that yields its value and does nothing else (cheaper than a generator)."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __enter__(self) -> T:
        return self.value

    def __exit__(self, *exc: object) -> None:
        return None


class _Untraced:
    """A publish of several, untraced: the items go as they are."""

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def settle(self, errors: list[E]) -> list[E]:
        return errors


class PortTracing(Protocol):
    """The hooks of one port's pipeline, bound to its name and destination."""

    def process(self, received: Received) -> Active:
        """Start the span of one delivery, current until it ends."""

    def batch(self, received: Sequence[Received]) -> Active:
        """Start the one span of a batch, linked to every message's context."""

    def counted(self, count: int) -> None:
        """The delivery's redelivery count, once known."""

    def failed(self, error: BaseException | None) -> None:
        """The delivery (or batch) failed with ``error``."""


class Tracing(Protocol):
    """The hooks of the broker seam and the outbox, and the pipeline's (:meth:`for_port`)."""

    enabled: bool

    def for_port(self, port: str, destination: str) -> PortTracing:
        """The pipeline's hooks for port ``port`` reading ``destination`` (a queue or a topic)."""

    def outcome(self, outcome: str) -> None:
        """What became of the current delivery: ``mdb.outcome`` of the current span."""

    def carry(self, message: Outgoing) -> Outgoing:
        """The message with the current trace context in its headers, for an outbox row."""

    def publishing(self, exchange: str, routing_key: str, body: bytes,
                   properties: dict[str, Any]) -> AbstractContextManager[dict[str, Any]]:
        """Around one publish: yields the properties to send (with a ``traceparent`` when on)."""

    def publishing_many(self, items: list[P]) -> AbstractContextManager[Published[P]]:
        """Around a publish of several: yields the items to send, and takes back their errors."""


class _OffPort:
    """A port's hooks with tracing off."""

    def process(self, received: Received) -> Active:
        return NOTHING

    def batch(self, received: Sequence[Received]) -> Active:
        return NOTHING

    def counted(self, count: int) -> None:
        pass

    def failed(self, error: BaseException | None) -> None:
        pass


class _Off:
    """Tracing off: every hook does nothing, and nothing of opentelemetry is imported."""

    enabled = False

    def for_port(self, port: str, destination: str) -> PortTracing:
        return _OFF_PORT

    def outcome(self, outcome: str) -> None:
        pass

    def carry(self, message: Outgoing) -> Outgoing:
        return message

    def publishing(self, exchange: str, routing_key: str, body: bytes,
                   properties: dict[str, Any]) -> AbstractContextManager[dict[str, Any]]:
        return _Same(properties)

    def publishing_many(self, items: list[P]) -> AbstractContextManager[Published[P]]:
        return _Same(_Untraced(items))


_OFF_PORT = _OffPort()
OFF: Tracing = _Off()


def is_off(port: PortTracing) -> bool:
    """Whether a port's hooks are those of tracing off (a hot path may then skip calling them)."""
    return port is _OFF_PORT


def tracing_for(settings: Settings) -> Tracing:
    """:data:`OFF` unless ``[container] tracing`` is on; then the OpenTelemetry SDK, set up once.

    Raises:
        SettingsError: tracing is on but the ``otel`` extra is not installed.
    """
    if not settings.container.tracing:
        return OFF
    try:
        from . import spans
    except ImportError as exc:
        raise SettingsError(
            f"{settings.source}: container.tracing = true needs the otel extra: "
            f"pip install 'mdbcontainer[otel]' ({exc.name or 'opentelemetry'} is not installed)"
        ) from exc
    return spans.configured()
