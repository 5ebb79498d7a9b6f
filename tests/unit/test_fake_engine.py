"""The fake engine's parts: the KV cache (hash chain, prefix hits, LRU eviction, events)
and the step-time model on a fake clock (no wall time)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgspec
import pytest

from shared.protocol import SamplingOptions
from shared.settings import EngineKind, Settings
from workers.engines.fake.engine import FakeEngine
from workers.engines.fake.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventPublisher,
)
from workers.engines.fake.kv_cache import BlockTable, KvCache, block_hash
from workers.engines.fake.scheduler import StepTiming
from workers.engines.fake.tokens import TokenPicker, Vocabulary

BS = 4


def cache(blocks: int = 8) -> tuple[KvCache, list[KvEventBatch]]:
    events = KvEventPublisher()
    batches: list[KvEventBatch] = []
    events.subscribe(batches.append)
    return KvCache(blocks, BS, events), batches


def run_prompt(kv: KvCache, tokens: list[int]) -> tuple[BlockTable, int]:
    table = BlockTable()
    cached = kv.start(table, tokens)
    assert cached is not None
    kv.commit(table, tokens, len(tokens))
    return table, cached


def flat(batches: list[KvEventBatch]) -> list[object]:
    return [event for batch in batches for event in batch.events]


# ------------------------------------------------------------------ KV cache


def test_block_hash_is_chained_and_stable() -> None:
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4])  # no per-process salt
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4], "adapter") != a
    assert -(2**63) <= a < 2**63


def test_prefix_hits_in_whole_blocks_never_the_last_token() -> None:
    kv, batches = cache()
    tokens = list(range(10))  # two full blocks + 2
    table, cached = run_prompt(kv, tokens)
    assert cached == 0
    kv._events.flush()
    stored = flat(batches)
    h1 = block_hash(None, tokens[:4])
    h2 = block_hash(h1, tokens[4:8])
    assert stored == [BlockStored([h1, h2], None, tokens[:8], BS)]
    kv.release(table)
    assert run_prompt(kv, tokens)[1] == 8
    assert run_prompt(kv, tokens[:8])[1] == 4  # the last token is always computed
    assert run_prompt(kv, [*tokens[:4], 99, 98, 97, 96, 95])[1] == 4


def test_lru_evicts_only_free_blocks_tail_first() -> None:
    kv, batches = cache(blocks=5)
    held, _ = run_prompt(kv, [1, 1, 1, 1, 2, 2, 2, 2, 0])  # 3 blocks, 2 cached; held
    old, _ = run_prompt(kv, [7, 7, 7, 7, 0])  # 2 blocks (1 cached)
    kv.release(old)
    kv._events.flush()
    batches.clear()
    # 1 free block without a hash + 1 cached free block: taking 2 evicts the cached one
    newer = BlockTable()
    assert kv.start(newer, [5, 5, 5, 5, 6]) == 0
    kv._events.flush()
    assert flat(batches) == [BlockRemoved([block_hash(None, [7, 7, 7, 7])])]
    assert kv.free_blocks() == 0
    assert kv.start(BlockTable(), [8, 8]) is None  # held blocks are never evicted
    assert held.blocks[0].hash == block_hash(None, [1, 1, 1, 1])


def test_events_come_in_batches_with_increasing_sequence_numbers() -> None:
    kv, batches = cache()
    for first in (1, 2, 3):
        table, _ = run_prompt(kv, [first] * 5)
        kv.release(table)
        kv._events.flush()
    assert [b.seq for b in batches] == [0, 1, 2]
    assert kv._events.flush() is None  # nothing pending: no empty batch


def test_clear_refuses_while_blocks_are_held() -> None:
    kv, batches = cache()
    table, _ = run_prompt(kv, [1] * 9)
    assert not kv.clear()
    kv.release(table)
    assert kv.clear()
    kv._events.flush()
    assert isinstance(flat(batches)[-1], AllBlocksCleared)
    assert kv.cached_blocks() == 0
    assert run_prompt(kv, [1] * 9)[1] == 0


# ------------------------------------------------------------------ tokens


def test_greedy_tokens_depend_on_the_context_only() -> None:
    vocab = Vocabulary(list(range(10, 100)))
    first = TokenPicker(vocab, [1, 2, 3], 0.0, None)
    emitted = []
    for _ in range(5):
        token = first.next_token()
        first.push(token)
        emitted.append(token)
    resumed = TokenPicker(vocab, [1, 2, 3, *emitted[:2]], 0.0, None)
    assert resumed.next_token() == emitted[2]
    assert all(10 <= t < 100 for t in emitted)


# ------------------------------------------------------------------ time model


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds
        self.sleeps.append(seconds)
        await asyncio.sleep(0)


def engine(model: Path, clock: FakeClock, **settings: object) -> FakeEngine:
    values: dict[str, object] = {
        "engine": EngineKind.FAKE,
        "fake_step_base_ms": 10.0,
        "fake_step_per_seq_us": 1000.0,
        "fake_prefill_per_token_us": 100.0,
        "fake_block_tokens": 16,
        "fake_prefill_chunk_tokens": 64,
        **settings,
    }
    return FakeEngine(Settings(**values), str(model), "tiny", clock=clock)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fake-model")
    (folder / "config.json").write_text(
        '{"vocab_size": 512, "max_position_embeddings": 1024, "eos_token_id": 2}'
    )
    return folder


async def generate(fake: FakeEngine, prompt: list[int], max_tokens: int) -> list[int]:
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0)
    return [t async for s in fake.generate(uuid.uuid4().hex, prompt, sampling) for t in s.token_ids]


def test_step_time_model() -> None:
    timing = StepTiming(base_s=0.01, per_seq_s=0.001, prefill_per_token_s=0.0001, speedup=2)
    assert timing.step_s(4, 100) == pytest.approx((0.01 + 0.004 + 0.01) / 2)


async def test_prefill_is_chunked_and_decode_costs_per_step(model: Path) -> None:
    clock = FakeClock()
    fake = engine(model, clock)
    tokens = await generate(fake, list(range(100, 200)), 3)  # 100 prompt tokens, chunk 64
    assert len(tokens) == 3 and 2 not in tokens
    assert clock.sleeps == pytest.approx(
        [0.010 + 0.001 + 64e-4, 0.010 + 0.001 + 36e-4, 0.011, 0.011]
    )
    fake.shutdown()


async def test_cached_prompt_tokens_cost_nothing(model: Path) -> None:
    clock = FakeClock()
    fake = engine(model, clock)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks (32) cached next time
    await generate(fake, prompt, 1)
    clock.sleeps.clear()
    await generate(fake, prompt, 1)
    assert clock.sleeps == pytest.approx([0.010 + 0.001 + 8e-4])
    fake.shutdown()


async def test_speedup_divides_step_time(model: Path) -> None:
    clock = FakeClock()
    fake = engine(model, clock, fake_speedup=10.0)
    await generate(fake, [5, 6, 7], 2)
    assert clock.sleeps == pytest.approx([(0.010 + 0.001 + 3e-4) / 10, 0.011 / 10])
    fake.shutdown()


async def test_batch_shares_steps_and_counts_running_and_waiting(model: Path) -> None:
    clock = FakeClock()
    fake = engine(model, clock, worker_max_slots=2)
    runs = [asyncio.create_task(generate(fake, [i, i + 1], 4)) for i in range(10, 13)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert fake.counts() == (2, 1)  # two slots: the third waits
    results = await asyncio.gather(*runs)
    assert [len(r) for r in results] == [4, 4, 4]
    assert fake.counts() == (0, 0) and fake.running() == 0
    assert fake.scheduler.stats.steps == 8  # 4 steps for two together, 4 for the third
    fake.shutdown()


async def test_preempts_the_last_sequence_when_kv_runs_out(model: Path) -> None:
    clock = FakeClock()
    fake = engine(model, clock, fake_kv_blocks=3, fake_block_tokens=4)
    alone = await generate(fake, [1, 2, 3], 6)
    both = await asyncio.gather(generate(fake, [1, 2, 3], 6), generate(fake, [9, 8, 7], 6))
    assert both[0] == alone and len(both[1]) == 6
    assert fake.scheduler.stats.preemptions >= 1
    fake.shutdown()


async def test_step_loop_counts_its_own_cpu_time_in_the_published_figures(
    model: Path,
) -> None:
    fake = engine(model, FakeClock())
    assert fake.engine_stats.snapshot().engine_cpu_s == 0.0
    await generate(fake, list(range(100, 160)), 8)
    spent = fake.engine_stats.engine_cpu_s
    assert spent > 0.0
    assert fake.engine_stats.snapshot().engine_cpu_s == pytest.approx(spent, abs=1e-6)
    fake.shutdown()


async def test_a_slow_consumer_gets_the_steps_it_missed_in_one_output(model: Path) -> None:
    fake = engine(model, FakeClock(), fake_step_per_seq_us=0.0)
    sampling = SamplingOptions(max_tokens=6, temperature=0.0, logprobs=1)
    alone = [s async for s in fake.generate("a", [7, 8, 9], sampling)]
    outputs = []
    async for step in fake.generate("b", [7, 8, 9], sampling):
        outputs.append(step)
        for _ in range(5):  # the engine runs several steps meanwhile
            await asyncio.sleep(0)
    assert len(outputs) < len(alone)
    assert [t for s in outputs for t in s.token_ids] == [t for s in alone for t in s.token_ids]
    assert sum(len(s.logprobs or []) for s in outputs) == 6
    assert outputs[-1].finish_reason == "length"
    fake.shutdown()


async def test_a_stop_string_ends_the_sequence_in_its_step(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{chr(ord("a") + i): i + 1 for i in range(26)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(
        '{"vocab_size": 27, "max_position_embeddings": 1024, "eos_token_id": 0}'
    )
    fake = engine(tmp_path, FakeClock())
    greedy = SamplingOptions(max_tokens=12, temperature=0.0)
    free = [s async for s in fake.generate("free", [1, 2], greedy)]
    text = "".join(s.text for s in free)
    stop = text.split()[2]  # one letter: no text held back for a partial match
    sampling = msgspec.structs.replace(greedy, stop=(stop,))
    stopped = []
    async for step in fake.generate("stopped", [1, 2], sampling):
        stopped.append(step)
        if step.finish_reason is not None:
            assert fake.counts() == (0, 0)  # the step that found it ended the sequence
    assert "".join(s.text for s in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == "stop"
    fake.shutdown()


async def test_embeddings_are_deterministic_unit_vectors(model: Path) -> None:
    fake = engine(model, FakeClock())
    vector = await fake.embed("e1", [1, 2, 3])
    assert vector == await fake.embed("e2", [1, 2, 3])
    assert len(vector) == 384 and sum(x * x for x in vector) == pytest.approx(1.0)
    assert len(await fake.embed("e3", [1, 2, 3], dimensions=8)) == 8
