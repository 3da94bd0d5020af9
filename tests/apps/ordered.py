"""Port ``Ordered`` (``order_by``, a def handler); ``orderedasync`` and ``orderedbatch`` are its twins.

The body says what a delivery does: ``{"key": "k3", "seq": 17, "sleep": 0.004,
"fail_once": true, "poison": false, "kill_flag": PATH, "poison_flag": PATH}``
(poison while the file ``poison_flag`` exists; SIGKILL once, when ``kill_flag`` does not exist yet); the message id is
``KEY-SEQ``. Every attempt goes to ``$MDB_TEST_LOG`` (common.log_attempt), and
the committed work is one ``effects`` row per message (``n`` = its seq), so a
test reads each key's committed order from the rows' ids.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from mdbcontainer import Message, MessageContext, TransactionError, message_driven

from .common import effects, log_attempt


def _session(ctx: Any) -> Any:
    try:
        return ctx.session
    except TransactionError:
        return None


def _check(port: str, message: Message) -> dict[str, Any]:
    body: dict[str, Any] = message.body if isinstance(message.body, dict) else {}
    log_attempt(port, message)
    flag = body.get("kill_flag")
    if flag and not os.path.exists(flag):  # kill the process once: the flag says it happened
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if body.get("poison") or (body.get("poison_flag") and os.path.exists(body["poison_flag"])):
        raise RuntimeError(f"poison message {message.id}")
    if body.get("fail_once") and message.redelivery_count == 0:
        raise RuntimeError(f"message {message.id} fails its first delivery")
    return body


def _record(session: Any, port: str, message: Message, body: dict[str, Any]) -> None:
    if session is not None:
        session.execute(effects.insert().values(port=port, message_id=message.id, n=body.get("seq")))


def log_process(message: Message, began: float) -> None:
    """``$MDB_TEST_LOG.pids``: which process ran the message, from when to when."""
    path = os.environ.get("MDB_TEST_LOG")
    if path:
        with open(f"{path}.pids", "a") as out:
            out.write(f"{message.id}\t{os.getpid()}\t{began:.4f}\t{time.time():.4f}\n")


@message_driven("Ordered")
def ordered(message: Message, ctx: MessageContext) -> None:
    """Container-managed by default; with ``transaction = "bean"`` it writes in ctx.transaction()."""
    began = time.time()
    body = _check("Ordered", message)
    time.sleep(float(body.get("sleep", 0)))
    session = _session(ctx)
    if session is not None:
        _record(session, "Ordered", message, body)
    else:
        try:
            manager = ctx.transaction()
        except TransactionError:  # transaction = "none": no database work
            manager = None
        if manager is not None:
            with manager as bean_session:
                _record(bean_session, "Ordered", message, body)
    log_process(message, began)
