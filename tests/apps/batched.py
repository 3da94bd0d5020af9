"""What the batch handlers (``batch=True``) of batchwork.py, batchbean.py and batchtyped.py do.

They do what ``common.perform`` does for each message of the list (the
actions fail, rollback, send, sleep, and ack: ``ctx.acknowledge()``), with the
effects inserted in one statement, and append one line per call to
``$MDB_TEST_BATCHES`` (the port and the list's length), so a test sees how the
deliveries were grouped.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mdbcontainer import BatchContext, Message

from .common import effects, log_attempt, wait_at_commit


def log_call(port: str, size: int) -> None:
    path = os.environ.get("MDB_TEST_BATCHES")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{port}\t{size}\n")


def perform_batch(port: str, messages: list[Message], ctx: BatchContext, session: Any | None) -> None:
    log_call(port, len(messages))
    rows = []
    for message in messages:
        body: dict[str, Any] = message.body if isinstance(message.body, dict) else {}
        log_attempt(port, message)
        action = body.get("action", "ok")
        if action == "fail":
            raise RuntimeError(f"poison message {body.get('n')}")
        if action == "rollback":
            ctx.set_rollback_only()
        if action == "sleep":
            time.sleep(float(body.get("seconds", 1)))
        if action == "ack":
            ctx.acknowledge()
        rows.append({"port": port, "message_id": message.id, "n": body.get("n")})
        if action == "send":
            ctx.send(body["to"], {"n": body.get("n"), "action": "ok"}, message_id=f"{message.id}.out")
    if session is not None and rows:
        session.execute(effects.insert(), rows)
        for message in messages:
            body = message.body if isinstance(message.body, dict) else {}
            if (statement := wait_at_commit(body)) is not None:
                session.execute(statement)
