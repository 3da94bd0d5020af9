"""What the test handlers do, chosen by the body: ``{"n": 1, "action": "ok"}``.

Actions: ok, fail (raise), rollback (set_rollback_only), kill (SIGKILL this
process), move (ctx.move_to body["to"]; with ``"while": FILE``, only while FILE
exists, else the work alone), send (ctx.send body["to"]),
constraint (violate a unique key at commit), sleep (body["seconds"]), badsql
(SQL naming a table that does not exist: a bug in the handler, not a database
outage), outage (while the file body["flag"] exists, connect to a database
that refuses: the handler's own database is down, a real OperationalError).
``"syncwait": PATH`` (the first time, while the file PATH does not exist: it is created)
makes the transaction's COMMIT wait for a synchronous standby (``SET LOCAL
synchronous_commit = on``), so a test can end the session while the COMMIT waits.
With ``"pause": [reached, go]`` the handler first creates the file ``reached``
and waits for the file ``go`` (so a test can act while it runs).
An optional ``"fail_first": K`` fails the first K deliveries (redelivery count
below K), whatever the action, then lets it run (a message that succeeds on a retry).
An optional ``"then"`` runs after the action: ``"rollback"``
(set_rollback_only) or ``"fail"`` (raise), so work and sends made by the
action are discarded with the transaction.

Every delivery attempt is appended to the file ``$MDB_TEST_LOG`` (one line:
port, message id, action, redelivery count) before the action runs, so a test
sees attempts that rolled back or crashed. Committed work is a row in the
``effects`` table (schema ``$MDB_TEST_SCHEMA`` on PostgreSQL).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, UniqueConstraint, create_engine, text

from mdbcontainer import Message, MessageContext

metadata = MetaData(schema=os.environ.get("MDB_TEST_SCHEMA") or None)
effects = Table(
    "effects", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("port", String(100), nullable=False),
    Column("message_id", String(255), nullable=False),
    Column("n", Integer),
)
unique_keys = Table(
    "unique_keys", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", String(100), nullable=False),
    UniqueConstraint("key", name="uq_unique_keys_key"),
)


def log_attempt(port: str, message: Message) -> None:
    path = os.environ.get("MDB_TEST_LOG")
    if not path:
        return
    body = message.body if isinstance(message.body, dict) else {}
    line = (f"{port}\t{message.id}\t{body.get('action', 'ok')}\t{message.redelivery_count}"
            f"\t{time.time():.3f}\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def pause(reached: str, go: str, limit: float = 60.0) -> None:
    """Say the handler got here, then wait until the test says go (at most ``limit`` seconds)."""
    open(reached, "w").close()
    deadline = time.monotonic() + limit
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_at_commit(body: dict[str, Any]) -> Any | None:
    """The statement that makes this transaction's COMMIT wait for a standby, once (``syncwait``)."""
    flag = body.get("syncwait")
    if not flag or os.path.exists(flag):
        return None
    open(flag, "w").close()
    return text("SET LOCAL synchronous_commit = on")


def perform(port: str, message: Message, ctx: MessageContext, session: Any | None) -> None:
    body: dict[str, Any] = message.body if isinstance(message.body, dict) else {"action": "ok"}
    action = body.get("action", "ok")
    log_attempt(port, message)
    if "pause" in body:
        pause(*body["pause"])
    if action == "outage" and os.path.exists(body["flag"]):
        create_engine("postgresql+psycopg://nobody@127.0.0.1:1/down").connect().close()
    if message.redelivery_count < int(body.get("fail_first", 0)):
        raise RuntimeError(f"message {body.get('n')} fails its first {body['fail_first']} deliveries")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail":
        raise RuntimeError(f"poison message {body.get('n')}")
    if action == "sleep":
        time.sleep(float(body.get("seconds", 1)))
    if session is not None:
        session.execute(effects.insert().values(port=port, message_id=message.id, n=body.get("n")))
        if (statement := wait_at_commit(body)) is not None:
            session.execute(statement)
        if action == "constraint":
            session.execute(unique_keys.insert().values(key="always-the-same"))
        if action == "badsql":
            session.execute(text("INSERT INTO no_such_table (n) VALUES (1)"))
    if action == "send":
        ctx.send(body["to"], {"n": body.get("n"), "action": "ok"}, message_id=f"{message.id}.out")
    if action == "rollback":
        ctx.set_rollback_only()
    if action == "move" and os.path.exists(body.get("while", os.curdir)):  # "while": a flag file
        ctx.move_to(body["to"], "moved by the handler")
    if body.get("then") == "rollback":
        ctx.set_rollback_only()
    if body.get("then") == "fail":
        raise RuntimeError(f"failed after its work {body.get('n')}")


async def perform_async(port: str, message: Message, ctx: MessageContext, session: Any | None) -> None:
    """:func:`perform` for an async handler: the same actions, awaited on an ``AsyncSession``.

    ``block`` runs ``time.sleep`` inside the coroutine (a handler that blocks the event loop);
    ``sleep`` awaits ``asyncio.sleep``, as a handler waiting on I/O does; ``"hold": seconds``
    awaits after its row is written, its transaction open.
    """
    import asyncio

    body: dict[str, Any] = message.body if isinstance(message.body, dict) else {"action": "ok"}
    action = body.get("action", "ok")
    log_attempt(port, message)
    if "pause" in body:
        reached, go = body["pause"]
        open(reached, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    if action == "outage" and os.path.exists(body["flag"]):
        create_engine("postgresql+psycopg://nobody@127.0.0.1:1/down").connect().close()
    if message.redelivery_count < int(body.get("fail_first", 0)):
        raise RuntimeError(f"message {body.get('n')} fails its first {body['fail_first']} deliveries")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail":
        raise RuntimeError(f"poison message {body.get('n')}")
    if action == "sleep":
        await asyncio.sleep(float(body.get("seconds", 1)))
    if action == "block":
        time.sleep(float(body.get("seconds", 1.5)))
    if session is not None:
        await session.execute(effects.insert().values(port=port, message_id=message.id, n=body.get("n")))
        if (statement := wait_at_commit(body)) is not None:
            await session.execute(statement)
        if action == "constraint":
            await session.execute(unique_keys.insert().values(key="always-the-same"))
        if action == "swallow":  # an error caught inside the transaction: PostgreSQL aborts it
            try:
                await session.execute(text("INSERT INTO no_such_table (n) VALUES (1)"))
            except Exception:
                pass
        if "hold" in body:  # awaits with its row written: SQLite's write lock held across an await
            await asyncio.sleep(float(body["hold"]))
    if action == "send":
        ctx.send(body["to"], {"n": body.get("n"), "action": "ok"}, message_id=f"{message.id}.out")
    if action == "rollback":
        ctx.set_rollback_only()
    if action == "move" and os.path.exists(body.get("while", os.curdir)):  # "while": a flag file
        ctx.move_to(body["to"], "moved by the handler")
    if body.get("then") == "fail":
        raise RuntimeError(f"failed after its work {body.get('n')}")
