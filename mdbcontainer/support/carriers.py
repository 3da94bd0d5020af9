"""What the tracing hooks read of a delivery and of a publish.

Shared by ``tracing`` (the hooks, imported everywhere) and ``spans`` (their
OpenTelemetry side, imported only with tracing on), which cannot import each
other both ways: each imports these from here.
"""

from __future__ import annotations

from typing import Any, Protocol


class Received(Protocol):
    """What a process span reads of a delivery (met by ``wire.delivery.Delivery``)."""

    @property
    def headers(self) -> dict[str, Any]: ...

    @property
    def properties(self) -> dict[str, Any]: ...

    @property
    def body(self) -> bytes: ...

    @property
    def routing_key(self) -> str: ...


class Publishable(Protocol):
    """One item of a publish of several (met by ``wire.publisher.Publish``, a dataclass)."""

    @property
    def exchange(self) -> str: ...

    @property
    def routing_key(self) -> str: ...

    @property
    def body(self) -> bytes: ...

    @property
    def properties(self) -> dict[str, Any]: ...
