"""Port ``InProc``: a handler for tests that run the container in their own process.

Those tests (tests/pipeline, tests/units) start ``Container`` in the test
process, so the handler takes its script from this module and reports here:
``FAIL_FIRST[message_id]`` is how many deliveries of that message fail before
one works, and each attempt is appended to ``ATTEMPTS`` as (message id,
redelivery count the handler saw). Its work is a row in ``common.effects``,
written in the unit of work's session (none when the port has no transaction).
A body may script the context's calls too: ``{"send": QUEUE}`` sends
``{"from": id}`` there, ``{"move_to": QUEUE}`` moves the message there with
reason ``needs-review``, ``{"acknowledge": true}`` acknowledges it (``client``),
``{"bean": true}`` writes the row in ``ctx.transaction()`` (bean-managed).
"""

from __future__ import annotations

from mdbcontainer import Message, MessageContext, TransactionError, message_driven

from .common import effects

FAIL_FIRST: dict[str, int] = {}
ATTEMPTS: list[tuple[str, int]] = []


@message_driven("InProc")
def handle(message: Message, ctx: MessageContext) -> None:
    ATTEMPTS.append((message.id, message.redelivery_count))
    try:
        session = ctx.session
    except TransactionError:
        session = None
    if session is not None:
        session.execute(effects.insert().values(port="InProc", message_id=message.id))
    script = message.body if isinstance(message.body, dict) else {}
    if script.get("bean"):
        with ctx.transaction() as bean:
            bean.execute(effects.insert().values(port="InProc", message_id=message.id))
    if "send" in script:
        ctx.send(script["send"], {"from": message.id})
    if "move_to" in script:
        ctx.move_to(script["move_to"], "needs-review")
    if script.get("acknowledge"):
        ctx.acknowledge()
    left = FAIL_FIRST.get(message.id, 0)
    if left:
        FAIL_FIRST[message.id] = left - 1
        raise RuntimeError(f"scripted failure of {message.id} after its work")
