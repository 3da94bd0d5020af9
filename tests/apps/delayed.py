"""Port ``Delayed``: a message that fails its first ``fail`` deliveries, then commits its work.

The body says how many deliveries fail: ``{"n": 1, "fail": 2}`` fails twice and
succeeds on the third (``fail`` absent: succeeds at once). Each attempt is one
line in ``$MDB_TEST_LOG`` (as common.py writes it) and a JSON line with what
the handler saw (headers, priority, expiry) in ``$MDB_TEST_LOG.delayed``. A
success inserts its ``effects`` row in the container's transaction.
"""

from __future__ import annotations

import json
import os
import time

from mdbcontainer import Message, MessageContext, message_driven

from .common import effects, log_attempt


def record(message: Message) -> None:
    path = os.environ.get("MDB_TEST_LOG")
    if not path:
        return
    line = json.dumps({
        "id": message.id, "count": message.redelivery_count, "priority": message.priority,
        "headers": {k: v for k, v in message.headers.items() if isinstance(v, str | int)},
        "expires_at": message.expires_at.isoformat() if message.expires_at else None,
        "at": time.time(),
    })
    fd = os.open(path + ".delayed", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@message_driven("Delayed")
def delayed(message: Message, ctx: MessageContext) -> None:
    body = message.body if isinstance(message.body, dict) else {}
    log_attempt("Delayed", message)
    record(message)
    if message.redelivery_count < int(body.get("fail", 0)):
        raise RuntimeError(f"message {message.id} fails delivery {message.redelivery_count + 1}")
    ctx.session.execute(effects.insert().values(port="Delayed", message_id=message.id, n=body.get("n")))
