"""Port ``BatchBean``: a bean-managed batch handler: one ``ctx.transaction()`` per batch."""

from mdbcontainer import BatchContext, Message, message_driven

from .batched import perform_batch


@message_driven("BatchBean", batch=True, transaction="bean")
def batch_bean(messages: list[Message], ctx: BatchContext) -> None:
    with ctx.transaction() as session:
        perform_batch("BatchBean", messages, ctx, session)
