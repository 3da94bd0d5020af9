"""Whether the container can call a handler, read from its signature when it is bound.

A handler is called as ``handler(message_or_body, ctx)`` or, when it takes one
parameter, ``handler(message_or_body)``; a bean's ``on_message`` the same way
after ``self``. Anything else (no parameter, a third required one, a required
keyword-only one) would fail on every delivery with a ``TypeError`` that the
pipeline cannot tell from a poison message, so it is a :class:`ListenerError`
at bind time: ``mdb check`` and ``mdb run`` exit 2 before anything is consumed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args, get_origin, get_type_hints

from ..errors import ListenerError
from ..message import Message

FORMS = "(message_or_body, ctx) or (message_or_body)"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Signature:
    """How to call a handler: what its first parameter asks for, and whether it takes ``ctx``.

    ``annotation`` is the first parameter's type (``Message`` when unannotated);
    for a batch handler it is the list's element type.
    """

    annotation: Any
    takes_context: bool
    is_async: bool = False  # an ``async def``: the container awaits it on its port's event loop


def read_signature(name: str, func: Callable[..., Any], *, method: bool, batch: bool) -> Signature:
    """The callable form of ``func`` (``name`` is the handler's, for the error line).

    ``method``: ``func`` is a bean's ``on_message`` read from its class, so its
    first parameter is ``self``.
    """
    _refuse_async_generator(name, func)
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ListenerError(f"{name}: cannot read its signature: {exc}") from exc
    if method:
        params = params[1:]
    first = _check_parameters(name, params)
    annotation = _first_annotation(name, func, first)
    if batch:
        annotation = _element_of(name, annotation, first)
    positional = [p for p in params if p.kind in _POSITIONAL]
    takes_context = len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
    return Signature(annotation, takes_context, is_async_callable(func))


def is_async_callable(func: Any) -> bool:
    """Whether calling ``func`` starts a coroutine: an ``async def``, also behind a decorator.

    A plain ``def`` wrapper made with ``functools.wraps`` (logging, timing)
    returns the coroutine of the ``async def`` it wraps; taken for a
    synchronous handler, that coroutine would never be awaited and its
    message acknowledged unprocessed. ``inspect.unwrap`` follows
    ``__wrapped__`` to the function the decorator was given.
    """
    if inspect.iscoroutinefunction(func):
        return True
    try:
        return inspect.iscoroutinefunction(inspect.unwrap(func))
    except ValueError:  # a __wrapped__ cycle: nothing to follow
        return False


def _refuse_async_generator(name: str, func: Callable[..., Any]) -> None:
    """An ``async def`` with ``yield`` returns a generator, not something to await: its work
    would never run and its messages would be acknowledged unprocessed."""
    try:
        inner = inspect.unwrap(func)
    except ValueError:
        inner = func
    if any(inspect.isasyncgenfunction(f) or inspect.isgeneratorfunction(f) for f in (func, inner)):
        raise ListenerError(
            f"{name}: a handler must return, not yield (a generator's body would never run "
            "and its messages would be acknowledged unprocessed): remove the yield"
        )


def _check_parameters(name: str, params: list[inspect.Parameter]) -> inspect.Parameter | None:
    """The first parameter, after refusing a signature the container cannot call."""
    positional = [p for p in params if p.kind in _POSITIONAL]
    star = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if not positional and not star:
        problem = "it takes no parameter"
    elif len(required) > 2:
        problem = f"it requires {len(required)} parameters ({', '.join(p.name for p in required)})"
    elif keyword_only:
        problem = f"it requires the keyword-only parameter {keyword_only[0]!r}"
    else:
        return positional[0] if positional else None
    raise ListenerError(f"{name}: the container calls a handler as {FORMS}, but {problem}")


def _first_annotation(name: str, func: Callable[..., Any], first: inspect.Parameter | None) -> Any:
    if first is None:
        return Message
    try:
        hints = get_type_hints(func)
    except Exception as exc:
        raise ListenerError(f"{name}: cannot resolve its annotations: {exc}") from exc
    return hints.get(first.name, Message)


def _element_of(name: str, annotation: Any, first: inspect.Parameter | None) -> Any:
    """A batch handler's first parameter is ``list[X]``: X decides what each element is."""
    if annotation is list:
        return Message
    if get_origin(annotation) is list:
        (element,) = get_args(annotation)
        return element
    unannotated = first is None or first.annotation is first.empty
    what = "unannotated" if unannotated else getattr(annotation, "__name__", repr(annotation))
    raise ListenerError(
        f"{name}: a batch handler (batch=True) takes a list of messages or bodies first, "
        f"annotated list[X], but its first parameter is {what}"
    )
