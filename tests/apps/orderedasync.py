"""Port ``OrderedAsync``: ``ordered.py``'s handler as ``async def``."""

from __future__ import annotations

import asyncio

from mdbcontainer import Message, MessageContext, message_driven

from .common import effects
from .ordered import _check, _session


@message_driven("OrderedAsync")
async def ordered_async(message: Message, ctx: MessageContext) -> None:
    body = _check("OrderedAsync", message)
    await asyncio.sleep(float(body.get("sleep", 0)))
    session = _session(ctx)
    if session is not None:
        await session.execute(effects.insert().values(port="OrderedAsync", message_id=message.id,
                                                      n=body.get("seq")))
