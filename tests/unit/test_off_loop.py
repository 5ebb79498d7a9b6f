"""A short prompt is tokenized on the event loop, a long one on a thread."""

from __future__ import annotations

import asyncio
import threading

from gateway.serving.off_loop import INLINE_CHARS, tokenizing


def test_short_prompts_stay_on_the_loop_and_long_ones_go_to_a_thread() -> None:
    async def where(chars: int) -> int:
        return await tokenizing(chars, threading.get_ident)

    async def both() -> tuple[int, int, int]:
        loop_thread = threading.get_ident()
        return loop_thread, await where(INLINE_CHARS), await where(INLINE_CHARS + 1)

    loop_thread, short, long = asyncio.run(both())
    assert short == loop_thread
    assert long != loop_thread
