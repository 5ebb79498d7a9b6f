"""What cache-aware placement costs the gateway per request: naming the prompt's blocks,
the index lookup and scoring.

    python -m bench.placement_cost                     # 16 workers, 100k blocks of 16 tokens
    python -m bench.placement_cost --block-size 128    # vLLM's CPU block size

Fills a prefix index (gateway/placement/prefix_index.py) the way workers' KV events do,
with multi-turn conversations (a shared ~1k-token tenant prompt plus a history) stored on
random workers until ``--blocks`` distinct blocks are indexed, then places ``--requests``
prompts of 1-4k tokens on ``--workers`` workers with random load: 80 % continue an
indexed conversation (the lookup walks every cached block), 20 % are unrelated. Each
request runs what the dispatcher's ``_place`` runs: the placement request, the
candidates from the gateway's worker directory (gateway/dispatch/worker_directory.py),
and :meth:`CachePlacer.place` with the gateway's placement metrics. Prints the time of
the placer alone and of the whole (p50 / p99 / max, µs; wall and CPU) and the index's
memory (tracemalloc). The heap built before the requests is frozen out of garbage
collection, as the gateway's start-up heap is (shared/heap.py). No Redis, no network:
one process, one core.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import tracemalloc
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry

from gateway.dispatch.worker_directory import WorkerDirectory
from gateway.metrics.placement import PlacementMetrics
from gateway.placement.cache_placer import CachePlacer
from gateway.placement.placer import PlacementReason, PlacementRequest
from gateway.placement.prefix_index import PrefixIndex
from shared.block_hashes import block_names
from shared.engine_stats import EngineStats
from shared.heap import freeze_startup_heap
from shared.queue.kv_events import KvBatch, StoredBlocks
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role

MODEL = "bench"
VOCAB = 128_000
TENANTS = 8
TENANT_TOKENS = 1024
ENGINE_SEED = 12345
"""Stands in for an engine's own hash seed: engine hashes differ from the index's names."""


@dataclass(frozen=True, slots=True)
class Fleet:
    index: PrefixIndex
    conversations: list[list[int]]
    memory_bytes: int


POOL_TOKENS = 1 << 20


class Tokens:
    """Random token ids, drawn as slices of one pool at random offsets: distinct blocks
    without holding millions of int objects."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._pool = [rng.randrange(VOCAB) for _ in range(POOL_TOKENS)]

    def take(self, count: int) -> list[int]:
        start = self._rng.randrange(0, POOL_TOKENS - count)
        return self._pool[start : start + count]


def fill(args: argparse.Namespace, rng: random.Random, fresh: Tokens) -> Fleet:
    """Conversations stored on random workers, as their KV events say, until the index
    holds ``--blocks`` distinct blocks; memory counts only what the index allocated."""
    tenants = [fresh.take(TENANT_TOKENS) for _ in range(TENANTS)]
    workers = [f"worker-{i}" for i in range(args.workers)]
    seq = dict.fromkeys(workers, 0)
    conversations: list[list[int]] = []
    index = PrefixIndex(max_blocks=10 * args.blocks)
    tracemalloc.start()
    while index.blocks() < args.blocks:
        tokens = rng.choice(tenants) + fresh.take(rng.randrange(0, 3000))
        conversations.append(tokens)
        worker = rng.choice(workers)
        full = len(tokens) // args.block_size * args.block_size
        engine_hashes = block_names(tokens[:full], args.block_size, ENGINE_SEED)
        event = StoredBlocks(engine_hashes, None, tokens[:full])
        index.apply(KvBatch(worker, MODEL, args.block_size, seq[worker], [event]))
        seq[worker] += 1
    traced = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*prefix_index.py"), tracemalloc.Filter(True, "*block_hashes.py")]
    )
    tracemalloc.stop()
    memory = sum(stat.size for stat in traced.statistics("filename"))
    return Fleet(index, conversations, memory)


def prompts(
    args: argparse.Namespace, fleet: Fleet, rng: random.Random, fresh: Tokens
) -> list[list[int]]:
    found: list[list[int]] = []
    while len(found) < args.requests:
        length = rng.randrange(1024, 4097)
        if rng.random() < 0.8:
            base = rng.choice(fleet.conversations)[:length]
            prompt = base + fresh.take(max(0, length - len(base)) or rng.randrange(100, 300))
        else:
            prompt = fresh.take(length)
        found.append(prompt[:4096])
    return found


class Registry:
    """Stands in for the worker registry in Redis: the workers' reports of one moment."""

    def __init__(self, workers: list[WorkerRegistration]) -> None:
        self._workers = workers

    async def live_workers(self) -> list[WorkerRegistration]:
        return self._workers


def directory(args: argparse.Namespace, rng: random.Random) -> WorkerDirectory:
    """The gateway's view of ``--workers`` placeable workers with random loads."""
    reports = [
        WorkerRegistration(
            worker_id=f"worker-{i}",
            role=Role.AGGREGATED,
            model=MODEL,
            max_model_len=8192,
            active=0,
            slots=8,
            engine_running=rng.randrange(0, 16),
            waiting=rng.randrange(0, 2),
            engine_stats=EngineStats(kv_cache_usage=rng.random() * 0.8),
            queued_prefill_tokens=rng.randrange(0, 4096),
            reads_placed=True,
        )
        for i in range(args.workers)
    ]
    found = WorkerDirectory(cast(WorkerRegistry, Registry(reports)))
    asyncio.run(found.refresh())
    return found


def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    started = time.perf_counter()
    fresh = Tokens(rng)
    fleet = fill(args, rng, fresh)
    filled_s = time.perf_counter() - started
    metrics = PlacementMetrics(CollectorRegistry())
    placer = CachePlacer(fleet.index, rng=random.Random(args.seed), on_placed=metrics.observe)
    todo = prompts(args, fleet, rng, fresh)
    moments = [directory(args, rng) for _ in range(64)]
    freeze_startup_heap()
    wall = Times()
    cpu = Times()
    reasons: dict[PlacementReason, int] = {}
    matched = 0
    for number, prompt in enumerate(todo):
        workers = moments[number % len(moments)]
        # what the dispatcher's _place runs: the request, the candidates, the placer
        wall_0, cpu_0 = time.perf_counter_ns(), time.thread_time_ns()
        request = PlacementRequest(MODEL, Role.AGGREGATED, None, prompt, None)
        candidates = workers.candidates(MODEL, Role.AGGREGATED, None)
        wall_1, cpu_1 = time.perf_counter_ns(), time.thread_time_ns()
        placement = placer.place(request, candidates)
        wall.add(wall_0, wall_1, time.perf_counter_ns())
        cpu.add(cpu_0, cpu_1, time.thread_time_ns())
        reasons[placement.reason] = reasons.get(placement.reason, 0) + 1
        matched += placement.matched_blocks
    blocks = fleet.index.blocks()
    per_worker = sum(fleet.index.blocks_by_worker().values())
    print(
        f"index: {blocks} distinct blocks of {args.block_size} tokens on {args.workers} workers "
        f"({per_worker} worker-block pairs), filled in {filled_s:.1f}s, "
        f"{fleet.memory_bytes / 2**20:.1f} MiB ({fleet.memory_bytes / per_worker:.0f} B per pair)"
    )
    for clock, times in (("wall", wall), ("cpu", cpu)):
        for what, values in (
            ("placement", times.place),
            ("candidates + placement (the dispatcher's _place)", times.total),
        ):
            print(
                f"{what} ({clock} time) over {len(values)} requests of 1-4k tokens: "
                f"{summary(values)}"
            )
    shares = ", ".join(f"{reason.value} {count}" for reason, count in sorted(reasons.items()))
    print(f"decisions: {shares}; mean matched blocks {matched / len(todo):.1f}")


class Times:
    """Per request, in µs: the placer's own time, and that plus building the candidates."""

    def __init__(self) -> None:
        self.place: list[float] = []
        self.total: list[float] = []

    def add(self, start_ns: int, candidates_ns: int, end_ns: int) -> None:
        self.place.append((end_ns - candidates_ns) / 1000)
        self.total.append((end_ns - start_ns) / 1000)


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return (
        f"p50 {percentile(ordered, 50):.1f} us, p99 {percentile(ordered, 99):.1f} us, "
        f"mean {statistics.fmean(ordered):.1f} us, max {ordered[-1]:.1f} us"
    )


def percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=100_000, help="distinct blocks indexed")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
