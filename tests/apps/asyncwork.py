"""Port ``AsyncWork``: an ``async def`` handler; its transaction kind comes from the settings."""

from mdbcontainer import Message, MessageContext, TransactionError, message_driven

from .common import perform_async


@message_driven("AsyncWork")
async def work(message: Message, ctx: MessageContext) -> None:
    try:
        session = ctx.session
    except TransactionError:
        session = None
    await perform_async("AsyncWork", message, ctx, session)
