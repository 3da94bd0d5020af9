"""The walkthrough's MDB: it processes orders and rolls back anything else.

A body without an ``order`` is a poison message to this application (the
original JMS MDB expecting a TextMessage and getting another type). The MDB takes
the article's option 1: ``set_rollback_only()``, so the message goes back to
its queue as a failed delivery.
"""

from __future__ import annotations

import logging

from mdbcontainer import Message, MessageContext, message_driven

log = logging.getLogger("poison_listener")


@message_driven("SamplePtoPListenerPort")
def on_message(message: Message, ctx: MessageContext) -> None:
    body = message.body
    if not isinstance(body, dict) or "order" not in body:
        log.warning("poison message %s (redelivery count %d): rolling back",
                    message.id, message.redelivery_count)
        ctx.set_rollback_only()
        return
    log.warning("processed order %s", body["order"])  # WARNING: shows at the default level too
