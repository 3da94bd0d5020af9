"""Port ``Poison``: a container-managed port fed by its own queue, for poison messages.

The crash matrix keeps its poison message on a queue of its own: with
``backout_threshold = 1`` on the work queue, every good message a killed
process had prefetched would count one failed delivery and be backed out too.
"""

from mdbcontainer import Message, MessageContext, message_driven

from .common import perform


@message_driven("Poison", transaction="container", max_retries=1)
def poison(message: Message, ctx: MessageContext) -> None:
    perform("Poison", message, ctx, ctx.session)
