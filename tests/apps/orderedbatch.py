"""Port ``OrderedBatch``: ``ordered.py``'s handler as a batch handler."""

from __future__ import annotations

import time

from mdbcontainer import BatchContext, Message, message_driven

from .ordered import _check, _record, _session


@message_driven("OrderedBatch", batch=True)
def ordered_batch(messages: list[Message], ctx: BatchContext) -> None:
    session = _session(ctx)
    for message in messages:
        body = _check("OrderedBatch", message)
        time.sleep(float(body.get("sleep", 0)))
        _record(session, "OrderedBatch", message, body)
