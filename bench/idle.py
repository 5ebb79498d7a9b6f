"""Idle CPU of a Conveyor stack, and the KV handoff time of a disaggregated one.

    python -m bench.idle                         # start `conveyor up --mode disaggregated`
    python -m bench.idle --mode aggregated       # or an aggregated stack
    python -m bench.idle --repeat 3 --idle-s 20  # three stacks in turn, one after another
    python -m bench.idle --env PYTHONPATH=/tmp/old-checkout   # e.g. measure older code

For each stack: start it on loopback, wait until it is ready and its workers registered,
let it settle, then

1. sample the CPU time of the whole process tree (gateway, workers, vLLM engine-core and
   model-worker processes) over ``--idle-s`` seconds of no traffic: "cores busy";
2. (disaggregated) send ``--transfers`` requests one after another, each with a fresh
   ``--input-tokens``-token prompt (whole 128-token blocks go from prefill to decode),
   and print the KV transfer time per request that the decode worker reports (vLLM's
   NIXL transfer durations, summed in its registration: ``kv_transfers``/``kv_transfer_s``)
   plus the requests' end-to-end latency;
3. sample idle CPU again (nothing may keep spinning after the traffic).

The machine's other load is printed beside each sample: on a small shared box the
"other processes" column says how far to trust a number.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.cpu import CpuMeter, CpuReport
from bench.servers import (
    conveyor_server,
    drop_stale_jobs,
    free_port,
    interrupt_on_signals,
    kv_transfers,
    parse_env,
    running,
)
from conveyor.redis_server import redis_answers

DEFAULT_MODEL = Path("/tmp/demo-model")
REGISTRY_BEAT_S = 1.2
"""A decode worker's next heartbeat carries its counters within this long."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.idle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=["disaggregated", "aggregated"], default="disaggregated")
    parser.add_argument(
        "--idle-s", type=float, default=15.0, help="seconds of each idle CPU sample"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=5.0,
        help="pause after start-up and after traffic before sampling",
    )
    parser.add_argument(
        "--transfers",
        type=int,
        default=20,
        help="disaggregated: sequential requests whose KV goes prefill->decode",
    )
    parser.add_argument(
        "--input-tokens",
        type=int,
        default=601,
        help="prompt tokens of each transfer request (601: four full blocks)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="stacks to start, one at a time")
    parser.add_argument(
        "--env",
        default="",
        metavar="KEY=VALUE,...",
        help="extra environment variables of the stack",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="model folder (the demo model is generated here if missing)",
    )
    parser.add_argument("--served-model-name", default="conveyor-demo")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis of the stack (default: `conveyor up` starts a private "
        "redis-server on a free port, so nobody else's tests can flush it; "
        "its CPU counts as the stack's)",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="server logs (default: a new /tmp/conveyor-idle-* folder)",
    )
    return parser


def _wait_registered(base_url: str, model: str, roles: set[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            pools = httpx.get(f"{base_url}/admin/state", timeout=5).json()["pools"]
            if all(pools.get(model, {}).get(role) for role in roles):
                return
        time.sleep(0.5)
    raise TimeoutError(f"workers {sorted(roles)} of {model} not registered in {timeout_s:.0f}s")


def _sample_idle(pid: int, redis_port: int, seconds: float) -> CpuReport:
    meter = CpuMeter(pid, redis_port)
    meter.start()
    time.sleep(seconds)
    return meter.stop()


def _print_idle(label: str, report: CpuReport) -> float:
    busy_s = sum(report.server.values())
    cores = busy_s / report.wall_s
    print(
        f"  idle CPU {label}: {cores:.3f} cores busy (server tree {busy_s:.2f} CPU-s over "
        f"{report.wall_s:.1f}s; other processes on the machine "
        f"{report.other_s / report.wall_s:.2f} cores)",
        flush=True,
    )
    for line in report.lines()[1:]:
        print(f"  {line}")
    return cores


def _transfer_round(
    base_url: str, args: argparse.Namespace, round_no: int
) -> tuple[int, float, list[float]]:
    """Sequential requests with fresh prompts; (transfers, transfer seconds, latencies)."""
    before = kv_transfers(args.redis_url, args.served_model_name)
    latencies = []
    with httpx.Client(base_url=base_url, timeout=300, trust_env=False) as client:
        for number in range(args.transfers + 1):  # the first one warms the path up
            rng = random.Random(f"{round_no}-{number}-{time.time()}")  # never a cache hit
            prompt = [1, *rng.choices(range(10, 4000), k=args.input_tokens - 1)]
            body = {
                "model": args.served_model_name,
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            }
            started = time.perf_counter()
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            if number == 0:
                time.sleep(REGISTRY_BEAT_S)
                before = kv_transfers(args.redis_url, args.served_model_name)
                continue
            latencies.append(time.perf_counter() - started)
    time.sleep(REGISTRY_BEAT_S * 2)
    after = kv_transfers(args.redis_url, args.served_model_name)
    return after[0] - before[0], after[1] - before[1], latencies


def run_once(args: argparse.Namespace, round_no: int, log_dir: Path) -> dict[str, float]:
    if args.redis_url is None:
        args.redis_url = f"redis://127.0.0.1:{free_port()}/0"
    elif redis_answers(args.redis_url):
        drop_stale_jobs(args.redis_url, args.served_model_name)
    server = conveyor_server(
        args.model,
        args.served_model_name,
        args.redis_url,
        args.dtype,
        64,
        log_dir / f"run{round_no}",
        mode=args.mode,
        env_overrides=parse_env(args.env) if args.env else None,
    )
    port = int(args.redis_url.split("://", 1)[1].split("/")[0].rpartition(":")[2] or 6379)
    result: dict[str, float] = {}
    print(f"starting {server.name}: {' '.join(server.command)}", flush=True)
    with running(server, args.startup_timeout):
        roles = {"prefill", "decode"} if args.mode == "disaggregated" else {"aggregated"}
        _wait_registered(server.base_url, args.served_model_name, roles, args.startup_timeout)
        assert server.pid is not None
        time.sleep(args.settle_s)
        result["idle_cores"] = _print_idle(
            "after start-up", _sample_idle(server.pid, port, args.idle_s)
        )
        if args.mode == "disaggregated" and args.transfers > 0:
            count, seconds, latencies = _transfer_round(server.base_url, args, round_no)
            per = seconds / count * 1000 if count else float("nan")
            result["kv_ms"] = per
            result["latency_ms"] = statistics.median(latencies) * 1000
            print(
                f"  KV handoff: {count} transfers for {len(latencies)} requests of "
                f"{args.input_tokens} prompt tokens, {per:.2f} ms per transfer "
                f"(decode worker's kv_transfer_s/kv_transfers); request latency p50 "
                f"{result['latency_ms']:.1f} ms, max {max(latencies) * 1000:.1f} ms",
                flush=True,
            )
            time.sleep(args.settle_s)
            result["idle_after_cores"] = _print_idle(
                "after traffic", _sample_idle(server.pid, port, args.idle_s)
            )
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model: Path = args.model.resolve()
    if not (model / "config.json").exists():
        from shared.demo.model import write_demo_model

        print(f"writing the demo model to {model}", flush=True)
        write_demo_model(model)
    args.model = model
    log_dir: Path = args.log_dir or Path(tempfile.mkdtemp(prefix="conveyor-idle-"))
    # Ctrl-C and SIGTERM both unwind through `running`, which stops the stack (SIGINT
    # explicitly too: a shell starts background jobs with SIGINT ignored).
    interrupt_on_signals()
    try:
        results = [run_once(args, number, log_dir) for number in range(args.repeat)]
    except KeyboardInterrupt:
        print("interrupted; the stack was stopped", file=sys.stderr)
        return 130
    print(f"\nsummary ({args.mode}, {args.repeat} stack(s), env: {args.env or 'default'}):")
    for key, unit in (
        ("idle_cores", "cores"),
        ("idle_after_cores", "cores"),
        ("kv_ms", "ms per KV transfer"),
        ("latency_ms", "ms request p50"),
    ):
        values = [r[key] for r in results if key in r]
        if values:
            listed = ", ".join(f"{v:.3f}" if unit == "cores" else f"{v:.2f}" for v in values)
            print(f"  {key:17s} {listed}  ({unit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
