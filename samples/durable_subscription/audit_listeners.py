"""Two subscribers to the topic ``orders.events``: a durable one (audit) and a non-durable one."""

from __future__ import annotations

import logging

from mdbcontainer import Message, MessageContext, message_driven

log = logging.getLogger("audit_listeners")


@message_driven("AuditPort")
def audit(message: Message, ctx: MessageContext) -> None:
    """Must see every event, even those published while it was down."""
    log.warning("audit got event %s", message.body["event"])


@message_driven("DashboardPort")
def dashboard(message: Message, ctx: MessageContext) -> None:
    """Shows what happens now; what it missed while down does not matter."""
    log.warning("dashboard got event %s", message.body["event"])
