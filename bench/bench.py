"""Streaming load benchmark: Conveyor (and, with --compare, vLLM's own OpenAI server).

    python -m bench.bench                  # start Conveyor on the demo model, load it, stop it
    python -m bench.bench --compare        # then the same load on vLLM's api_server
    python -m bench.bench --compare --interleave   # both up at once, rounds alternate
    python -m bench.bench --url http://127.0.0.1:8000   # load a server that is already up

Every request streams; prompts have an exact token count, outputs a fixed one
(``ignore_eos``, ``temperature 0``). Each server gets a warm-up, then ``--rounds``
measured rounds of fresh prompts; the table shows the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bench.cpu import CpuMeter
from bench.load import RequestResult, run_load, summarize
from bench.prompts import PromptFactory
from bench.report import Measurement, print_report, source_state, write_json
from bench.servers import (
    ManagedServer,
    conveyor_server,
    drop_stale_jobs,
    interrupt_on_signals,
    kv_transfers,
    limited_key,
    parse_env,
    running,
    vllm_server,
    with_db,
)

DEFAULT_MODEL = Path("/tmp/demo-model")
BENCH_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
"""What ``--tools-for`` adds to each request (the demo template does not render it, so
the prompt is unchanged: only the output parsing differs)."""
VARIANT_DB = 7  # --variant servers use Redis dbs 7, 8, ... of --redis-url's server
WARMUP_KEY_BASE = 1_000_000  # warm-up prompts never repeat a measured prompt
REGISTRY_BEAT_S = 1.2
SETTLE_S = 1.5
"""Pause before each round: vLLM's engine worker busy-polls for 1 s after its last step."""


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    base_url: str
    pid: int | None
    redis_port: int | None = None
    redis_url: str | None = None
    """Set for a disaggregated Conveyor: its decode workers report KV transfer times here."""
    api_key: str | None = None
    """Sent as a Bearer key (a variant with auth on: a key with limits, see servers.py)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="load this running server instead of starting Conveyor")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also start vLLM's own OpenAI server and run the identical load",
    )
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help="also run Conveyor in disaggregated mode (one prefill and one "
        "decode worker, NIXL KV transfer) and report the KV transfer time",
    )
    parser.add_argument(
        "--pd-redis-url",
        default="redis://127.0.0.1:6379/6",
        help="Redis db of the disaggregated Conveyor (kept apart from the aggregated one's)",
    )
    parser.add_argument(
        "--vllm-env",
        default=None,
        metavar="KEY=VALUE,...",
        help="with --compare: also run vLLM's server with these environment "
        "variables (as 'vllm-tuned'), e.g. the engine placement Conveyor uses",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also run Conveyor with these environment variables (as "
        "'conveyor-NAME', on its own Redis db); repeatable",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="with --compare, --disaggregated or --variant: run every server at once and "
        "alternate rounds, so background load from other processes hits them alike",
    )
    parser.add_argument(
        "--tools-for",
        action="append",
        default=[],
        metavar="SERVER",
        help="send every request to this server (e.g. conveyor-NAME) with a tool and "
        "tool_choice auto, so the gateway parses the output for tool calls; repeatable",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128, help="requests per round")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measured rounds per server; the table shows their medians",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help="requests of the warm-up round (default: --concurrency)",
    )
    parser.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="chat messages of exact length, or token-id completions",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="model folder (the demo model is generated here if missing)",
    )
    parser.add_argument("--served-model-name", default="bench-demo")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/5")
    parser.add_argument("--dtype", default="float32", help="engine dtype of both servers")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="vLLM's --max-num-seqs and Conveyor's --worker-max-slots",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="server logs (default: a new /tmp/conveyor-bench-* folder)",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write results as JSON")
    return parser


def _load(
    target: Target, prompts: PromptFactory, keys: range, args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    bodies = [prompts.body(key, args.input_tokens, args.output_tokens) for key in keys]
    if target.name in args.tools_for:
        bodies = [{**body, "tools": [BENCH_TOOL], "tool_choice": "auto"} for body in bodies]
    return asyncio.run(
        run_load(
            target.base_url,
            prompts.path,
            bodies,
            concurrency=args.concurrency,
            output_tokens=args.output_tokens,
            api_key=target.api_key,
        )
    )


def warm_up(target: Target, prompts: PromptFactory, args: argparse.Namespace) -> None:
    count = args.concurrency if args.warmup_requests is None else args.warmup_requests
    if count > 0:
        results, took = _load(
            target, prompts, range(WARMUP_KEY_BASE, WARMUP_KEY_BASE + count), args
        )
        bad = sum(r.error is not None for r in results)
        print(
            f"  {target.name}: warm-up {count} requests in {took:.1f}s ({bad} errors)", flush=True
        )


def measure_round(
    target: Target, number: int, prompts: PromptFactory, args: argparse.Namespace, into: Measurement
) -> None:
    time.sleep(SETTLE_S)
    first = number * args.requests  # every round sends prompts never seen before
    meter = CpuMeter(target.pid, target.redis_port)
    transfers_before = _kv_transfers(target, args)
    meter.start()
    results, took = _load(target, prompts, range(first, first + args.requests), args)
    cpu = meter.stop()
    summary = summarize(results, took)
    into.rounds.append(summary)
    into.cpu.append(cpu)
    if transfers_before is not None:
        time.sleep(REGISTRY_BEAT_S)  # the decode worker's next heartbeat carries the counters
        count, seconds = _kv_transfers(target, args) or (0, 0.0)
        into.transfers.append((count - transfers_before[0], seconds - transfers_before[1]))
    print(
        f"  {target.name} round {number + 1}/{args.rounds}: {summary.completed}/"
        f"{summary.requests} ok in {took:.1f}s, {summary.output_tokens_per_s:.0f} output "
        f"tok/s, TTFT p50 {summary.ttft_p50_ms:.0f} ms, server CPU "
        f"{sum(cpu.server.values()):.1f}s, other processes {cpu.other_s:.1f}s",
        flush=True,
    )


def _kv_transfers(target: Target, args: argparse.Namespace) -> tuple[int, float] | None:
    if target.redis_url is None:
        return None
    return kv_transfers(target.redis_url, args.served_model_name)


def measure(
    targets: list[Target], prompts: PromptFactory, args: argparse.Namespace
) -> list[Measurement]:
    """Warm every target up, then run the rounds, alternating between targets."""
    for target in targets:
        warm_up(target, prompts, args)
    measurements = [Measurement(target.name) for target in targets]
    for number in range(args.rounds):
        for target, into in zip(targets, measurements, strict=True):
            measure_round(target, number, prompts, args, into)
    return measurements


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    model: Path = args.model.resolve()
    if not (model / "config.json").exists():
        from shared.demo.model import write_demo_model

        print(f"writing the demo model to {model}", flush=True)
        write_demo_model(model)
    prompts = PromptFactory(model, args.served_model_name, args.endpoint)
    code = source_state()
    log_dir: Path = args.log_dir or Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[ManagedServer | Target] = []
    if args.url:
        servers.append(Target("conveyor", args.url.rstrip("/"), None, _port(args.redis_url)))
    else:
        drop_stale_jobs(args.redis_url, args.served_model_name)
        servers.append(
            conveyor_server(
                model,
                args.served_model_name,
                args.redis_url,
                args.dtype,
                args.max_num_seqs,
                log_dir,
            )
        )
    if args.disaggregated:
        drop_stale_jobs(args.pd_redis_url, args.served_model_name)
        servers.append(
            conveyor_server(
                model,
                args.served_model_name,
                args.pd_redis_url,
                args.dtype,
                args.max_num_seqs,
                log_dir,
                mode="disaggregated",
            )
        )
    for number, spec in enumerate(args.variant):
        variant, _, env = spec.partition(":")
        redis_url = with_db(args.redis_url, VARIANT_DB + number)
        drop_stale_jobs(redis_url, args.served_model_name)
        servers.append(
            conveyor_server(
                model,
                args.served_model_name,
                redis_url,
                args.dtype,
                args.max_num_seqs,
                log_dir,
                variant=variant,
                env_overrides=parse_env(env),
            )
        )
    if args.compare:
        servers.append(
            vllm_server(model, args.served_model_name, args.dtype, args.max_num_seqs, log_dir)
        )
        if args.vllm_env:
            servers.append(
                vllm_server(
                    model,
                    args.served_model_name,
                    args.dtype,
                    args.max_num_seqs,
                    log_dir,
                    name="vllm-tuned",
                    env_overrides=parse_env(args.vllm_env),
                )
            )
    groups = [servers] if args.interleave else [[server] for server in servers]
    measurements: list[Measurement] = []
    for group in groups:
        with contextlib.ExitStack() as stack:
            targets = [_start(server, stack, args) for server in group]
            measurements += measure(targets, prompts, args)
    wall_s = time.monotonic() - started
    prompt = prompts.describe(args.input_tokens)
    print_report(measurements, args, prompt, code, wall_s)
    if args.json_out is not None:
        write_json(args.json_out, measurements, args, prompt, code, wall_s)
        print(f"results written to {args.json_out}")
    return 0 if all(r.errors == 0 for m in measurements for r in m.rounds) else 1


def _start(
    server: ManagedServer | Target, stack: contextlib.ExitStack, args: argparse.Namespace
) -> Target:
    if isinstance(server, Target):
        return server
    print(f"starting {server.name}: {' '.join(server.command)}", flush=True)
    stack.enter_context(running(server, args.startup_timeout))
    if server.name == "conveyor-pd":
        return Target(
            server.name, server.base_url, server.pid, _port(args.pd_redis_url), args.pd_redis_url
        )
    # Every Conveyor (variants too: they use other dbs of the same Redis) is charged the
    # Redis CPU of its own rounds; charging only `conveyor` had made it look costlier.
    redis_port = _port(args.redis_url) if server.name.startswith("conveyor") else None
    api_key = limited_key(server)
    return Target(server.name, server.base_url, server.pid, redis_port, api_key=api_key)


def _port(url: str) -> int:
    return urlsplit(url).port or 6379


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.concurrency, args.requests, args.rounds) < 1 or args.input_tokens < 8:
        print(
            "need --concurrency, --requests, --rounds >= 1 and --input-tokens >= 8", file=sys.stderr
        )
        return 2
    if args.interleave and not (args.compare or args.disaggregated or args.variant):
        print("--interleave needs --compare, --disaggregated or --variant", file=sys.stderr)
        return 2
    interrupt_on_signals()
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted; every server started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
