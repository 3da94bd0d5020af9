"""Port ``Crowd``: every handler holds its session until all the port's consumers hold theirs.

Each delivery writes its effect through ``ctx.session`` (so its connection is
checked out, with the dedup claim) and then waits at a barrier of
``$MDB_TEST_CROWD`` parties: the deliveries can only finish once that many
consumers hold a database connection at the same time.
"""

import os
import threading

from mdbcontainer import Message, MessageContext, message_driven

from .common import effects, log_attempt

_all_in = threading.Barrier(int(os.environ.get("MDB_TEST_CROWD", "40")))


@message_driven("Crowd")
def crowd(message: Message, ctx: MessageContext) -> None:
    log_attempt("Crowd", message)
    ctx.session.execute(effects.insert().values(port="Crowd", message_id=message.id))
    _all_in.wait(timeout=90)
