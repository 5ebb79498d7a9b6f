"""The serving path's ceiling: how many streamed tokens/s one gateway process sustains.

    python -m bench.ceiling                          # 1 and 2 gateways, 64/256/1024 streams
    python -m bench.ceiling --gateways 1 --streams 256 --json /tmp/ceiling.json

Workers run the fake engine (``--engine fake``) with a step time and nothing else (no
per-sequence or prefill cost), so every running stream gets one token per step and
the offered load is ``streams / step``. At each number of concurrent streams the load
doubles (new workers with a shorter step) until the latency the path adds to a token
(inter-token latency p99 minus the step time) passes 50 ms, with one try in between;
the knee is the best level that held. For each level: CPU µs per streamed token of the
gateways, the worker runtime, the fake engine, Redis and the load clients, read from
/proc before and after. The fake engine's sleep costs no CPU; what its step loop costs
(planning steps, making every sequence's output) it counts itself and reports in the
worker's registry entry (``engine_cpu_s``), and that is taken off the workers' CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis

from bench.cpu import machine_busy_s, tree_cpu_s
from bench.knee import (
    ADDED_ITL_BUDGET_MS,
    CpuSplit,
    LatencyHistogram,
    Level,
    knee,
    next_offered,
    step_ms_for,
)
from bench.report import source_state
from bench.servers import ManagedServer, free_port
from shared.queue import names
from shared.queue.liveness import WorkerRegistration

ROLES = ("gateway", "worker", "engine", "redis", "client")
"""Read from /proc but "engine": the part of the workers' CPU their fake engines report."""
SERVED_NAME = "ceiling"
READY_STREAK = 20
START_STEP_MS = 50.0
"""The first level of every ladder: one token per stream every 50 ms."""


@dataclass(frozen=True, slots=True)
class Measured:
    level: Level
    cpu: CpuSplit
    machine_busy_s: float
    events_per_request: float
    error_samples: list[str]

    def row(self) -> dict[str, Any]:
        level = self.level
        return {
            **asdict(level),
            "offered_tokens_per_s": level.offered_tokens_per_s,
            "added_itl_p99_ms": level.added_itl_p99_ms,
            "holds": level.holds(),
            "wall_s": self.cpu.wall_s,
            "tokens": self.cpu.tokens,
            "cpu_s": self.cpu.seconds,
            "us_per_token": {role: self.cpu.us_per_token(role) for role in ROLES},
            "cores": {role: self.cpu.cores(role) for role in ROLES},
            "machine_cores": self.machine_busy_s / self.cpu.wall_s,
            "events_per_request": self.events_per_request,
            "error_samples": self.error_samples,
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ceiling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--workers", type=int, default=2, help="fake-engine worker processes")
    parser.add_argument("--clients", type=int, default=0, help="client processes (0: 1 per 512)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--budget-ms", type=float, default=ADDED_ITL_BUDGET_MS)
    parser.add_argument("--measure-s", type=float, default=6.0, help="at least; 20 steps")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="at least; 10 steps")
    parser.add_argument(
        "--step-ms",
        type=float,
        help="measure this one fake-engine step time at each --streams (no ladder)",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set in the gateways' and workers' environment (e.g. PYTHONPATH=/tmp/old)",
    )
    parser.add_argument("--max-levels", type=int, default=9)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--model", type=Path, help="a model folder (default: the demo model)")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the benchmark, its servers and the Redis at this niceness (a negative "
        "one needs root: on a box shared with other work, the scheduler then serves them "
        "first, as on a box of their own)",
    )
    parser.add_argument("--json", type=Path, help="write every level's figures here")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temp folder)")
    return parser


def _conveyor() -> list[str]:
    script = Path(sys.executable).with_name("conveyor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "conveyor.cli"]


class Cluster:
    """Gateways that stay up for one ``--gateways`` count; workers restarted per level."""

    def __init__(self, args: argparse.Namespace, model: Path, log_dir: Path) -> None:
        self.args = args
        self.log_dir = log_dir
        self.port = free_port()
        self.env = {
            **os.environ,
            "CONVEYOR_MODEL": str(model),
            "CONVEYOR_SERVED_MODEL_NAME": SERVED_NAME,
            "CONVEYOR_REDIS_URL": args.redis_url,
            "CONVEYOR_DATA_DIR": str(log_dir / "data"),
            "CONVEYOR_ENGINE": "fake",
            "CONVEYOR_QUEUE_MAX_DEPTH": "100000",
            "CONVEYOR_LOG_LEVEL": "WARNING",
            **dict(item.split("=", 1) for item in args.server_env),
        }
        self.gateways: list[ManagedServer] = []
        self.workers: list[ManagedServer] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_gateways(self, count: int) -> None:
        env = {**self.env, "CONVEYOR_REUSE_PORT": "true" if count > 1 else "false"}
        for number in range(count):
            gateway = ManagedServer(
                f"gateway-{number}",
                [*_conveyor(), "gateway", "--port", str(self.port)],
                env,
                self.port,
                "/health",
                self.log_dir / f"gateway-{count}-{number}.log",
            )
            gateway.start()
            gateway.wait_ready(120)
            self.gateways.append(gateway)

    def start_workers(self, streams: int, step_ms: float) -> None:
        slots = math.ceil(streams / self.args.workers)
        env = {
            **self.env,
            "CONVEYOR_WORKER_MAX_SLOTS": str(slots),
            "CONVEYOR_FAKE_STEP_BASE_MS": f"{step_ms:.4f}",
            "CONVEYOR_FAKE_STEP_PER_SEQ_US": "0",
            "CONVEYOR_FAKE_PREFILL_PER_TOKEN_US": "0",
            "CONVEYOR_FAKE_KV_BLOCKS": str(max(8192, 4 * slots * self.args.max_tokens // 16)),
        }
        for number in range(self.args.workers):
            worker = ManagedServer(
                f"worker-{number}",
                [*_conveyor(), "worker"],
                env,
                0,
                "/",
                self.log_dir / f"worker-{number}.log",
            )
            worker.start()
            self.workers.append(worker)
        self._wait_for_workers()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Every gateway's directory sees the new workers: /ready answers 200 several
        times in a row (SO_REUSEPORT spreads the new connections over the gateways)."""
        deadline, streak = time.monotonic() + 60, 0
        while streak < READY_STREAK:
            if time.monotonic() > deadline:
                raise TimeoutError("the gateways do not see the fake-engine workers")
            with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as client:
                streak = streak + 1 if client.get("/ready").status_code == 200 else 0
            time.sleep(0.1)

    def _wait_for_workers(self) -> None:
        client = redis.Redis.from_url(self.args.redis_url)
        deadline = time.monotonic() + 120
        try:
            while len(list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))) < len(self.workers):
                for worker in self.workers:
                    if worker.process is not None and worker.process.poll() is not None:
                        raise RuntimeError(f"{worker.name} exited\n{worker.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError("the fake-engine workers did not register")
                time.sleep(0.1)
        finally:
            client.close()

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []
        client = redis.Redis.from_url(self.args.redis_url)
        try:  # a stopped worker's heartbeat would count for the next level's
            for key in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN):
                client.delete(key)
        finally:
            client.close()

    def stop(self) -> None:
        self.stop_workers()
        for gateway in self.gateways:
            gateway.stop()
        self.gateways = []

    def redis_pid(self) -> int:
        client = redis.Redis.from_url(self.args.redis_url)
        try:
            return int(client.info("server")["process_id"])
        finally:
            client.close()


def engine_cpu_s(redis_url: str) -> float:
    """The fake engines' own CPU seconds so far, as their workers last reported them.

    A worker reports at every heartbeat, so each figure lags by up to a beat; under a
    steady load the lags cancel in a difference over a window of several seconds."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
        values = client.mget(keys) if keys else []
    finally:
        client.close()
    total = 0.0
    for value in values:
        if value is None:
            continue
        entry = msgspec.json.decode(value, type=WorkerRegistration)
        if entry.model == SERVED_NAME and entry.engine_stats is not None:
            total += entry.engine_stats.engine_cpu_s
    return total


def _cpu_s(roots: dict[str, list[int]], redis_url: str) -> dict[str, float]:
    spent = {role: sum(tree_cpu_s(pid) for pid in pids) for role, pids in roots.items()}
    return {**spent, "engine": engine_cpu_s(redis_url)}


def _client_count(args: argparse.Namespace, streams: int) -> int:
    return args.clients or max(1, math.ceil(streams / 512))


def _lanes(streams: int, clients: int) -> list[int]:
    return [streams // clients + (1 if i < streams % clients else 0) for i in range(clients)]


def measure(cluster: Cluster, streams: int, step_ms: float) -> Measured:
    args = cluster.args
    request_s = args.max_tokens * step_ms / 1000.0
    warmup = max(args.warmup_s, 10 * step_ms / 1000.0, 2 * request_s)
    window = max(args.measure_s, 20 * step_ms / 1000.0, 2 * request_s)
    body = {
        "model": SERVED_NAME,
        "prompt": "the ceiling of the serving path",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    now = time.monotonic()
    window_start, window_end = now + warmup, now + warmup + window
    clients = []
    for lanes in _lanes(streams, _client_count(args, streams)):
        plan = {
            "base_url": cluster.base_url,
            "lanes": lanes,
            "body": body,
            "window_start": window_start,
            "window_end": window_end,
            "stop_at": window_end,
            "stagger_s": request_s,
        }
        command = [sys.executable, "-m", "bench.stream_client", json.dumps(plan)]
        clients.append(subprocess.Popen(command, stdout=subprocess.PIPE))
    roots = {
        "gateway": [g.pid for g in cluster.gateways if g.pid is not None],
        "worker": [w.pid for w in cluster.workers if w.pid is not None],
        "redis": [cluster.redis_pid()],
        "client": [c.pid for c in clients],
    }
    time.sleep(max(0.0, window_start - time.monotonic()))
    before = _cpu_s(roots, args.redis_url)
    busy_before = machine_busy_s()
    time.sleep(max(0.0, window_end - time.monotonic()))
    after = _cpu_s(roots, args.redis_url)
    busy = machine_busy_s() - busy_before
    results = [json.loads(c.communicate(timeout=600 + request_s)[0]) for c in clients]
    return _summarize(streams, step_ms, window, results, before, after, busy)


def _summarize(
    streams: int,
    step_ms: float,
    window: float,
    results: Sequence[dict[str, Any]],
    before: dict[str, float],
    after: dict[str, float],
    busy: float,
) -> Measured:
    gaps = LatencyHistogram()
    for result in results:
        part = LatencyHistogram()
        for index, count in result["gaps"].items():
            part.counts[int(index)] = count
        gaps.merge(part)
    events = sum(r["window_events"] for r in results)
    done_events = sum(r["done_events"] for r in results)
    done_tokens = sum(r["done_tokens"] for r in results)
    requests = sum(r["requests"] for r in results)
    tokens_per_event = done_tokens / done_events if done_events else 1.0
    tokens = round(events * tokens_per_event)
    level = Level(
        streams=streams,
        step_ms=step_ms,
        tokens_per_s=tokens / window,
        requests_per_s=requests / window,
        itl_p50_ms=gaps.percentile_ms(50),
        itl_p99_ms=gaps.percentile_ms(99),
        errors=sum(r["errors"] for r in results),
    )
    seconds = {role: after[role] - before[role] for role in ROLES}
    seconds["worker"] -= seconds["engine"]  # the worker runtime alone
    return Measured(
        level=level,
        cpu=CpuSplit(wall_s=window, tokens=tokens, seconds=seconds),
        machine_busy_s=busy,
        events_per_request=done_events / requests if requests else math.nan,
        error_samples=[s for r in results for s in r["error_samples"]][:5],
    )


def ladder(cluster: Cluster, streams: int) -> list[Measured]:
    args = cluster.args
    start = streams * 1000.0 / START_STEP_MS
    measured: list[Measured] = []
    while len(measured) < args.max_levels:
        offered = next_offered([m.level for m in measured], start, args.budget_ms)
        if offered is None or (args.step_ms is not None and measured):
            break
        step_ms = args.step_ms or step_ms_for(streams, offered)
        cluster.start_workers(streams, step_ms)
        try:
            result = measure(cluster, streams, step_ms)
        finally:
            cluster.stop_workers()
        measured.append(result)
        _print_level(result)
    return measured


def _print_level(m: Measured) -> None:
    lv, cpu = m.level, m.cpu
    us = " ".join(f"{role} {cpu.us_per_token(role):5.1f}" for role in ROLES)
    cores = " ".join(f"{role} {cpu.cores(role):.2f}" for role in ROLES)
    print(
        f"    step {lv.step_ms:7.2f} ms  offered {lv.offered_tokens_per_s:8.0f}  "
        f"got {lv.tokens_per_s:8.0f} tok/s {lv.requests_per_s:7.1f} req/s  "
        f"ITL p50 {lv.itl_p50_ms:6.1f} p99 {lv.itl_p99_ms:6.1f} (+{lv.added_itl_p99_ms:6.1f}) ms"
        f"  err {lv.errors}  {'holds' if lv.holds() else 'OVER'}\n"
        f"      us/token: {us}  | cores: {cores} | machine "
        f"{m.machine_busy_s / cpu.wall_s:.2f} | events/request {m.events_per_request:.1f}",
        flush=True,
    )
    for sample in m.error_samples:
        print(f"      error: {sample}", flush=True)


def _print_summary(table: list[tuple[int, int, list[Measured]]], budget_ms: float) -> None:
    print(f"\nCeiling (added ITL p99 <= {budget_ms:.0f} ms):")
    header = (
        "gateways streams   tok/s   req/s  ITL p99  gw us/tok  worker  engine  redis  client"
        "  tok/s per gw core  busiest (cores)"
    )
    print(header)
    for gateways, streams, measured in table:
        if not measured:
            continue
        best = knee([m.level for m in measured], budget_ms)
        note = ""
        if best is None:  # none held: the one closest to the budget, marked
            best = min((m.level for m in measured), key=lambda lv: lv.added_itl_p99_ms)
            note = f"  (none held: best +{best.added_itl_p99_ms:.0f} ms)"
        m = next(m for m in measured if m.level is best)
        busiest = sorted(ROLES, key=lambda r: -m.cpu.cores(r))[:2]
        busy = ", ".join(f"{r} {m.cpu.cores(r):.2f}" for r in busiest)
        print(
            f"{gateways:8d} {streams:7d} {best.tokens_per_s:7.0f} {best.requests_per_s:7.1f}"
            f" {best.itl_p99_ms:8.1f} {m.cpu.us_per_token('gateway'):10.1f}"
            f" {m.cpu.us_per_token('worker'):7.1f} {m.cpu.us_per_token('engine'):7.1f}"
            f" {m.cpu.us_per_token('redis'):6.1f}"
            f" {m.cpu.us_per_token('client'):7.1f} {m.cpu.tokens_per_core_s('gateway'):18.0f}"
            f"  {busy}; machine {m.machine_busy_s / m.cpu.wall_s:.2f}{note}"
        )


@contextmanager
def _folder(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="conveyor-ceiling-") as folder:
        yield Path(folder)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # the servers and clients inherit it
    print(f"code: {source_state()}; {os.cpu_count()} cores", flush=True)
    table: list[tuple[int, int, list[Measured]]] = []
    with ExitStack() as stack:
        log_dir = stack.enter_context(_folder(args.log_dir))
        model = args.model
        if model is None:
            from shared.demo.model import write_demo_model

            model = write_demo_model(log_dir / "model")
        redis.Redis.from_url(args.redis_url).flushdb()
        if args.nice:
            os.setpriority(os.PRIO_PROCESS, Cluster(args, model, log_dir).redis_pid(), args.nice)
        for gateways in args.gateways:
            cluster = Cluster(args, model, log_dir)
            try:
                cluster.start_gateways(gateways)
                for streams in args.streams:
                    print(f"{gateways} gateway(s), {streams} streams:", flush=True)
                    table.append((gateways, streams, ladder(cluster, streams)))
            finally:
                cluster.stop()
    _print_summary(table, args.budget_ms)
    if args.json is not None:
        rows = [{"gateways": g, **m.row()} for g, _, measured in table for m in measured]
        args.json.write_text(
            json.dumps(
                {"config": vars(args) | {"json": str(args.json)}, "levels": rows},
                indent=2,
                default=str,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
