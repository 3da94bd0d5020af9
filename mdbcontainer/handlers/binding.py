"""Binding: each port of the settings paired with its handler and its effective settings.

``mdb run``, ``mdb check`` and ``mdb port start|stop`` (which checks the port's
name) all bind; it lives here, apart from the container, so that the commands
that only bind import the listeners and the settings, not the runtime.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ListenerError, SettingsError
from ..settings import PortSettings, Settings, validate_port
from .registry import HandlerSpec, Invoker, import_listeners

if TYPE_CHECKING:
    from ..wire.transport import Transport


@dataclass(frozen=True)
class Binding:
    """A handler bound to its port's effective settings (decorator defaults, then TOML)."""

    name: str
    spec: HandlerSpec
    settings: PortSettings


def bind(settings: Settings, only: list[str] | None = None) -> list[Binding]:
    """Import the listeners and pair each port with its handler; one-line errors otherwise."""
    search = Path(settings.source).parent if settings.source.endswith(".toml") else None
    try:
        handlers = import_listeners(settings.container.listeners, search)
    except ListenerError as exc:  # name the file that asked for the module
        raise ListenerError(f"{settings.source}: container.listeners: {exc}") from exc
    names = sorted(set(handlers) | set(settings.ports))
    unknown = [n for n in only or [] if n not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        raise ListenerError(
            f"--port {unknown[0]!r}: no such port (ports: {', '.join(names) or 'none'}){hint}"
        )
    transport = _transport(settings)
    bindings = []
    for name in names:
        spec = handlers.get(name)
        if spec is None:
            raise ListenerError(
                f"{settings.source}: ports.{name}: no handler: no @message_driven({name!r}) in "
                f"the listener modules {settings.container.listeners}"
                + misspelled(name, [h for h in handlers if h not in settings.ports], handlers)
            )
        Invoker.for_spec(spec)  # a handler the container cannot call fails here, not per delivery
        merged = {**spec.defaults, **settings.port_overrides(name)}
        if "destination" not in merged and "topic" not in merged:
            raise ListenerError(
                f"{spec.name}: port {name!r} has no destination: set [ports.{name}] destination "
                f"in {settings.source} or @message_driven({name!r}, destination=...)"
                + misspelled(name, [p for p in settings.ports if p not in handlers], handlers)
            )
        key = transport.implied_order_key(merged.get("destination"))
        if key and "order_by" not in merged and merged.get("acknowledge", "auto") == "auto":
            merged["order_by"] = key  # a FIFO queue's groups are the port's keys
        port = _async_port(settings, name, spec, validate_port(settings.source, name, merged,
                                                               settings.overrides), merged)
        bindings.append(Binding(name, spec, port))
        _refuse_backout_loop(settings, name, bindings[-1].settings)
        _refuse_partitions(settings, name, bindings[-1].settings)
        _refuse_bean_batch_without_list(settings, name, bindings[-1])
    if not bindings:
        raise ListenerError(f"{settings.source}: no ports: container.listeners registers no handler")
    _refuse_what_the_transport_lacks(transport, settings, bindings)
    return [b for b in bindings if not only or b.name in only]


def _async_port(settings: Settings, name: str, spec: HandlerSpec, port: PortSettings,
                merged: dict[str, Any]) -> PortSettings:
    """An async handler's port: one connection feeds ``concurrency`` tasks, acknowledged as they end.

    So its prefetch is at least ``concurrency`` (raised when the settings leave it
    out, refused when they set it lower), and only ``acknowledge = "auto"`` fits
    deliveries that end in any order.
    """
    if not spec.is_async:
        return port
    if port.acknowledge != "auto":
        raise SettingsError(
            f"{settings.source}: ports.{name}.acknowledge: {spec.name} is async def, whose "
            f"deliveries end in any order: it needs acknowledge = 'auto', not {port.acknowledge!r}"
        )
    if port.batch_size > 1 or spec.batch:  # a batch at a time per consumer, as for def handlers
        return port
    if "prefetch" not in merged:
        return port.model_copy(update={"prefetch": max(port.prefetch, port.concurrency)})
    if port.prefetch < port.concurrency:
        raise SettingsError(
            f"{settings.source}: ports.{name}.prefetch: {port.prefetch} is below concurrency "
            f"({port.concurrency}), but {spec.name} is async def: its tasks are fed by one "
            "connection; raise prefetch or leave it out (then it is at least concurrency)"
        )
    return port


def _transport(settings: Settings) -> Transport:
    """The transport of the settings' first broker URL (every node of one URL is one kind)."""
    from ..settings import broker_urls
    from ..wire.connection import transport_for

    return transport_for(settings, broker_urls(settings.container.broker_url)[0])


def _refuse_what_the_transport_lacks(transport: Transport, settings: Settings,
                                     bindings: list[Binding]) -> None:
    """A setting that needs what the broker lacks (SQS: topics, priorities) stops the start: exit 2."""
    refused = transport.refusals(settings, {b.name: b.settings for b in bindings})
    if refused:
        raise SettingsError(f"{settings.source}: {refused[0]}")


def _refuse_partitions(settings: Settings, name: str, port: PortSettings) -> None:
    """Partitions need RabbitMQ, and the settings file must say them: producers route by it."""
    if not port.partitions:
        return
    if settings.container.broker_url.startswith("embedded://"):
        raise SettingsError(
            f"{settings.source}: ports.{name}.partitions: the embedded broker has no consistent-hash "
            "exchange: partitions need RabbitMQ (order_by alone works on the embedded broker)"
        )
    table = settings.ports.get(name)
    if table is None or not table.partitions or not table.order_by:
        raise SettingsError(
            f"{settings.source}: ports.{name}.partitions: set partitions and order_by in the "
            f"[ports.{name}] table, not only in @message_driven: producers (mdb send, Producer) "
            "read them from the settings file to route each message to its key's partition"
        )


def _refuse_bean_batch_without_list(settings: Settings, name: str, binding: Binding) -> None:
    """BMT on a batched port: ``ctx.transaction()`` must cover the whole batch, so one call has it."""
    port = binding.settings
    if port.batch_size > 1 and port.transaction == "bean" and not binding.spec.batch:
        raise SettingsError(
            f"{settings.source}: ports.{name}.batch_size: transaction = 'bean' with batch_size > 1 "
            f"needs a batch handler (@message_driven({name!r}, batch=True) taking a list); "
            f"{binding.spec.name} takes one message"
        )


def misspelled(name: str, others: list[str], handlers: dict[str, HandlerSpec]) -> str:
    """``. Did you mean ...?`` when a decorator's port name and a settings port differ by a typo."""
    close = difflib.get_close_matches(name, others, n=1)
    if not close:
        return ""
    decorated, configured = (close[0], name) if close[0] in handlers else (name, close[0])
    return (f". Did you mean @message_driven({configured!r}) in {handlers[decorated].name}, "
            f"which says {decorated!r}?")


def _refuse_backout_loop(settings: Settings, name: str, port: PortSettings) -> None:
    """A port reading its own backout queue would back a failing message out onto it for ever."""
    queue = port.queue_name
    if settings.queue(queue).backout_threshold and settings.backout_queue_for(queue) == queue:
        raise SettingsError(
            f"{settings.source}: ports.{name}: its queue {queue!r} is its own backout queue, so a "
            f"failing message would be backed out onto it again and again: set [queues.\"{queue}\"] "
            "backout_queue to another queue, or backout_threshold = 0"
        )
