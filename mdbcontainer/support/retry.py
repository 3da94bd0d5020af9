"""The one retry policy for connections and outages (not message redelivery).

Every loop that waits for the broker or the database to come back (a
consumer reconnecting, a delivery held while the database is away, the
container waiting for its database at start, a one-shot connect within
``connect_timeout``) is a tenacity ``Retrying`` built here, so the backoff
is the same everywhere and a reader finds it in one place. Message
redelivery (``redelivery_delay``) is a different thing with its own settings
(see ``delays.py``): users of Spring confuse the two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tenacity
from tenacity.retry import retry_base

RetryCondition = retry_base  # what tenacity retries on (a predicate of exceptions or results)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff from ``initial`` seconds, capped at ``maximum``."""

    initial: float = 0.2
    maximum: float = 5.0

    def wait(self) -> tenacity.wait.wait_base:
        return tenacity.wait_exponential(multiplier=self.initial, max=self.maximum)

    def until_stopped(
        self,
        stop: threading.Event,
        *,
        retry: RetryCondition,
        before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
        give_up: Callable[[tenacity.RetryCallState], Any] | None = None,
    ) -> tenacity.Retrying:
        """Retry until it works or ``stop`` is set; the backoff's sleep wakes at once on ``stop``.

        ``give_up`` returns the value the loop ends with when stopped (the last
        outcome is re-raised without it).
        """
        def sleep(seconds: float) -> None:
            stop.wait(seconds)

        return tenacity.Retrying(
            retry=retry, wait=self.wait(), stop=tenacity.stop_when_event_set(stop), sleep=sleep,
            before_sleep=before_sleep, retry_error_callback=give_up, reraise=give_up is None,
        )

    def within(
        self, seconds: float, *, retry: RetryCondition, maximum: float | None = None
    ) -> tenacity.Retrying:
        """Retry until ``seconds`` have passed, then re-raise the last error (one-shot commands)."""
        cap = self.maximum if maximum is None else maximum
        return tenacity.Retrying(
            retry=retry, wait=tenacity.wait_exponential(multiplier=self.initial, max=cap),
            stop=tenacity.stop_after_delay(seconds), reraise=True,
        )


DEFAULT = RetryPolicy()
