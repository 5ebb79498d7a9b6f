"""shared.tasks.cancel_and_wait: cancel until done, within a time limit."""

from __future__ import annotations

import asyncio
import contextlib
import time

from shared.tasks import cancel_and_wait


async def test_a_task_that_swallows_a_cancel_is_cancelled_again() -> None:
    swallowed = 0

    async def swallow_one_cancel() -> None:
        nonlocal swallowed
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            swallowed += 1  # as asyncio.wait_for does on Python 3.11 in a narrow window
        await asyncio.sleep(10)

    stubborn = asyncio.create_task(swallow_one_cancel())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([stubborn]), 3.0)
    assert stubborn.cancelled()
    assert swallowed == 1


async def test_done_tasks_and_no_tasks_return_at_once() -> None:
    finished = asyncio.create_task(asyncio.sleep(0, result="ok"))
    await finished
    started = time.monotonic()
    await cancel_and_wait([finished])
    await cancel_and_wait([])
    assert time.monotonic() - started < 5  # not the 10 s give-up
    assert finished.result() == "ok"


async def test_many_tasks_are_stopped_together() -> None:
    tasks = [asyncio.create_task(asyncio.sleep(10)) for _ in range(50)]
    await asyncio.sleep(0)
    started = time.monotonic()
    await cancel_and_wait(tasks)
    assert all(task.cancelled() for task in tasks)
    assert time.monotonic() - started < 5  # not the tasks' 10 s sleep


async def test_gives_up_after_the_timeout_without_raising() -> None:
    release = asyncio.Event()

    async def never_stops() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)

    immortal = asyncio.create_task(never_stops())
    await asyncio.sleep(0)  # inside its loop (a task cancelled before it starts just ends)
    started = time.monotonic()
    await cancel_and_wait([immortal], timeout_s=0.3)
    assert 0.25 < time.monotonic() - started < 5.0
    assert not immortal.done()
    release.set()
    immortal.cancel()
    await immortal
