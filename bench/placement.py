"""Cache-aware placement benchmark: multi-turn chat through a fleet, placement off vs on.

    python -m bench.placement --engine fake --workers 8 --interleave      # fake fleet
    python -m bench.placement --engine vllm --workers 2 --interleave      # 2 vLLM workers
    python -m bench.placement --workload control      # no shared prefixes
    python -m bench.placement --workload skew         # a quarter of conversations: 80 % of turns
    python -m bench.placement --quick                 # a short smoke run
    python -m bench.placement --conversations 240 --arrival-rate 4   # an open load

Each variant (default ``off:CONVEYOR_PLACEMENT=off`` and ``on:CONVEYOR_PLACEMENT=on``) is
a fresh `conveyor up` with that environment. Every round sends a new plan (seed +
round) to every variant alike; the table shows the medians of the rounds: TTFT, ITL,
output tokens/s, and the cached-token ratio next to the ideal one (what one infinite
prefix cache would have served of the same prompts, at the engine's block size).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.chat_load import Message, TurnResult, new_client, run_plan, send_turn
from bench.conversations import KINDS, Plan, WorkloadSpec, make_plan, words_text
from bench.placement_report import (
    VariantResult,
    print_table,
    summarize,
    write_json,
    write_turns,
)
from bench.placement_stack import (
    FakeTiming,
    StackSpec,
    conveyor_stack,
    ensure_model,
    wait_for_workers,
)
from bench.placement_stack import fake_kv_blocks as size_kv
from bench.prompts import PromptFactory
from bench.report import source_state
from bench.servers import (
    ManagedServer,
    drop_stale_jobs,
    interrupt_on_signals,
    parse_env,
    running,
    with_db,
)
from gateway.catalog.tokenizer import ModelTokenizer

DEFAULT_MODEL = Path("/tmp/conveyor-placement-model")
DEFAULT_VARIANTS = ["off:CONVEYOR_PLACEMENT=off", "on:CONVEYOR_PLACEMENT=on"]
VARIANT_DB = 7  # variants use Redis dbs 7, 8, ... of --redis-url's server
VLLM_CPU_BLOCK_TOKENS = 128  # vLLM's block size on CPU
SETTLE_S = 1.5
PROBE_TOKENS = (16, 2048)
PROBE_REPEATS = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.placement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--engine", choices=["fake", "vllm"], default="fake")
    add("--workers", type=int, default=None, help="default: 8 fake, 2 vLLM")
    add("--workload", choices=KINDS, default="multi-turn")
    add("--conversations", type=int, default=None, help="default: 2 per fake worker; 16")
    add("--turns", type=int, default=6, help="turns per conversation (skew: on average)")
    add("--tenants", type=int, default=None, help="default: 1 per 2 fake workers; 4")
    add("--system-tokens", type=int, default=1000, help="each tenant's system prompt")
    add("--user-tokens", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"))
    add("--output-tokens", type=int, default=64)
    add("--think-s", type=float, nargs=2, default=[0.5, 2.0], metavar=("MIN", "MAX"))
    add("--max-context-tokens", type=int, default=6000, help="a longer history starts over")
    add(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="conversations that start per second, at Poisson times (an open load); "
        "default 0: all start at once (a closed load)",
    )
    add("--seed", type=int, default=0)
    add("--rounds", type=int, default=3)
    add(
        "--quick", action="store_true", help="a short smoke run: 3 turns, 16 output tokens, 1 round"
    )
    add("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    add("--interleave", action="store_true", help="every variant up at once, rounds alternate")
    add("--model", type=Path, default=DEFAULT_MODEL, help="generated here if missing")
    add("--served-model-name", default="placement-demo")
    add("--redis-url", default="redis://127.0.0.1:6379/5")
    add("--dtype", default="float32")
    add("--worker-max-slots", type=int, default=64)
    add("--block-tokens", type=int, default=None, help="default: 16 fake, 128 vLLM (CPU)")
    add("--kv-fleet-share", type=float, default=2.0, help="fake: fleet KV / working set")
    add("--fake-kv-blocks", type=int, default=None, help="fake: KV blocks per worker")
    add("--fake-speedup", type=float, default=1.0, help="fake: step times are divided by it")
    add("--startup-timeout", type=float, default=600.0)
    add("--log-dir", type=Path, default=None)
    add("--json-out", type=Path, default=None)
    add(
        "--turns-out",
        type=Path,
        default=None,
        help="every turn of every round, one JSON line each (variant, round, times, tokens)",
    )
    return parser


def resolve(args: argparse.Namespace) -> None:
    """Fill the defaults that depend on the engine and --quick."""
    fake = args.engine == "fake"
    args.workers = args.workers or (8 if fake else 2)
    if args.quick:
        args.turns, args.output_tokens, args.rounds = 3, 16, 1
        args.think_s = [0.1, 0.5]
        args.conversations = args.conversations or (args.workers if fake else 6)
    # 2 per worker: more saturates the CPU of a small machine before the simulated engines
    args.conversations = args.conversations or (2 * args.workers if fake else 16)
    args.tenants = args.tenants or (max(2, args.workers // 2) if fake else 4)
    args.block_tokens = args.block_tokens or (
        FakeTiming().block_tokens if fake else VLLM_CPU_BLOCK_TOKENS
    )
    args.variant = args.variant or DEFAULT_VARIANTS


def workload(args: argparse.Namespace, seed: int) -> WorkloadSpec:
    return WorkloadSpec(
        kind=args.workload,
        conversations=args.conversations,
        turns=args.turns,
        tenants=args.tenants,
        system_tokens=args.system_tokens,
        user_tokens=(args.user_tokens[0], args.user_tokens[1]),
        output_tokens=args.output_tokens,
        think_s=(args.think_s[0], args.think_s[1]),
        max_context_tokens=args.max_context_tokens,
        arrival_rate=args.arrival_rate,
        seed=seed,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Bench:
    args: argparse.Namespace
    words: list[str]
    tokenize: Callable[[list[Message]], list[int]]
    plans: list[Plan]


def warm_up_and_probe(bench: Bench, server: ManagedServer, into: VariantResult) -> None:
    """A few short conversations, then the prefill probe: TTFT of fresh prompts of 2k
    tokens minus that of 16 tokens, one at a time, best of three."""
    warm = make_plan(
        WorkloadSpec(
            conversations=2 * bench.args.workers,
            turns=2,
            tenants=1,
            system_tokens=256,
            user_tokens=(64, 128),
            output_tokens=8,
            think_s=(0.0, 0.0),
            seed=-1,
        ),
        len(bench.words),
    )
    asyncio.run(run_plan(server.base_url, bench.args.served_model_name, warm, bench.words))
    ttft = asyncio.run(_probe(bench, server))
    short, long = (ttft.get(tokens, math.nan) for tokens in PROBE_TOKENS)
    into.prefill_probe_ms = (long - short) * 1000  # NaN when a probe failed
    print(f"  {server.name}: warm; 2k-token prefill {into.prefill_probe_ms:.0f} ms", flush=True)


async def _probe(bench: Bench, server: ManagedServer) -> dict[int, float]:
    rng = random.Random(f"probe-{server.name}-{time.time_ns()}")  # never cached
    best: dict[int, float] = {}
    async with new_client(server.base_url) as client:
        for tokens in PROBE_TOKENS * PROBE_REPEATS:
            words = [rng.randrange(len(bench.words)) for _ in range(tokens - 8)]
            message: Message = {"role": "user", "content": words_text(bench.words, words)}
            result = TurnResult(0, 0, [message])
            await send_turn(client, bench.args.served_model_name, 1, result)
            if result.error is None and result.first_token is not None:
                took = result.first_token - result.start
                best[tokens] = min(best.get(tokens, took), took)
    return best


def measure_round(bench: Bench, number: int, server: ManagedServer, into: VariantResult) -> None:
    time.sleep(SETTLE_S)
    plan = bench.plans[number]
    results, took = asyncio.run(
        run_plan(server.base_url, bench.args.served_model_name, plan, bench.words)
    )
    summary = summarize(results, took, bench.tokenize, bench.args.block_tokens)
    into.rounds.append(summary)
    if bench.args.turns_out is not None:
        write_turns(bench.args.turns_out, server.name, number, results)
    counts = placement_counts(server.base_url)
    placed = ", ".join(
        f"{k} {v - into.placed.get(k, 0):.0f}"
        for k, v in sorted(counts.items())
        if k != MATCHED_BLOCKS
    )
    predicted = (counts.get(MATCHED_BLOCKS, 0) - into.placed.get(MATCHED_BLOCKS, 0)) * (
        bench.args.block_tokens
    )
    into.placed = counts
    missed = ", ".join(f"{turn}: {tokens}" for turn, tokens in summary.missed_by_turn.items())
    print(
        f"  {server.name} round {number + 1}/{bench.args.rounds}: {summary.completed}/"
        f"{summary.turns} turns in {took:.1f}s, TTFT p50 {summary.ttft_p50_ms:.0f} ms, "
        f"cached {summary.cached_ratio:.3f} / ideal {summary.ideal_ratio:.3f}; "
        f"placed: {placed or 'nothing counted'}",
        flush=True,
    )
    if counts:
        print(
            f"    cached tokens {summary.cached_tokens} (the gateway predicted {predicted:.0f}), "
            f"ideal {summary.ideal_cached_tokens}; ideal minus cached by turn: {missed}",
            flush=True,
        )
    ttft = ", ".join(
        f"{turn}: {p50:.0f}/{p99:.0f}" for turn, (p50, p99) in summary.ttft_by_turn.items()
    )
    print(f"    TTFT p50/p99 ms by turn: {ttft}", flush=True)


MATCHED_BLOCKS = "matched blocks"


def placement_counts(base_url: str) -> dict[str, float]:
    """The gateway's placements so far by reason, its workers' steals, and the prompt blocks
    it found cached where it placed (from /metrics)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "conveyor_placements_total":
                key = sample.labels["reason"]
            elif sample.name == "conveyor_worker_steals_total":
                key = "steals"
            elif sample.name == "conveyor_placement_matched_blocks_sum":
                key = MATCHED_BLOCKS
            else:
                continue
            counts[key] = counts.get(key, 0) + sample.value
    return counts


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    resolve(args)
    model = ensure_model(args.model)
    prompts = PromptFactory(model, args.served_model_name, "chat")
    tokenizer = ModelTokenizer(model)
    plans = [
        make_plan(workload(args, args.seed + r), len(prompts.words)) for r in range(args.rounds)
    ]

    def tokenize(messages: list[Message]) -> list[int]:
        return tokenizer.encode_chat(list(messages))

    bench = Bench(args, prompts.words, tokenize, plans)
    log_dir: Path = args.log_dir or Path(tempfile.mkdtemp(prefix="conveyor-placement-"))
    spec = stack_spec(args, plans[0], model, log_dir)
    heading = describe(args, plans[0], spec)
    print("\n".join(heading), flush=True)
    stacks = [variant_stack(spec, args, number, item) for number, item in enumerate(args.variant)]
    for group in [stacks] if args.interleave else [[stack] for stack in stacks]:
        measure_group(bench, group)
    variants = [into for _, _, into in stacks]
    heading.append(
        f"code under test: {source_state()}; bench wall time {time.monotonic() - started:.0f}s"
    )
    print_table(variants, heading)
    if args.json_out is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_json(args.json_out, config, variants)
        print(f"results written to {args.json_out}")
    return 0 if all(r.errors == 0 for v in variants for r in v.rounds) else 1


Stack = tuple[ManagedServer, str, VariantResult]
"""A variant's `conveyor up`, its Redis URL, and its results."""


def variant_stack(spec: StackSpec, args: argparse.Namespace, number: int, item: str) -> Stack:
    name, _, env = item.partition(":")
    redis_url = with_db(args.redis_url, VARIANT_DB + number)
    drop_stale_jobs(redis_url, args.served_model_name)
    overrides = parse_env(env)
    return (
        conveyor_stack(spec, redis_url, name, overrides),
        redis_url,
        VariantResult(name, overrides),
    )


def measure_group(bench: Bench, group: list[Stack]) -> None:
    """Start every stack of ``group``, wait for all their workers, warm each up, then run
    the rounds, alternating between the stacks (each round in the other order)."""
    args = bench.args
    with contextlib.ExitStack() as stack:
        for server, _, _ in group:
            print(f"starting {server.name}: {' '.join(server.command)}", flush=True)
            stack.enter_context(running(server, args.startup_timeout))
        for _, redis_url, _ in group:
            wait_for_workers(redis_url, args.served_model_name, args.workers, args.startup_timeout)
        for server, _, into in group:
            warm_up_and_probe(bench, server, into)
            into.placed = placement_counts(server.base_url)
        for number in range(args.rounds):
            # ABBA order: whichever stack runs second in a round measured slower (it
            # meets the first one's after-load), so each variant goes first in turn
            order = group if number % 2 == 0 else group[::-1]
            for server, _, into in order:
                measure_round(bench, number, server, into)


def stack_spec(args: argparse.Namespace, plan: Plan, model: Path, log_dir: Path) -> StackSpec:
    timing = dataclasses.replace(
        FakeTiming(), block_tokens=args.block_tokens, speedup=args.fake_speedup
    )
    blocks = args.fake_kv_blocks or size_kv(
        plan.working_set_tokens(fastest_turn_s(args, timing)),
        args.block_tokens,
        args.workers,
        args.kv_fleet_share,
    )
    return StackSpec(
        engine=args.engine,
        workers=args.workers,
        model=model,
        served_name=args.served_model_name,
        dtype=args.dtype,
        max_slots=args.worker_max_slots,
        log_dir=log_dir,
        fake=timing,
        fake_kv_blocks=blocks,
    )


def fastest_turn_s(args: argparse.Namespace, timing: FakeTiming) -> float:
    """A turn's time on an idle fake engine, one bare step per output token: under an
    open load, the shortest a conversation stays live (so the live working set, and the
    caches sized from it, are never overstated)."""
    tokens: int = args.output_tokens
    return tokens * timing.step_base_ms / 1000 / timing.speedup


def describe(args: argparse.Namespace, plan: Plan, spec: StackSpec) -> list[str]:
    starts = (
        f"{args.arrival_rate:g} new conversations/s"
        if args.arrival_rate > 0
        else "all starting at once"
    )
    lines = [
        f"workload {args.workload}: {args.conversations} conversations, {plan.total_turns} "
        f"turns, {args.tenants} tenants x {args.system_tokens}-token system prompts, user "
        f"messages {args.user_tokens[0]}-{args.user_tokens[1]} tokens, {args.output_tokens} "
        f"output tokens, think {args.think_s[0]}-{args.think_s[1]} s, {starts}; "
        f"{args.rounds} round(s) "
        f"({'interleaved' if args.interleave else 'one variant after the other'}), medians",
        f"engine: {args.workers} x {args.engine}; ideal ratio at {args.block_tokens}-token blocks",
    ]
    if args.engine == "fake":
        working = plan.working_set_tokens(fastest_turn_s(args, spec.fake))
        per_worker = spec.fake_kv_blocks * spec.fake.block_tokens
        t = spec.fake
        live = "live " if args.arrival_rate > 0 else ""
        lines.append(
            f"fake timing: step {t.step_base_ms} ms + {t.step_per_seq_us} us/sequence + "
            f"{t.prefill_per_token_us} us/uncached prompt token (chunks of "
            f"{t.prefill_chunk_tokens}), divided by {t.speedup}; KV {spec.fake_kv_blocks} "
            "blocks per worker = "
            f"{per_worker / working:.2f} of the {live}working set ({working} tokens), fleet "
            f"{per_worker * args.workers / working:.2f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.turns, args.rounds, args.output_tokens) < 1:
        print("need --turns, --rounds, --output-tokens >= 1", file=sys.stderr)
        return 2
    interrupt_on_signals()
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted; every stack started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
