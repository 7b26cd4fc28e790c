"""An ``AsyncSpecDecClient.stream`` that its caller stops reading early — the async generator
closed (``aclose``), or an exception raised in the consumer's ``async for`` body — must cancel
the request on the server, as the blocking client does, even while the client itself stays
open (a long-lived client in a web service). Break test (session 4): the request kept
generating and held its KV rows on the target and its drafter context until the client's
channel closed or max_tokens was reached.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from sessions import live
from specdec_client import AsyncSpecDecClient

# remove with the fix (AsyncSpecDecClient.stream: cancel its call in a finally)

LONG = dict(prompt="Tell me a long story about dragons.", max_tokens=400, ignore_eos=True, mode="chain")


async def _freed(stack, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while live(stack) != (0, 0, 0):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def test_async_stream_closed_early_cancels_the_request(stack):
    async def main():
        async with AsyncSpecDecClient(stack.address, timeout=300) as c:
            gen = c.stream(**LONG)
            await gen.__anext__()  # the first chunk arrived: the request is live on both workers
            await gen.aclose()
            assert await _freed(stack, 10), f"the abandoned stream still runs on the workers: {live(stack)}"

    asyncio.run(main())


def test_async_stream_left_by_an_exception_cancels_the_request(stack):
    async def main():
        async with AsyncSpecDecClient(stack.address, timeout=300) as c:
            try:
                async for _ in c.stream(**LONG):
                    raise ValueError("the consumer failed")
            except ValueError:
                pass
            assert await _freed(stack, 10), f"the abandoned stream still runs on the workers: {live(stack)}"

    asyncio.run(main())
