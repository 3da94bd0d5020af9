"""One delivery's way through the pipeline: what its steps share, carried from step to step.

A pipeline serves many deliveries: one after another on a consumer thread,
side by side as tasks on an async port's event loop, gathered into a batch.
What belongs to one delivery (when it started, for its log lines; its trace
span; its handler argument once decoded) lives in its :class:`Attempt`, never
on the pipeline, so no step reads another delivery's state and no task has
to set it back before a shared step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..support.tracing import NOTHING, Active
from ..wire.delivery import Delivery


@dataclass(slots=True)
class Attempt:
    """A delivery on its way through steps 1-8 (``pipeline/single.py``)."""

    delivery: Delivery
    started: float  # monotonic clock: the durations of its log lines count from here
    span: Active = NOTHING  # its trace span (a batch's span stands for its members)
    argument: Any = None  # the handler's first argument, once step 6 decoded it
