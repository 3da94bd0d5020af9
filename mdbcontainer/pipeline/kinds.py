"""Which pipeline a port's consumer runs: per message or batched, sync or async, ordered or not."""

from __future__ import annotations

from .async_batch import AsyncBatchPipeline
from .async_single import AsyncPipeline
from .batch import BatchPipeline
from .ordered import OrderedPipeline
from .ordered_batch import OrderedAsyncBatchPipeline, OrderedBatchPipeline
from .single import ConsumerView, Pipeline, PortView


def pipeline_for(port: PortView, consumer: ConsumerView) -> Pipeline:
    """The per-message pipeline, the batch pipeline of a batched port, or an ordered port's."""
    batched = port.settings.batch_size > 1 or port.spec.batch
    if port.settings.order_by is not None and batched:
        if port.spec.is_async:
            return OrderedAsyncBatchPipeline(port, consumer)
        return OrderedBatchPipeline(port, consumer)
    if port.settings.order_by is not None:
        return OrderedPipeline(port, consumer)
    if batched and port.spec.is_async:
        return AsyncBatchPipeline(port, consumer)
    if batched:
        return BatchPipeline(port, consumer)
    if port.spec.is_async:
        return AsyncPipeline(port, consumer)
    return Pipeline(port, consumer)
