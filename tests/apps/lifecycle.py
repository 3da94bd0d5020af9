"""Port ``Lifecycle``: a bean that records setup, deliveries and teardown per instance."""

from __future__ import annotations

import os
import threading

from mdbcontainer import Message, MessageContext, message_driven

_serial = iter(range(1, 1_000_000))
_lock = threading.Lock()


def record(event: str) -> None:
    path = os.environ["MDB_TEST_LOG"] + ".lifecycle"
    with _lock, open(path, "a") as out:
        out.write(event + "\n")


@message_driven("Lifecycle", transaction="none", max_retries=5)
class LifecycleBean:
    def setup(self) -> None:
        with _lock:
            self.serial = next(_serial)
        record(f"setup {self.serial}")

    def on_message(self, message: Message, ctx: MessageContext) -> None:
        record(f"message {self.serial} {message.id}")
        if isinstance(message.body, dict) and message.body.get("action") == "fail":
            raise RuntimeError("bean failure")

    def teardown(self) -> None:
        record(f"teardown {self.serial}")
