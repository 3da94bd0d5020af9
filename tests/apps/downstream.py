"""Port ``Downstream``: receives what the other ports send; records it once-only."""

from mdbcontainer import Message, MessageContext, message_driven

from .common import perform


@message_driven("Downstream", transaction="container")
def downstream(message: Message, ctx: MessageContext) -> None:
    perform("Downstream", message, ctx, ctx.session)
