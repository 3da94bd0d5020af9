"""Port ``BatchTyped``: a batch handler of pydantic models (the list's element type)."""

from pydantic import BaseModel

from mdbcontainer import BatchContext, message_driven

from .batched import log_call
from .common import effects


class Item(BaseModel):
    n: int


@message_driven("BatchTyped", batch=True)
def batch_typed(items: list[Item], ctx: BatchContext) -> None:
    log_call("BatchTyped", len(items))
    ctx.session.execute(effects.insert(), [
        {"port": "BatchTyped", "message_id": m.id, "n": item.n}
        for item, m in zip(items, ctx.messages, strict=True)
    ])
