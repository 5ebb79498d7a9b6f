"""The fake engine (``--engine fake``): vLLM's engine interface with no model behind it.

It serves a model folder like any other (the gateway reads its tokenizer and chat
template), but reads only ``config.json`` and the tokenizer: tokens come from
:mod:`.tokens`, time from the step model in :mod:`.scheduler`, prefix-cache hits and
KV events from :mod:`.kv_cache`. For load tests and fleet-size routing tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator

import msgspec

from shared.engine_stats import StatsRecorder
from shared.errors import EngineDead, EngineError, InvalidRequest
from shared.protocol import SamplingOptions, is_guided
from shared.queue import kv_events as wire
from shared.settings import Settings
from workers.engines.base import (
    EngineInfo,
    Handoff,
    KvEventFeed,
    NotSupported,
    PromptImages,
    PromptTokenStats,
    StepOutput,
)
from workers.engines.fake.events import KvEventBatch, KvEventPublisher, to_wire
from workers.engines.fake.kv_cache import KvCache
from workers.engines.fake.model_folder import ModelShape, read_model_folder
from workers.engines.fake.scheduler import Clock, Limits, Scheduler, StepTiming
from workers.engines.fake.sequence import Sequence
from workers.engines.fake.tokens import Vocabulary, fold, mix64

log = logging.getLogger(__name__)


def step_timing(settings: Settings) -> StepTiming:
    return StepTiming(
        base_s=settings.fake_step_base_ms / 1e3,
        per_seq_s=settings.fake_step_per_seq_us / 1e6,
        prefill_per_token_s=settings.fake_prefill_per_token_us / 1e6,
        speedup=settings.fake_speedup,
    )


class FakeEngine:
    def __init__(
        self, settings: Settings, model_path: str, served_name: str, *, clock: Clock | None = None
    ) -> None:
        self.shape: ModelShape = read_model_folder(model_path)
        tokenizer = self.shape.tokenizer
        spell = None if tokenizer is None else (lambda i: tokenizer.id_to_token(i) or "")
        self._vocab = Vocabulary(self.shape.producible_ids(), spell)
        self.events = KvEventPublisher()
        """KV events (:mod:`.events`): ``subscribe`` a callback or take a ``queue()``."""
        self.kv = KvCache(settings.fake_kv_blocks, settings.fake_block_tokens, self.events)
        self.timing = step_timing(settings)
        self.scheduler = Scheduler(
            self.kv,
            self.events,
            self.timing,
            Limits(settings.worker_max_slots, settings.fake_prefill_chunk_tokens),
            clock,
        )
        max_len = settings.max_model_len or self.shape.max_model_len
        self.info = EngineInfo(model=served_name, max_model_len=max_len)
        self.prompt_stats = PromptTokenStats()
        self.admin = FakeAdmin(self)
        self._sequences: dict[str, Sequence] = {}
        self._kv_events = settings.publishes_kv_events()
        log.info(
            "fake engine (no model) serving %s: for load and routing tests, its output is not "
            "a model's. %d KV blocks of %d tokens, step %.2f ms + %.0f us/sequence + %.0f "
            "us/prefill token, speed-up %gx",
            served_name,
            settings.fake_kv_blocks,
            settings.fake_block_tokens,
            settings.fake_step_base_ms,
            settings.fake_step_per_seq_us,
            settings.fake_prefill_per_token_us,
            settings.fake_speedup,
        )

    # ------------------------------------------------------------------ generate

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream one sequence (``handoff`` is ignored: a fake decode computes the prompt)."""
        self._check(prompt_token_ids, sampling, images)
        if job_id in self._sequences:
            raise EngineError(f"request id {job_id} is already running")
        seq = Sequence.new(
            job_id, prompt_token_ids, sampling, self._vocab, self.shape.tokenizer, adapter
        )
        self._sequences[job_id] = seq
        self.scheduler.add(seq)
        try:
            while True:
                step = await self._next_output(seq)
                yield step
                if step.finish_reason is not None:
                    self._count_prompt(seq)
                    return
        finally:
            self._sequences.pop(job_id, None)
            self.scheduler.finish(seq, None)  # a cancelled consumer: the sequence ends too

    async def _next_output(self, seq: Sequence) -> StepOutput:
        """What the sequence got since the last yield: several steps in one, if the
        consumer was slower than the engine (as vLLM merges them)."""
        output = await seq.outputs.get()
        while output.finish_reason is None and not seq.outputs.empty():
            output = merged(output, seq.outputs.get_nowait())
        return output

    def _check(
        self, prompt: list[int], sampling: SamplingOptions, images: PromptImages | None
    ) -> None:
        if images is not None:
            raise InvalidRequest("this model does not take images")
        if is_guided(sampling):
            raise InvalidRequest(
                "the fake engine does not do structured output (json_schema, json_object, "
                "regex, choice, grammar, structural_tag)"
            )
        if sampling.allowed_token_ids is not None:
            raise InvalidRequest("the fake engine does not do allowed_token_ids")
        if sampling.prompt_logprobs is not None:
            raise InvalidRequest(
                "the fake engine does not do prompt_logprobs (nor echo with logprobs)",
                param="prompt_logprobs",
            )
        if not prompt:
            raise InvalidRequest("the prompt cannot be empty")
        if len(prompt) > self.info.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens, more than the model's "
                f"{self.info.max_model_len}"
            )
        if self.kv.blocks_for(len(prompt) + 1) > self.kv.num_blocks:
            raise InvalidRequest("the prompt does not fit the fake engine's KV cache")

    def _count_prompt(self, seq: Sequence) -> None:
        cached = seq.cached_tokens or 0
        self.prompt_stats.from_local_cache += cached
        self.prompt_stats.computed += seq.prompt_len - cached

    # ------------------------------------------------------------------ prefill, embed

    def plan_handoff(self, job_id: str) -> Handoff | None:
        return None

    async def prefill(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> Handoff:
        """Compute the prompt (one token); the handoff only names it: a fake decode engine
        computes the prompt again."""
        one = msgspec.structs.replace(sampling, max_tokens=1, min_tokens=0)
        async for _ in self.generate(job_id, prompt_token_ids, one, images=images):
            pass
        return {"fake": True, "prompt_tokens": len(prompt_token_ids)}

    async def embed(
        self, job_id: str, prompt_token_ids: list[int], *, dimensions: int | None = None
    ) -> list[float]:
        """A unit vector of the model's hidden size, a function of the tokens only."""
        size = self.shape.hidden_size
        if dimensions is not None and not 0 < dimensions <= size:
            raise InvalidRequest(f"dimensions must be 1..{size}", param="dimensions")
        await self.scheduler.clock.sleep(self.timing.step_s(1, len(prompt_token_ids)))
        state = fold(0, prompt_token_ids)
        raw = [(mix64(state + i) / 2**63) - 1.0 for i in range(dimensions or size)]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]

    # ------------------------------------------------------------------ lifecycle

    async def abort(self, job_id: str) -> None:
        seq = self._sequences.get(job_id)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    async def check_health(self) -> None:
        failure = self.scheduler.failure()
        if failure is not None:
            raise EngineDead(f"the fake engine's step loop failed: {failure!r}")

    def running(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    @property
    def engine_stats(self) -> StatsRecorder:
        return self.scheduler.recorder

    def counts(self) -> tuple[int, int]:
        """(running, waiting) sequences, as vLLM's scheduler stats report them."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def shutdown(self) -> None:
        self.scheduler.stop()

    def kv_event_feed(self) -> KvEventFeed | None:
        if not self._kv_events:
            return None
        return KvEventFeed(self.kv.block_size, self._kv_event_batches)

    async def _kv_event_batches(self) -> AsyncIterator[list[wire.KvEvent]]:
        batches: asyncio.Queue[KvEventBatch] = asyncio.Queue()
        self.events.subscribe(batches.put_nowait)
        try:
            while True:
                batch = await batches.get()
                yield [to_wire(event) for event in batch.events]
        finally:
            self.events.unsubscribe(batches.put_nowait)


def merged(first: StepOutput, then: StepOutput) -> StepOutput:
    logprobs = None
    if first.logprobs is not None and then.logprobs is not None:
        logprobs = first.logprobs + then.logprobs
    return dataclasses.replace(
        then,
        token_ids=first.token_ids + then.token_ids,
        text=first.text + then.text,
        logprobs=logprobs,
    )


class FakeAdmin:
    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    async def clear_kv(self) -> bool:
        cleared = self._engine.kv.clear()
        self._engine.events.flush()
        return cleared

    async def sleep(self) -> None:
        raise NotSupported("the fake engine holds no memory to release")

    async def wake(self) -> None:
        raise NotSupported("the fake engine holds no memory to release")
