"""Sample: a bean with a lifecycle on a durable topic subscription, without a transaction."""

from __future__ import annotations

import logging

from mdbcontainer import Message, MessageContext, message_driven

log = logging.getLogger("listeners.audit")


@message_driven("AuditPort")
class AuditBean:
    """Logs every order event; one instance per consumer, replaced after it raises."""

    def setup(self) -> None:
        self.seen = 0

    def on_message(self, message: Message, ctx: MessageContext) -> None:
        self.seen += 1
        log.info("audit #%d: %s", self.seen, message.body)

    def teardown(self) -> None:
        log.debug("audit bean discarded after %d message(s)", self.seen)
