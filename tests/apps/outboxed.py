"""Port ``Outboxed``: receives what code outside any handler sent through the outbox; records it once-only."""

from mdbcontainer import Message, MessageContext, message_driven

from .common import perform


@message_driven("Outboxed", transaction="container")
def outboxed(message: Message, ctx: MessageContext) -> None:
    perform("Outboxed", message, ctx, ctx.session)
