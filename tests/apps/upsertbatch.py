"""Port ``UpsertBatch``: upsert.py's idiom in a batch handler, container- or bean-managed."""

from mdbcontainer import BatchContext, Message, TransactionError, message_driven

from .upsert import upsert


@message_driven("UpsertBatch", batch=True)
def on_upsert_batch(messages: list[Message], ctx: BatchContext) -> None:
    try:
        session = ctx.session
    except TransactionError:  # bean-managed: one ctx.transaction() for the batch
        with ctx.transaction() as session:
            for message in messages:
                upsert("UpsertBatch", message, session)
        return
    for message in messages:
        upsert("UpsertBatch", message, session)
