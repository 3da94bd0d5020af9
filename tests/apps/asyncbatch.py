"""Port ``AsyncBatch``: an ``async def`` batch handler; its transaction kind comes from the settings.

It does what batched.perform_batch does, awaiting ``asyncio.sleep(0)`` per message and
inserting the batch's rows through the ``AsyncSession`` in one statement.
"""

import asyncio
from typing import Any

from mdbcontainer import BatchContext, Message, TransactionError, message_driven

from .batched import log_call
from .common import effects, log_attempt


@message_driven("AsyncBatch", batch=True)
async def async_batch(messages: list[Message], ctx: BatchContext) -> None:
    try:
        session = ctx.session
    except TransactionError:
        session = None
    log_call("AsyncBatch", len(messages))
    rows = []
    for message in messages:
        body: dict[str, Any] = message.body if isinstance(message.body, dict) else {}
        log_attempt("AsyncBatch", message)
        await asyncio.sleep(0)
        if body.get("action") == "fail":
            raise RuntimeError(f"poison message {body.get('n')}")
        rows.append({"port": "AsyncBatch", "message_id": message.id, "n": body.get("n")})
        if body.get("action") == "send":
            ctx.send(body["to"], {"n": body.get("n"), "action": "ok"}, message_id=f"{message.id}.out")
    if session is not None and rows:
        await session.execute(effects.insert(), rows)
