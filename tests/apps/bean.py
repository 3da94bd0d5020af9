"""Port ``Bean``: a bean-managed-transaction bean (``transaction = "bean"``)."""

from mdbcontainer import Message, MessageContext, message_driven

from .common import perform


@message_driven("Bean", transaction="bean")
class WorkBean:
    def setup(self) -> None:
        self.calls = 0

    def on_message(self, message: Message, ctx: MessageContext) -> None:
        self.calls += 1
        with ctx.transaction() as session:
            perform("Bean", message, ctx, session)
