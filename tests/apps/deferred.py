"""Port ``Deferred``: work the database rejects only at commit (deferred constraints).

The handler adds an ORM object and returns; the INSERT is flushed when the
container commits, so a unique-key violation surfaces after the handler
returned, where container-managed transactions hide it from the application.
"""

from sqlalchemy.orm import registry

from mdbcontainer import Message, MessageContext, message_driven

from .common import log_attempt, unique_keys


class UniqueKey:
    """A row of ``unique_keys``; ``key`` is unique."""

    def __init__(self, key: str) -> None:
        self.key = key


registry().map_imperatively(UniqueKey, unique_keys)


@message_driven("Deferred", transaction="container")
def deferred(message: Message, ctx: MessageContext) -> None:
    log_attempt("Deferred", message)
    ctx.session.add(UniqueKey(message.body["key"]))
