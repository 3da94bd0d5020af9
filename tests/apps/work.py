"""Port ``Work``: a function handler; its transaction kind comes from the settings."""

from mdbcontainer import Message, MessageContext, TransactionError, message_driven

from .common import perform


@message_driven("Work")
def work(message: Message, ctx: MessageContext) -> None:
    try:
        session = ctx.session
    except TransactionError:
        session = None
    perform("Work", message, ctx, session)
