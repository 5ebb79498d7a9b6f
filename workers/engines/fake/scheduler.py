"""The fake engine's step loop and its time model.

Each step, as vLLM's scheduler does it: running sequences first (one decode token each,
or the next chunk of a prompt), then waiting ones while there are free slots, KV blocks
and token budget (``prefill_chunk_tokens`` per step, shared). A sequence whose tokens
are all computed samples its next token at the end of the step. When a growing
sequence finds no free block, the last admitted sequence is preempted: its blocks go
back and it waits to be recomputed.

A step takes ``base + per_seq * sequences + prefill_per_token * prefill tokens``,
divided by the speed-up, on an injected :class:`Clock`. The step loop makes every
sequence's output (token, text, finish) itself, as vLLM's engine and output processor
do, and counts the CPU time that costs (``recorder.engine_cpu_s``), apart from the
consumers that take the outputs: a benchmark can then tell the worker runtime's CPU
from the engine's.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from shared.engine_stats import StatsRecorder
from workers.engines.base import StepOutput
from workers.engines.fake.events import KvEventPublisher
from workers.engines.fake.kv_cache import KvCache
from workers.engines.fake.sequence import Emitted, Sequence


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True, slots=True)
class StepTiming:
    base_s: float
    per_seq_s: float
    prefill_per_token_s: float
    speedup: float = 1.0

    def step_s(self, sequences: int, prefill_tokens: int) -> float:
        cost = self.base_s + self.per_seq_s * sequences + self.prefill_per_token_s * prefill_tokens
        return cost / self.speedup


@dataclass(frozen=True, slots=True)
class Limits:
    max_seqs: int
    chunk_tokens: int


@dataclass(slots=True)
class StepStats:
    steps: int = 0
    tokens_out: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    busy_s: float = 0.0


@dataclass(slots=True)
class Plan:
    batch: list[tuple[Sequence, int]] = field(default_factory=list)
    prefill_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        kv: KvCache,
        events: KvEventPublisher,
        timing: StepTiming,
        limits: Limits,
        clock: Clock | None = None,
    ) -> None:
        self.kv = kv
        self.events = events
        self.timing = timing
        self.limits = limits
        self.clock: Clock = clock or WallClock()
        self.stats = StepStats()
        self.recorder = StatsRecorder()
        """vLLM's scheduler figures, for the fleet metrics (shared/engine_stats.py)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ requests

    def add(self, seq: Sequence) -> None:
        seq.prefill_end = len(seq.token_ids)
        self.waiting.append(seq)
        self._record_state()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="fake-engine")

    def finish(self, seq: Sequence, reason: str | None) -> None:
        """End ``seq`` now (an abort: ``reason="abort"``; None: it ended on its own)."""
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq.table)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._record_state()
        if reason is not None:
            seq.outputs.put_nowait(seq.output(Emitted(None, None, reason)))

    def failure(self) -> BaseException | None:
        """Why the step loop stopped, if it did."""
        if self._task is None or not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self.step()

    async def step(self) -> None:
        """Plan one step, wait for its modelled time, apply it, then hand each sequence
        its output."""
        started = time.thread_time()
        plan = self.plan()
        duration = self.timing.step_s(len(plan.batch), plan.prefill_tokens)
        self.recorder.engine_cpu_s += time.thread_time() - started
        await self.clock.sleep(duration)
        started = time.thread_time()
        self.stats.steps += 1
        self.stats.busy_s += duration
        self.stats.prefill_tokens += plan.prefill_tokens
        outputs = self.apply(plan)
        self.events.flush()
        self.recorder.step(sum(tokens for _, tokens in plan.batch))
        self._record_state()
        self.recorder.engine_cpu_s += time.thread_time() - started
        for seq, output in outputs:
            seq.outputs.put_nowait(output)

    def _record_state(self) -> None:
        self.recorder.scheduler(
            running=len(self.running), waiting=len(self.waiting), kv_cache_usage=self.kv.usage()
        )

    def plan(self) -> Plan:
        plan = Plan()
        budget = self.limits.chunk_tokens
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq not in self.running:  # preempted for an earlier one in this step
                continue
            tokens = min(seq.to_compute(), budget)
            if not self._make_room(seq, seq.computed + tokens):
                continue
            self._schedule(plan, seq, tokens)
            budget -= tokens
        while budget > 0 and self.waiting and len(self.running) < self.limits.max_seqs:
            seq = self.waiting[0]
            cached = self.kv.start(seq.table, seq.token_ids)
            if cached is None:
                break
            self.waiting.popleft()
            self.recorder.prefix_lookup(len(seq.token_ids), cached)
            seq.computed = cached
            if seq.cached_tokens is None:
                seq.cached_tokens = cached
            self.running.append(seq)
            tokens = min(seq.to_compute(), budget)
            self._schedule(plan, seq, tokens)
            budget -= tokens
        return plan

    def apply(self, plan: Plan) -> list[tuple[Sequence, StepOutput]]:
        """Compute the planned tokens; the outputs of the sequences that sampled one."""
        outputs = []
        for seq, tokens in plan.batch:
            if seq.finished or seq not in self.running:
                continue
            seq.computed += tokens
            self.kv.commit(seq.table, seq.token_ids, seq.computed)
            if seq.computed < len(seq.token_ids):
                continue  # a prompt chunk: the prompt is not done
            output = seq.output(seq.sample())
            self.stats.tokens_out += 1
            outputs.append((seq, output))
            if output.finish_reason is not None:
                self.finish(seq, None)
        return outputs

    # ------------------------------------------------------------------ internals

    def _schedule(self, plan: Plan, seq: Sequence, tokens: int) -> None:
        plan.batch.append((seq, tokens))
        plan.prefill_tokens += seq.prefill_tokens(tokens)

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        """KV room for ``tokens`` of ``seq``, preempting the last admitted sequences
        (``seq`` itself when it is the last); alone, ``seq`` ends: its length does not fit
        the KV cache."""
        while not self.kv.grow(seq.table, tokens):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self.finish(seq, "length")
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq.table)
        seq.computed = 0
        seq.prefill_end = len(seq.token_ids)
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        self.recorder.preemptions += 1
