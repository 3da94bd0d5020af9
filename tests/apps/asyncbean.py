"""Port ``AsyncBean``: an async bean with bean-managed transactions (``async with ctx.transaction()``)."""

import asyncio

from mdbcontainer import Message, MessageContext, message_driven

from .common import perform_async


@message_driven("AsyncBean", transaction="bean")
class AsyncWorkBean:
    async def setup(self) -> None:
        await asyncio.sleep(0)
        self.calls = 0

    async def on_message(self, message: Message, ctx: MessageContext) -> None:
        self.calls += 1
        async with ctx.transaction() as session:
            await perform_async("AsyncBean", message, ctx, session)

    async def teardown(self) -> None:
        await asyncio.sleep(0)
