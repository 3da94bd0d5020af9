"""Ports whose handlers hide an ``async def``: behind a plain decorator, or returned by a ``def``.

``Decorated``: an ``async def`` wrapped by a ``functools.wraps`` decorator that is a
plain ``def`` (a logging or timing wrapper): the container must await what it returns.
``Forgetful``: a ``def`` that returns a coroutine (it forgot the ``await``): its
deliveries fail, and are never acknowledged as handled. ``DONE`` lists the ids
whose async work ran to its end.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

from mdbcontainer import Message, MessageContext, message_driven

DONE: list[str] = []
CALLS: list[str] = []


def logged(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        CALLS.append(handler.__name__)
        return handler(*args, **kwargs)

    return wrapper


async def _work(message: Message) -> None:
    await asyncio.sleep(0)
    DONE.append(message.id)


@message_driven("Decorated")
@logged
async def decorated(message: Message, ctx: MessageContext) -> None:
    await _work(message)


@message_driven("Forgetful")
def forgetful(message: Message, ctx: MessageContext) -> Any:
    return _work(message)  # the await forgotten: the work never runs
