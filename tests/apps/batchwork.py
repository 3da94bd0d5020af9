"""Port ``BatchWork``: a batch handler; its transaction kind comes from the settings."""

from mdbcontainer import BatchContext, Message, TransactionError, message_driven

from .batched import perform_batch


@message_driven("BatchWork", batch=True)
def batch_work(messages: list[Message], ctx: BatchContext) -> None:
    try:
        session = ctx.session
    except TransactionError:
        session = None
    perform_batch("BatchWork", messages, ctx, session)
