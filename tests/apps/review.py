"""Port ``Review``: a container-managed handler for the review's findings (tests/test_review.py).

Body actions: ``badsql`` runs SQL naming a table that does not exist (a bug in
the handler, not a database outage); anything else records what the handler
saw of the envelope (one JSON line in ``$MDB_TEST_LOG.review``).
"""

from __future__ import annotations

import json
import os

from sqlalchemy import text

from mdbcontainer import Message, MessageContext, message_driven

from .common import log_attempt


@message_driven("Review")
def review(message: Message, ctx: MessageContext) -> None:
    log_attempt("Review", message)
    body = message.body if isinstance(message.body, dict) else {}
    if body.get("action") == "badsql":
        ctx.session.execute(text("INSERT INTO review_no_such_table (n) VALUES (1)"))
        return
    path = os.environ.get("MDB_TEST_LOG")
    if path:
        with open(path + ".review", "a", encoding="utf-8") as out:
            out.write(json.dumps({"id": message.id, "persistent": message.persistent}) + "\n")
