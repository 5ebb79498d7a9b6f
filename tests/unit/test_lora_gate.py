"""The adapter gate: at most max_active distinct adapters run at once, first come first
served, base sequences never wait, closed adapters refuse new sequences."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.waiting import eventually
from workers.engines.lora.gate import LoraClosed, LoraGate


class Holders:
    """Sequences holding the gate until released, each in its own task."""

    def __init__(self, gate: LoraGate) -> None:
        self.gate = gate
        self.entered: list[str] = []
        self._release: dict[int, asyncio.Event] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str | None) -> int:
        number = len(self.tasks)
        release = self._release[number] = asyncio.Event()

        async def run() -> None:
            async with self.gate.hold(name):
                self.entered.append(f"{name}#{number}")
                await release.wait()

        self.tasks.append(asyncio.create_task(run()))
        return number

    def release(self, number: int) -> None:
        self._release[number].set()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_third_adapter_waits_for_a_free_slot() -> None:
    gate = LoraGate(2)
    h = Holders(gate)
    a, _, _ = h.start("a"), h.start("b"), h.start("a")
    c = h.start("c")
    await settle()
    assert h.entered == ["a#0", "b#1", "a#2"]
    assert gate.active() == {"a", "b"} and gate.waiting() == 1
    h.release(a)
    await settle()
    assert "c#3" not in h.entered  # a still runs (#2)
    h.release(2)
    await eventually(lambda: _true("c#3" in h.entered), what="c to enter")
    assert gate.active() == {"b", "c"}
    h.release(1)
    h.release(c)
    await asyncio.gather(*h.tasks)
    assert gate.active() == set()


async def _true(value: bool) -> bool:
    return value


async def test_waiting_is_first_come_first_served() -> None:
    """A running adapter's new sequence queues behind one waiting for a slot."""
    gate = LoraGate(1)
    h = Holders(gate)
    first = h.start("a")
    h.start("b")
    h.start("a")  # a runs, but b waits first
    await settle()
    assert h.entered == ["a#0"]
    h.release(first)
    await eventually(lambda: _true(h.entered[1:] == ["b#1"]), what="b next")
    h.release(1)
    await eventually(lambda: _true(h.entered[2:] == ["a#2"]), what="then a")
    h.release(2)
    await asyncio.gather(*h.tasks)


async def test_base_sequences_never_wait() -> None:
    gate = LoraGate(1)
    h = Holders(gate)
    h.start("a")
    h.start("b")
    h.start(None)
    await settle()
    assert h.entered == ["a#0", "None#2"]
    for task in h.tasks:
        task.cancel()
    await asyncio.gather(*h.tasks, return_exceptions=True)
    assert gate.active() == set() and gate.waiting() == 0


async def test_a_closed_adapter_refuses_new_and_waiting_sequences_and_idles() -> None:
    gate = LoraGate(1)
    h = Holders(gate)
    running = h.start("a")
    waiting = h.start("b")
    await settle()
    gate.close("b")
    with pytest.raises(LoraClosed):
        await h.tasks[waiting]
    gate.close("a")
    with pytest.raises(LoraClosed):
        async with gate.hold("a"):
            pass
    idle = asyncio.create_task(gate.idle("a"))
    await settle()
    assert not idle.done()  # its running sequence finishes first
    h.release(running)
    await asyncio.wait_for(idle, 1)
    gate.reopen("a")
    async with gate.hold("a"):
        assert gate.in_flight("a") == 1


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    gate = LoraGate(1)
    h = Holders(gate)
    h.start("a")
    h.start("b")
    await settle()
    h.tasks[1].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await h.tasks[1]
    assert gate.waiting() == 0
    h.release(0)
    await h.tasks[0]
    async with gate.hold("c"):
        assert gate.active() == {"c"}


async def test_many_sequences_never_exceed_the_limit() -> None:
    gate = LoraGate(3)
    peak = 0

    async def sequence(name: str) -> None:
        nonlocal peak
        async with gate.hold(name):
            peak = max(peak, len(gate.active()))
            await asyncio.sleep(0.001 * (hash(name) % 3))

    await asyncio.gather(*(sequence(f"ad{i % 7}") for i in range(200)))
    assert peak == 3 and gate.active() == set() and gate.waiting() == 0
