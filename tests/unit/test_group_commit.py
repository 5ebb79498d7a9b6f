"""GroupCommit: a lone write goes at once; writes queued behind one in flight go together."""

from __future__ import annotations

import asyncio

import pytest

from gateway.dispatch.group_commit import GroupCommit, WriterCancelled


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.started = asyncio.Event()
        self.fail_with: Exception | None = None

    async def write_many(self, items: list[int]) -> None:
        self.batches.append(list(items))
        self.started.set()
        await self.release.wait()
        if self.fail_with is not None:
            raise self.fail_with


async def first_write_in_flight() -> tuple[Recorder, GroupCommit[int], asyncio.Task[None]]:
    """A commit whose first write (of 1) is on the wire until ``recorder.release`` is set."""
    recorder = Recorder()
    recorder.release.clear()
    commit = GroupCommit(recorder.write_many)
    first = asyncio.create_task(commit.write(1))
    await recorder.started.wait()
    return recorder, commit, first


async def test_a_lone_write_is_written_at_once_on_its_own() -> None:
    recorder = Recorder()
    commit = GroupCommit(recorder.write_many)
    await commit.write(1)
    await commit.write(2)
    assert recorder.batches == [[1], [2]]


async def test_writes_that_arrive_during_a_write_leave_together_in_the_next() -> None:
    recorder, commit, first = await first_write_in_flight()
    later = [asyncio.create_task(commit.write(n)) for n in (2, 3, 4)]
    await asyncio.sleep(0)
    assert not any(task.done() for task in [first, *later])
    recorder.release.set()
    await asyncio.gather(first, *later)
    assert recorder.batches == [[1], [2, 3, 4]]


async def test_each_writer_of_a_failed_batch_sees_the_error_and_the_next_batch_goes() -> None:
    recorder, commit, first = await first_write_in_flight()
    second, third = (asyncio.create_task(commit.write(n)) for n in (2, 3))
    await asyncio.sleep(0)
    recorder.fail_with = RuntimeError("redis down")
    recorder.release.set()
    results = await asyncio.gather(first, second, third, return_exceptions=True)
    assert [type(result) for result in results] == [RuntimeError] * 3
    recorder.fail_with = None
    await commit.write(4)
    assert recorder.batches == [[1], [2, 3], [4]]


async def test_a_cancelled_follower_does_not_cancel_the_batch_it_shares() -> None:
    recorder, commit, first = await first_write_in_flight()
    follower, other = (asyncio.create_task(commit.write(n)) for n in (2, 3))
    await asyncio.sleep(0)
    follower.cancel()
    recorder.release.set()
    await asyncio.gather(first, other)
    with pytest.raises(asyncio.CancelledError):
        await follower
    assert recorder.batches == [[1], [2, 3]]


async def test_a_cancelled_writer_fails_the_batches_it_carried_instead_of_stranding_them() -> None:
    recorder, commit, writer = await first_write_in_flight()
    queued = asyncio.create_task(commit.write(2))
    await asyncio.sleep(0)
    writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writer
    with pytest.raises(WriterCancelled):
        await queued
    recorder.release.set()
    await commit.write(3)  # a new writer takes over
    assert recorder.batches[-1] == [3]
