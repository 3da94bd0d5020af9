"""An idle consumer on SQS long-polls (wire/sqs.py ``LONG_POLL_FROM``): SQS bills each request.

With short polls a consumer with nothing to read asked SQS some twenty times
a second; a long poll of a second answers as soon as a message arrives, so
a message sent to an idle port is still handled at once.
"""

from __future__ import annotations

import time
from typing import Any

import botocore.client
import pytest

from mdbcontainer.testing import wait_for
from tests.conftest import Backend
from tests.inprocess import attempts, running_on


def test_an_idle_consumer_asks_sqs_about_once_a_second_and_still_gets_a_message_at_once(
        sqs: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    receives: list[float] = []
    original = botocore.client.BaseClient._make_api_call

    def counted(self: Any, operation: str, params: dict[str, Any]) -> Any:
        if operation == "ReceiveMessage":
            receives.append(time.monotonic())
        return original(self, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", counted)
    with running_on(sqs, transaction="none") as run:
        time.sleep(0.5)  # past the start's first reads
        began, before = time.monotonic(), len(receives)
        time.sleep(3.0)
        idle = (len(receives) - before) / (time.monotonic() - began)
        with sqs.producer(run.settings) as producer:
            sent = time.monotonic()
            producer.send(run.queue, {"n": 1}, message_id="idle-1")
        wait_for(lambda: attempts("idle-1") == [0], what="the message handled")
        took = time.monotonic() - sent
    assert idle <= 2.0, f"{idle:.1f} receives a second from one idle consumer"
    assert took < 1.0, f"a message to an idle port took {took:.2f}s"
