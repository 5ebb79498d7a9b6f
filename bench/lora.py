"""LoRA numbers: adapter load time, and throughput of a 50/50 base/adapter mix vs base only.

Starts one real `conveyor worker` (vLLM) on the demo model and drives it through Redis as
the gateway does: desired adapters via shared/queue/lora_registry.py, jobs on the model's and the
adapters' streams, tokens read off a reply stream. Closed loop: ``--concurrency``
requests in flight, each ``--max-tokens`` tokens (EOS ignored). It FLUSHES the Redis
database of ``--redis-url``.

    .venv/bin/python -m bench.lora [--requests 256 --concurrency 32 --lora-off]

``--lora-off`` also measures base-only traffic on a worker started with
CONVEYOR_ENABLE_LORA=false (what enabling LoRA costs base requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.demo.lora import write_demo_lora
from shared.demo.model import write_demo_model
from shared.protocol import ErrorEvent, FinishEvent, GenerateJob, SamplingOptions, decode_events
from shared.queue import names
from shared.queue.job_queue import JobQueue
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import LOADED, LoraSpec, adapter_stream, publish_desired
from shared.roles import Role

MODEL = "bench-tiny"
GATEWAY = "gw-bench-lora"
LOADED_LOG = re.compile(r"adapter (\S+) ready in ([0-9.]+)s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/10",
        help="a Redis database this benchmark may FLUSH",
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4, help="adapters whose load is timed")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each mix, interleaved (median reported)"
    )
    parser.add_argument(
        "--lora-off",
        action="store_true",
        help="also run base-only traffic with LoRA disabled in the engine",
    )
    return parser


@contextlib.contextmanager
def worker(model: Path, redis_url: str, log: Path, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """One `conveyor worker` in its own session; SIGTERM, then SIGKILL its group."""
    full_env = {
        **os.environ,
        "CONVEYOR_MODEL": str(model),
        "CONVEYOR_SERVED_MODEL_NAME": MODEL,
        "CONVEYOR_REDIS_URL": redis_url,
        "CONVEYOR_DTYPE": "float32",
        "CONVEYOR_CANARY_IDLE_S": "3600",
        **env,
    }
    conveyor = str(Path(sys.executable).with_name("conveyor"))
    with log.open("ab") as out:
        process = subprocess.Popen(
            [conveyor, "worker"],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(40)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def registration(client: aioredis.Redis, pid: int) -> WorkerRegistration | None:
    found = [
        w for w in await WorkerRegistry(client, ttl_s=1).live_workers() if f"-{pid}-" in w.worker_id
    ]
    return found[0] if found else None


async def wait_ready(client: aioredis.Redis, process: subprocess.Popen[bytes]) -> None:
    while True:
        if process.poll() is not None:
            raise RuntimeError("the worker exited; see its log")
        entry = await registration(client, process.pid)
        if entry is not None and entry.ready:
            return
        await asyncio.sleep(0.2)


async def time_loads(client: aioredis.Redis, pid: int, specs: list[LoraSpec]) -> list[float]:
    """Seconds from publishing each adapter to the worker reporting it loaded."""
    seconds = []
    for count in range(1, len(specs) + 1):
        started = time.perf_counter()
        await publish_desired(client, MODEL, specs[:count])
        name = specs[count - 1].name
        while True:
            entry = await registration(client, pid)
            state = entry.adapters.get(name) if entry else None
            if state == LOADED:
                break
            if state and state.startswith("failed"):
                raise RuntimeError(f"{name}: {state}")
            await asyncio.sleep(0.005)
        seconds.append(time.perf_counter() - started)
    return seconds


class Driver:
    """Closed-loop load straight onto the job streams; one reply-stream reader."""

    def __init__(self, client: aioredis.Redis, args: argparse.Namespace) -> None:
        self._client = client
        self._queue = JobQueue(client)
        self._args = args
        self._waiting: dict[str, asyncio.Future[int]] = {}
        self._reply = names.reply_stream(GATEWAY)
        self._stop = asyncio.Event()

    async def run(self, adapters: list[str | None]) -> tuple[float, int]:
        """(seconds, output tokens) for ``--requests`` requests cycling over ``adapters``."""
        self._stop.clear()
        reader = asyncio.create_task(self._read())
        plan = iter(adapters[i % len(adapters)] for i in range(self._args.requests))
        started = time.perf_counter()
        try:
            counts = await asyncio.gather(
                *(self._loop(plan) for _ in range(self._args.concurrency))
            )
        finally:
            # Not reader.cancel(): redis-py may swallow a cancel during a blocking read.
            self._stop.set()
            await reader
        return time.perf_counter() - started, sum(counts)

    async def _loop(self, plan: Iterator[str | None]) -> int:
        tokens = 0
        for adapter in plan:
            tokens += await self._one(adapter)
        return tokens

    async def _one(self, adapter: str | None) -> int:
        now = time.time()
        prompt = [1, *(random.randrange(10, 4000) for _ in range(self._args.prompt_tokens - 1))]
        job = GenerateJob(
            request_id=uuid.uuid4().hex,
            index=0,
            model=adapter or MODEL,
            prompt_token_ids=prompt,
            reply_to=self._reply,
            deadline_unix=now + 600,
            created_unix=now,
            adapter=adapter,
            sampling=SamplingOptions(
                max_tokens=self._args.max_tokens, temperature=0, ignore_eos=True
            ),
        )
        future = self._waiting[job.request_id] = asyncio.get_running_loop().create_future()
        stream = adapter_stream(adapter) if adapter else names.job_stream(MODEL, Role.AGGREGATED)
        await self._queue.submit(stream, [job], max_depth=100_000)
        return int(await future)

    async def _read(self) -> None:
        newest: Any = await self._client.xrevrange(self._reply, count=1)
        last: Any = newest[0][0] if newest else "0-0"
        while not self._stop.is_set():
            try:
                reply: Any = await self._client.xread({self._reply: last}, block=1000, count=1000)
            except RedisError as exc:
                print(f"reply read failed ({exc}); again", file=sys.stderr)
                await asyncio.sleep(0.1)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    for event in decode_events(fields):
                        self._settle(event)

    def _settle(self, event: object) -> None:
        if isinstance(event, FinishEvent | ErrorEvent):
            future = self._waiting.pop(event.request_id, None)
            if future is None or future.done():
                return
            if isinstance(event, ErrorEvent):
                future.set_exception(RuntimeError(event.message))
            else:
                future.set_result(event.completion_tokens)


Run = tuple[float, int]
"""(seconds, output tokens)."""


def median(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda run: run[1] / run[0])[len(runs) // 2]


async def measure(
    args: argparse.Namespace, model: Path, specs: list[LoraSpec], log: Path, **env: str
) -> dict[str, Run]:
    client = aioredis.Redis.from_url(args.redis_url)
    await client.flushdb()
    await client.set(names.gateway_heartbeat(GATEWAY), b"1", ex=3600)
    results: dict[str, Run] = {}
    try:
        with worker(model, args.redis_url, log, **env) as process:
            await wait_ready(client, process)
            driver = Driver(client, args)
            await driver.run([None])  # warm-up
            if env.get("CONVEYOR_ENABLE_LORA") == "false":
                runs = [await driver.run([None]) for _ in range(args.rounds)]
                results["base only, LoRA off"] = median(runs)
                return results
            loads = await time_loads(client, process.pid, specs)
            results["load"] = (sum(loads) / len(loads), len(loads))
            await driver.run([None, specs[0].name])  # warm-up with an adapter
            mixes: dict[str, list[str | None]] = {
                "base only": [None],
                "50/50 base + 1 adapter": [None, specs[0].name],
                "50/50 base + 2 adapters": [None, specs[0].name, None, specs[1].name],
            }
            rounds: dict[str, list[Run]] = {name: [] for name in mixes}
            for _ in range(args.rounds):  # interleaved: background load hits each mix alike
                for name, mix in mixes.items():
                    rounds[name].append(await driver.run(mix))
            results.update({name: median(runs) for name, runs in rounds.items()})
    finally:
        await client.aclose()
    return results


def report(results: dict[str, Run], log: Path, args: argparse.Namespace) -> None:
    engine_loads = [float(m[2]) for m in LOADED_LOG.finditer(log.read_text(errors="replace"))]
    if "load" in results:
        mean_s, count = results.pop("load")
        print(
            f"adapter load, registered -> registry says loaded: {mean_s * 1000:.0f} ms mean over "
            f"{count} (includes the worker's 250 ms poll and up to one heartbeat)"
        )
    if engine_loads:
        print(
            f"adapter load in the worker (folder check + add_lora + stream): "
            f"{sum(engine_loads) / len(engine_loads) * 1000:.1f} ms mean over {len(engine_loads)}"
        )
    print(
        f"{args.requests} requests, {args.concurrency} in flight, {args.prompt_tokens} prompt "
        f"+ {args.max_tokens} output tokens each:"
    )
    for name, (seconds, tokens) in results.items():
        print(
            f"  {name:28s} {tokens / seconds:8.0f} output tok/s  "
            f"{args.requests / seconds:6.1f} req/s"
        )


async def main_async(args: argparse.Namespace) -> int:
    folder = Path(tempfile.mkdtemp(prefix="conveyor-bench-lora-"))
    model = write_demo_model(folder / "model")
    specs = [
        LoraSpec(
            name=f"bench-a{i}",
            base_model=MODEL,
            path=str(write_demo_lora(folder / f"a{i}", base=model, seed=i)),
        )
        for i in range(max(2, args.adapters))
    ]
    log = folder / "worker.log"
    results = await measure(
        args,
        model,
        specs,
        log,
        CONVEYOR_ENABLE_LORA="true",
        CONVEYOR_MAX_LORAS="2",
        CONVEYOR_MAX_LORA_RANK="8",
    )
    if args.lora_off:
        results.update(
            await measure(
                args, model, specs, folder / "worker-off.log", CONVEYOR_ENABLE_LORA="false"
            )
        )
    report(results, log, args)
    print(f"(worker logs in {folder})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
