"""Port ``Jms``: the README's JMS mechanisms; transaction and acknowledge mode come from the settings.

The body chooses what the handler does: ``{"n": 1, "action": "ack"}``. Actions:
ok, ack (ctx.acknowledge()), recover (ctx.recover(), first delivery only),
fail, fail_once (fail on the first delivery only), send (ctx.send to each
queue of ``to``, then ``fail_once`` if ``then_fail``), reply (ctx.reply),
request (Producer.request from inside the handler; the error is recorded).

Each attempt is one line in ``$MDB_TEST_LOG`` (as common.py writes it) and a
JSON line with the envelope in ``$MDB_TEST_LOG.jms``. With a transaction
(container or bean), the handler inserts its ``effects`` row in it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mdbcontainer import MdbError, Message, MessageContext, Producer, load_settings, message_driven

from .common import effects, log_attempt


def record(message: Message, **extra: Any) -> None:
    path = os.environ.get("MDB_TEST_LOG")
    if not path:
        return
    body = message.body if isinstance(message.body, dict) else {}
    line = json.dumps({
        "id": message.id, "n": body.get("n"), "action": body.get("action", "ok"),
        "count": message.redelivery_count, "redelivered": message.redelivered,
        "priority": message.priority, "persistent": message.persistent,
        "correlation_id": message.correlation_id, "reply_to": message.reply_to, **extra,
    })
    fd = os.open(path + ".jms", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def write_effect(message: Message, ctx: MessageContext, n: Any) -> None:
    row = effects.insert().values(port="Jms", message_id=message.id, n=n)
    try:
        ctx.session.execute(row)
        return
    except MdbError:
        pass
    try:
        with ctx.transaction() as session:
            session.execute(row)
    except MdbError as exc:
        if "needs transaction = 'bean'" not in str(exc):
            raise


@message_driven("Jms")
def jms(message: Message, ctx: MessageContext) -> None:
    body: dict[str, Any] = message.body if isinstance(message.body, dict) else {}
    action = body.get("action", "ok")
    log_attempt("Jms", message)
    first = message.redelivery_count == 0 and not message.redelivered
    extra: dict[str, Any] = {}
    if action == "request":
        extra["error"] = _request_from_handler(body)
    record(message, **extra)
    write_effect(message, ctx, body.get("n"))
    if action == "ack":
        ctx.acknowledge()
    elif action == "recover" and first:
        ctx.recover()
    elif action == "send":
        for queue in body["to"]:
            ctx.send(queue, {"n": body.get("n")}, message_id=f"{message.id}.{queue}")
    elif action == "reply":
        ctx.reply({"echo": body.get("n"), "port": ctx.port})
    if action == "fail" or (first and (action == "fail_once" or body.get("then_fail"))):
        raise RuntimeError(f"failing message {body.get('n')}")


def _request_from_handler(body: dict[str, Any]) -> str:
    producer = Producer.from_settings(load_settings(body["settings"], environ={}))
    try:
        producer.request(body["to"], {"n": 0}, timeout=2)
    except MdbError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        producer.close()
    return ""


# -- for the tests: what the handler recorded, and the CLI as a user runs it ----------


def records(log_path: Any) -> list[dict[str, Any]]:
    """The JSON lines this handler wrote next to ``backend.log``, in order."""
    path = f"{log_path}.jms"
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

