"""Stopping asyncio tasks reliably."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], *, timeout_s: float = 10) -> None:
    """Cancel until every task is done.

    On Python 3.11 a single cancel can be swallowed by ``asyncio.wait_for``
    inside redis-py (a cancel landing just as a socket write completes), which
    would leave a loop running and hang shutdown; so keep cancelling.
    """
    pending = {task for task in tasks if not task.done()}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while pending and asyncio.get_running_loop().time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.2)
