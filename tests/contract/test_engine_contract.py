"""The engine contract: what the worker runtime relies on, run against the fake engine and
a real vLLM engine (the generated demo model), one parametrized suite.

Each engine starts once per module. Prompts are distinct per test, so one test's prefix
cache never serves another's.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from shared.demo.model import write_demo_model
from shared.protocol import SamplingOptions
from shared.settings import EngineKind, Settings
from workers.engines.base import GenerateEngine, StepOutput
from workers.engines.language import load_language_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass
class Run:
    steps: list[StepOutput]

    @property
    def tokens(self) -> list[int]:
        return [t for step in self.steps for t in step.token_ids]

    @property
    def last(self) -> StepOutput:
        return self.steps[-1]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("contract") / "demo")


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=["fake", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])],
)
async def engine(
    request: pytest.FixtureRequest, model_folder: Path
) -> AsyncIterator[GenerateEngine]:
    saved = dict(os.environ)  # vLLM's placement sets OMP_* and VLLM_* for its engine core
    settings = Settings(engine=EngineKind(request.param), dtype="float32", worker_max_slots=16)
    loaded = load_language_engine(settings, str(model_folder), "tiny")
    try:
        yield loaded
    finally:
        loaded.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def prompt(seed: int, length: int = 24) -> list[int]:
    """Ordinary token ids (above the demo model's special ones), distinct per seed."""
    return [10 + (seed * 131 + i * 17) % 3000 for i in range(length)]


async def run(engine: GenerateEngine, tokens: list[int], sampling: SamplingOptions) -> Run:
    steps = [s async for s in engine.generate(uuid.uuid4().hex, tokens, sampling)]
    return Run(steps)


async def test_streams_step_outputs(engine: GenerateEngine) -> None:
    result = await run(engine, prompt(1), GREEDY)
    assert all(step.finish_reason is None for step in result.steps[:-1])
    assert result.last.finish_reason == "length"
    assert all(step.prompt_tokens == 24 for step in result.steps)
    assert len(result.tokens) == 8
    assert all(isinstance(t, int) and t >= 0 for t in result.tokens)
    assert all(step.logprobs is None for step in result.steps)
    assert engine.info.model == "tiny" and engine.info.max_model_len > 0


@pytest.mark.parametrize("max_tokens", [1, 3, 17])
async def test_max_tokens_is_exact(engine: GenerateEngine, max_tokens: int) -> None:
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    result = await run(engine, prompt(2 + max_tokens), sampling)
    assert len(result.tokens) == max_tokens
    assert result.last.finish_reason == "length"


async def test_greedy_is_deterministic(engine: GenerateEngine) -> None:
    first = await run(engine, prompt(3), GREEDY)
    second = await run(engine, prompt(3), GREEDY)
    assert first.tokens == second.tokens


async def test_seeded_sampling_is_deterministic(engine: GenerateEngine) -> None:
    sampling = SamplingOptions(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    first = await run(engine, prompt(4), sampling)
    second = await run(engine, prompt(4), sampling)
    assert first.tokens == second.tokens


async def test_resumed_greedy_continues_as_uninterrupted(engine: GenerateEngine) -> None:
    """Migration: prompt + emitted tokens, run again, give the rest of the same output."""
    whole = await run(
        engine, prompt(5), SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    head = whole.tokens[:5]
    rest = await run(
        engine, prompt(5) + head, SamplingOptions(max_tokens=7, temperature=0.0, ignore_eos=True)
    )
    assert head + rest.tokens == whole.tokens


async def test_stop_token_id_ends_the_sequence(engine: GenerateEngine) -> None:
    free = await run(engine, prompt(6), GREEDY)
    stop = free.tokens[3]
    expected = free.tokens[: free.tokens.index(stop) + 1]
    stopped = await run(
        engine,
        prompt(6),
        SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
    )
    assert stopped.tokens == expected  # the stop token is the last one sent
    assert stopped.last.finish_reason == "stop"


async def test_concurrent_sequences_are_independent(engine: GenerateEngine) -> None:
    """`n` choices are separate sequences: each gets its own, complete stream."""
    alone = await run(engine, prompt(7), GREEDY)
    together = await asyncio.gather(*(run(engine, prompt(7), GREEDY) for _ in range(3)))
    assert [r.tokens for r in together] == [alone.tokens] * 3
    seeded = await asyncio.gather(
        *(
            run(engine, prompt(8), SamplingOptions(max_tokens=6, seed=s, ignore_eos=True))
            for s in range(3)
        )
    )
    assert all(len(r.tokens) == 6 and r.last.finish_reason == "length" for r in seeded)
    assert engine.running() == 0


async def test_abort_ends_a_running_sequence(engine: GenerateEngine) -> None:
    job_id = uuid.uuid4().hex
    sampling = SamplingOptions(max_tokens=1500, temperature=0.0, ignore_eos=True)
    steps: list[StepOutput] = []
    async for step in engine.generate(job_id, prompt(9), sampling):
        steps.append(step)
        if len(steps) == 2:
            assert engine.running() == 1
            await engine.abort(job_id)
    assert steps[-1].finish_reason == "abort"
    assert sum(len(s.token_ids) for s in steps) < 1500
    assert engine.running() == 0


async def test_cancelling_the_consumer_ends_the_sequence(engine: GenerateEngine) -> None:
    started = asyncio.Event()
    sampling = SamplingOptions(max_tokens=1500, temperature=0.0, ignore_eos=True)

    async def consume() -> None:
        async for _ in engine.generate(uuid.uuid4().hex, prompt(10), sampling):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.running() == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.running() == 0


@pytest.mark.parametrize("k", [0, 3])
async def test_logprobs_shape(engine: GenerateEngine, k: int) -> None:
    sampling = SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=k)
    result = await run(engine, prompt(11 + k), sampling)
    for step in result.steps:
        assert step.logprobs is not None
        assert [lp.token_id for lp in step.logprobs] == step.token_ids
        for lp in step.logprobs:
            assert lp.logprob <= 0.0
            assert len(lp.top) == k
            values = [top.logprob for top in lp.top]
            assert values == sorted(values, reverse=True)
            if k:
                assert lp.top[0].token_id == lp.token_id  # greedy: the sampled one is rank 1
                assert lp.top[0].logprob == pytest.approx(lp.logprob)


async def test_repeated_prompt_reports_cached_tokens(engine: GenerateEngine) -> None:
    """A prompt over two KV blocks (128 tokens on CPU vLLM), run twice: the second run
    is served from the prefix cache in whole blocks, never its last token."""
    long_prompt = prompt(12, length=300)
    sampling = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = await run(engine, long_prompt, sampling)
    second = await run(engine, long_prompt, sampling)
    assert first.last.cached_tokens == 0
    cached = second.last.cached_tokens
    assert cached is not None and 256 <= cached < 300
    assert second.tokens == first.tokens


async def test_health_and_counts(engine: GenerateEngine) -> None:
    await engine.check_health()
    assert engine.running() == 0
