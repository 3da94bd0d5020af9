"""``@message_driven``: marking handlers, finding them, and calling them.

Registration is not binding: the decorator only records the port name and
its defaults on the handler object itself. The container imports the
listener modules named in the settings and collects what they carry, so that
importing a listener does no I/O and needs no global registry.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter

from ..errors import ListenerError
from ..message import Message, validate_body, validator_for
from .signature import Signature, is_async_callable, read_signature

H = TypeVar("H", bound=Callable[..., Any])

_MARK = "__message_driven__"
log = logging.getLogger("mdbcontainer.handlers")


@dataclass(frozen=True)
class HandlerSpec:
    """What ``@message_driven`` recorded: the port, the inline port defaults, the target."""

    port: str
    target: Any
    defaults: dict[str, Any]
    batch: bool = False

    @property
    def is_bean(self) -> bool:
        return inspect.isclass(self.target)

    @property
    def name(self) -> str:
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def signature(self) -> Signature:
        """How the container calls the handler; ListenerError naming it when it cannot."""
        if not self.is_bean:
            return read_signature(self.name, self.target, method=False, batch=self.batch)
        static = inspect.getattr_static(self.target, "on_message", None)
        method = not isinstance(static, staticmethod | classmethod)
        signature = read_signature(f"{self.name}.on_message", self.target.on_message, method=method,
                                   batch=self.batch)
        for hook in ("setup", "teardown"):  # awaited only on an event loop: an async bean's
            if is_async_callable(getattr(self.target, hook, None)) and not signature.is_async:
                raise ListenerError(f"{self.name}.{hook}: an async def {hook} needs an async def "
                                    "on_message (a synchronous bean has no event loop to await it)")
        return signature

    @property
    def is_async(self) -> bool:
        """An ``async def`` handler (or bean ``on_message``): its port runs an event loop."""
        target = self.target.on_message if self.is_bean else self.target
        return is_async_callable(target)

    @property
    def code(self) -> Any:
        """The handler's code object, to recognise it on a blocked thread's stack."""
        target = self.target.on_message if self.is_bean else self.target
        return getattr(target, "__code__", None)


def message_driven(port: str, *, batch: bool = False, **port_defaults: Any) -> Callable[[H], H]:
    """Mark a function or a bean class as the handler of listener port ``port``.

    Keyword arguments are port settings (``destination``, ``max_retries``, ...);
    the TOML ``[ports.NAME]`` table overrides them key by key. The handler's
    first parameter's annotation decides what it receives: ``Message`` for the
    envelope, or any type pydantic can validate for the decoded body. It is
    called as ``(message_or_body, ctx)``, or ``(message_or_body)`` when it takes
    one parameter; the container checks this when it binds the handler.

    ``batch=True`` marks a batch handler: its first parameter is ``list[X]``
    and it is called once per batch (the Batches guide, docs/guides/batches.md).

    A class is a bean: ``setup()`` runs once per instance, ``on_message(message,
    ctx)`` per delivery, ``teardown()`` when the instance is discarded (after it
    raised) or at shutdown.

    ``batch=True`` makes it a batch handler: its first parameter is a
    ``list[X]`` (the element type decides what each item is, as above) and
    its context a ``BatchContext``; it is called once per batch of the port's
    ``batch_size`` deliveries, so that its database work is one bulk statement.
    """
    if not isinstance(port, str) or not port:
        raise ListenerError("@message_driven needs the listener port's name as a non-empty string")

    def mark(target: H) -> H:
        if inspect.isclass(target):
            if not callable(getattr(target, "on_message", None)):
                raise ListenerError(
                    f"{target.__module__}:{target.__qualname__}: a message-driven bean "
                    "needs an on_message(self, message, ctx) method"
                )
        elif not callable(target):
            raise ListenerError(f"@message_driven({port!r}) decorates a function or a class")
        spec = HandlerSpec(port, target, dict(port_defaults), batch=bool(batch))
        if spec.batch:
            Invoker.for_spec(spec)  # a batch handler without a list parameter fails at import
        setattr(target, _MARK, spec)
        return target

    return mark


def import_listeners(modules: list[str], search_path: Path | None = None) -> dict[str, HandlerSpec]:
    """Import the listener modules and return their handlers by port name.

    A module that does not exist is told apart from one whose own import failed,
    and two handlers for one port are an error.
    """
    for entry in (str(Path.cwd()), str(search_path) if search_path else None):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    found: dict[str, HandlerSpec] = {}
    for name in modules:
        for spec in _handlers_in(_import(name)):
            other = found.get(spec.port)
            if other is not None and other.target is not spec.target:
                raise ListenerError(
                    f"port {spec.port!r} has two handlers: {other.name} and {spec.name}"
                )
            found[spec.port] = spec
    return found


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise ListenerError(
                f"listener module {name!r} not found (is it on the path?)"
            ) from exc
        raise ListenerError(f"listener module {name!r} failed to import: {exc}") from exc
    except Exception as exc:
        raise ListenerError(
            f"listener module {name!r} failed to import: {type(exc).__name__}: {exc}"
        ) from exc


def _handlers_in(module: Any) -> list[HandlerSpec]:
    specs = []
    for value in vars(module).values():
        spec = getattr(value, _MARK, None) if inspect.isfunction(value) or inspect.isclass(value) else None
        if isinstance(spec, HandlerSpec) and spec.target is value:
            specs.append(spec)
    return specs


@dataclass
class Running:
    """The handler call in progress on one consumer: since when, for which message(s).

    Written by the consumer's thread around each call, read by /healthz, the
    heartbeat (``mdb ports``) and the control loop, which warns once per call
    that outlives the port's ``handler_timeout``.
    """

    since: float | None = None  # monotonic clock; None between calls
    warned: bool = False
    ctx: Any = field(default=None, repr=False)  # the call's context: its message(s)

    @property
    def message_ids(self) -> tuple[str, ...]:
        """The ids of the call's message(s): worked out when a reader asks, not on every call."""
        ctx = self.ctx
        message = getattr(ctx, "message", None)
        messages = getattr(ctx, "messages", None) or ([message] if message is not None else [])
        return tuple(str(m.id) for m in messages)

    def enter(self, ctx: Any) -> None:
        self.ctx = ctx
        self.warned = False
        self.since = time.monotonic()

    def leave(self) -> None:
        self.since = None

    def mirror(self, other: Running) -> None:
        """Show ``other``'s call (an async consumer shows the oldest of its tasks' calls)."""
        self.ctx, self.since, self.warned = other.ctx, other.since, False

    def seconds(self, now: float) -> float | None:
        """How long the call in progress has run; None between calls."""
        since = self.since
        return None if since is None else now - since


def refuse_awaitable(name: str, result: Any) -> None:
    """Raise when a synchronous handler call returned an awaitable: its work never ran.

    Acknowledging the message as handled would lose it, so the delivery fails
    as if the handler had raised. The coroutine is closed, so that Python does
    not warn later that it was never awaited.
    """
    if result is None or not inspect.isawaitable(result):
        return
    close = getattr(result, "close", None)
    if callable(close):
        close()
    raise TypeError(
        f"{name} returned a {type(result).__name__} from a synchronous call, so its work never "
        "ran: make it async def (a decorator around an async def should keep functools.wraps) "
        "or await what it returns"
    )


@dataclass
class Invoker:
    """Calls one handler for one consumer: holds that consumer's bean instance.

    A bean instance serves one consumer at a time, so each consumer thread owns
    an Invoker. An instance whose ``on_message`` raised is discarded
    (``teardown``) and a fresh one is made for the next delivery, as an EJB
    container does with a bean that threw a system exception.
    """

    spec: HandlerSpec
    adapter: TypeAdapter[Any] | None = None
    takes_context: bool = True
    running: Running = field(default_factory=Running)
    _bean: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # The handler function, looked up once; None for a bean (``call_bean``). The hot path of
        # a port without a transaction calls it inline (pipeline/single.py).
        self.function = None if self.spec.is_bean else self.spec.target

    @classmethod
    def for_spec(cls, spec: HandlerSpec) -> Invoker:
        """The invoker of ``spec``; ListenerError when the container could not call the handler."""
        signature = spec.signature()
        try:
            adapter = validator_for(signature.annotation)
        except Exception as exc:  # a type pydantic cannot validate: every delivery would fail
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ListenerError(
                f"{spec.name}: its first parameter's type {signature.annotation!r} cannot be "
                f"validated: {first_line}"
            ) from exc
        return cls(spec, adapter, signature.takes_context)

    def argument(self, message: Message) -> Any:
        """The handler's first argument (a batch handler's list item): the envelope or the
        validated body (may raise InvalidBody)."""
        if self.adapter is None:
            return message
        return validate_body(self.adapter, message.body)

    def __call__(self, argument: Any, ctx: Any) -> None:
        running = self.running
        running.enter(ctx)
        try:
            function = self.function
            if function is None:
                self.call_bean(argument, ctx)
                return
            result = function(argument, ctx) if self.takes_context else function(argument)
            if result is not None:
                refuse_awaitable(self.spec.name, result)
        finally:
            running.since = None  # Running.leave(), without the call

    def call_bean(self, argument: Any, ctx: Any) -> None:
        """Call the bean instance's ``on_message`` (made on first use, discarded if it raises)."""
        args = (argument, ctx) if self.takes_context else (argument,)
        bean = self._instance()
        try:
            refuse_awaitable(f"{self.spec.name}.on_message", bean.on_message(*args))
        except BaseException:
            self.discard()
            raise

    async def acall(self, argument: Any, ctx: Any) -> None:
        """Await an async handler (a task on its port's event loop; see docs/architecture.md)."""
        self.running.enter(ctx)
        try:
            await self._acall(argument, ctx)
        finally:
            self.running.leave()

    async def _acall(self, argument: Any, ctx: Any) -> None:
        args = (argument, ctx) if self.takes_context else (argument,)
        if not self.spec.is_bean:
            await self.spec.target(*args)
            return
        bean = await self._ainstance()
        try:
            await bean.on_message(*args)
        except BaseException:
            await self.adiscard()
            raise

    async def _ainstance(self) -> Any:
        if self._bean is None:
            bean = self.spec.target()
            setup = getattr(bean, "setup", None)
            if callable(setup) and inspect.isawaitable(result := setup()):
                await result
            self._bean = bean
        return self._bean

    async def adiscard(self) -> None:
        """Tear an async bean's instance down, awaiting an ``async def teardown``."""
        bean, self._bean = self._bean, None
        teardown = getattr(bean, "teardown", None)
        if not callable(teardown):
            return
        try:
            if inspect.isawaitable(result := teardown()):
                await result
        except Exception:
            log.exception("%s: teardown raised; the instance is discarded anyway", self.spec.name)

    def _instance(self) -> Any:
        if self._bean is None:
            bean = self.spec.target()
            setup = getattr(bean, "setup", None)
            if callable(setup):
                setup()
            self._bean = bean
        return self._bean

    def discard(self) -> None:
        """Tear the bean instance down (after a failure, or at shutdown)."""
        bean, self._bean = self._bean, None
        teardown = getattr(bean, "teardown", None)
        if not callable(teardown):
            return
        try:
            teardown()
        except Exception:  # must not replace the handler's error, nor end a consumer thread
            log.exception("%s: teardown raised; the instance is discarded anyway", self.spec.name)
