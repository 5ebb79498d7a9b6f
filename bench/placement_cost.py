"""What cache-aware placement costs the gateway per request: index lookup and scoring.

    python -m bench.placement_cost                     # 16 workers, 100k blocks of 16 tokens
    python -m bench.placement_cost --block-size 128    # vLLM's CPU block size

Fills a prefix index (gateway/placement/prefix_index.py) the way workers' KV events do,
with multi-turn conversations (a shared ~1k-token tenant prompt plus a history) stored on
random workers until ``--blocks`` distinct blocks are indexed, then places ``--requests``
prompts of 1-4k tokens on ``--workers`` candidates with random load: 80 % continue an
indexed conversation (the lookup walks every cached block), 20 % are unrelated. Prints
the time of each :meth:`CachePlacer.place` (p50 / p99 / max, µs) and the index's memory
(tracemalloc). No Redis, no network: one process, one core.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from dataclasses import dataclass

from gateway.placement.cache_placer import CachePlacer
from gateway.placement.placer import Candidate, PlacementReason, PlacementRequest
from gateway.placement.prefix_index import PrefixIndex
from shared.block_hashes import block_names
from shared.queue.kv_events import KvBatch, StoredBlocks
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


def candidates(args: argparse.Namespace, rng: random.Random) -> list[Candidate]:
    return [
        Candidate(
            f"worker-{i}",
            rng.randrange(0, 16),
            rng.randrange(0, 2),
            8,
            rng.random() * 0.8,
            rng.randrange(0, 4096),
        )
        for i in range(args.workers)
    ]


def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    started = time.perf_counter()
    fresh = Tokens(rng)
    fleet = fill(args, rng, fresh)
    filled_s = time.perf_counter() - started
    placer = CachePlacer(fleet.index, rng=random.Random(args.seed))
    todo = prompts(args, fleet, rng, fresh)
    fleets = [candidates(args, rng) for _ in range(64)]
    times_us: list[float] = []
    cpu_us: list[float] = []
    reasons: dict[PlacementReason, int] = {}
    matched = 0
    for number, prompt in enumerate(todo):
        request = PlacementRequest(MODEL, Role.AGGREGATED, None, prompt)
        now, cpu = time.perf_counter_ns(), time.thread_time_ns()
        placement = placer.place(request, fleets[number % len(fleets)])
        cpu_us.append((time.thread_time_ns() - cpu) / 1000)
        times_us.append((time.perf_counter_ns() - now) / 1000)
        reasons[placement.reason] = reasons.get(placement.reason, 0) + 1
        matched += placement.matched_blocks
    times_us.sort()
    cpu_us.sort()
    blocks = fleet.index.blocks()
    per_worker = sum(fleet.index.blocks_by_worker().values())
    print(
        f"index: {blocks} distinct blocks of {args.block_size} tokens on {args.workers} workers "
        f"({per_worker} worker-block pairs), filled in {filled_s:.1f}s, "
        f"{fleet.memory_bytes / 2**20:.1f} MiB ({fleet.memory_bytes / per_worker:.0f} B per pair)"
    )
    for name, values in (("wall", times_us), ("cpu", cpu_us)):
        print(
            f"placement cost ({name} time) over {len(values)} requests of 1-4k tokens: "
            f"p50 {percentile(values, 50):.1f} us, p99 {percentile(values, 99):.1f} us, "
            f"mean {statistics.fmean(values):.1f} us, max {values[-1]:.1f} us"
        )
    shares = ", ".join(f"{reason.value} {count}" for reason, count in sorted(reasons.items()))
    print(f"decisions: {shares}; mean matched blocks {matched / len(todo):.1f}")


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
