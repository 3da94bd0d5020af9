"""Port ``UpsertBean``: upsert.py's idiom inside a bean-managed ``ctx.transaction()``."""

from mdbcontainer import Message, MessageContext, message_driven

from .upsert import upsert


@message_driven("UpsertBean", transaction="bean")
def on_upsert_bean(message: Message, ctx: MessageContext) -> None:
    with ctx.transaction() as session:
        upsert("UpsertBean", message, session)
