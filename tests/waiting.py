"""Waiting on a condition, never on a clock: tests poll what they expect to see."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``check`` until it is true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


def eventually_sync(
    check: Callable[[], bool], *, timeout_s: float = 5.0, what: str = "condition"
) -> None:
    """:func:`eventually` for code outside an event loop."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)
