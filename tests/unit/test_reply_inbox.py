"""A request's inbox: items in order, a wait that times out without a timer per wait,
a bounded size, and a writer that waits for room."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.dispatch.reply_inbox import ReplyInbox


async def test_items_come_out_in_order_and_a_waiting_reader_wakes() -> None:
    inbox: ReplyInbox[int] = ReplyInbox(8)
    inbox.put_nowait(1)
    assert (inbox.peek(), inbox.empty()) == (1, False)
    assert await inbox.get(5.0) == 1
    assert inbox.peek() is None
    reader = asyncio.create_task(inbox.get(5.0))
    await asyncio.sleep(0)
    inbox.put_nowait(2)
    inbox.put_nowait(3)
    assert await reader == 2
    assert inbox.get_nowait() == 3
    with pytest.raises(asyncio.QueueEmpty):
        inbox.get_nowait()
    inbox.close()


async def test_a_quiet_wait_times_out_after_its_own_timeout() -> None:
    inbox: ReplyInbox[int] = ReplyInbox(8)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await inbox.get(0.05)
    assert 0.04 <= time.monotonic() - started < 4.0


async def test_the_timer_of_an_earlier_wait_does_not_cut_a_later_one_short() -> None:
    inbox: ReplyInbox[int] = ReplyInbox(8)
    first = asyncio.create_task(inbox.get(0.1))
    await asyncio.sleep(0.06)
    inbox.put_nowait(1)
    assert await first == 1
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await inbox.get(0.1)  # the first wait's timer fires after 0.04 s: not the end
    assert time.monotonic() - started >= 0.09


async def test_a_cancelled_reader_leaves_no_timer_and_the_inbox_works_on() -> None:
    inbox: ReplyInbox[int] = ReplyInbox(8)
    reader = asyncio.create_task(inbox.get(10.0))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert inbox._timer is None
    inbox.put_nowait(4)
    assert await inbox.get(1.0) == 4


async def test_full_refuses_and_a_writer_waits_for_room() -> None:
    inbox: ReplyInbox[int] = ReplyInbox(2)
    inbox.put_nowait(1)
    inbox.put_nowait(2)
    with pytest.raises(asyncio.QueueFull):
        inbox.put_nowait(3)
    writer = asyncio.create_task(inbox.put(3))
    await asyncio.sleep(0.01)
    assert not writer.done()
    assert inbox.get_nowait() == 1
    await writer
    assert [await inbox.get(1.0), await inbox.get(1.0)] == [2, 3]
    inbox.put_nowait(5)
    inbox.put_nowait(6)
    late = asyncio.create_task(inbox.put(7))
    await asyncio.sleep(0)
    inbox.clear()  # an interrupted request: room again
    await late
    assert inbox.get_nowait() == 7


async def test_a_wait_without_a_timeout_outlasts_an_earlier_waits_timer() -> None:
    inbox: ReplyInbox[int] = ReplyInbox(8)
    first = asyncio.create_task(inbox.get(0.02))
    await asyncio.sleep(0)
    inbox.put_nowait(1)
    assert await first == 1
    untimed = asyncio.create_task(inbox.get())
    await asyncio.sleep(0.05)  # the first wait's timer has fired meanwhile
    assert not untimed.done()
    inbox.put_nowait(2)
    assert await untimed == 2
