"""How far one Redis goes: jobs/s, streamed tokens/s and memory per 1k in-flight requests.

    flock /tmp/conveyor-bench.lock python -m bench.redis_capacity

No model and no HTTP: real worker runtimes (``workers.assembly.build_worker``, in
processes of their own) around the tests' scripted FakeEngine, and a gateway side made
of the gateway's own parts (``JobQueue.submit``, the admission script, and
``ReplyRouter`` on one reply stream). The Redis is a private redis-server started with
compose.yaml's settings (AOF everysec, noeviction). Each phase prints what the clients
achieved and what Redis's main thread spent per job and per token: Redis runs commands
on one thread, so 1 / (its CPU per job) is the ceiling one Redis can reach, whatever
this (small, shared) machine's clients could drive.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.job_queue import JobQueue
from shared.protocol import FinishEvent, GenerateJob, SamplingOptions, TokenEvent
from shared.reply_stream import ReplyRouter, StreamInterrupted
from shared.roles import Role

MODEL = "fake-model"
GATEWAY = "gw-bench"


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = ["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
    flags += ["--maxmemory-policy", "noeviction", "--dir", str(folder)]
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), *flags], stdout=subprocess.DEVNULL
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return process, f"redis://127.0.0.1:{port}/0"


# ------------------------------------------------------------------ worker process


async def run_worker(url: str, slots: int, tokens: int, step_s: float) -> None:
    from shared.redis_conn import connect
    from shared.settings import Settings
    from tests.unit.worker_harness import FakeEngine
    from workers.assembly import WorkerPolicy, build_worker
    from workers.roles import generate

    engine = FakeEngine(tokens=tokens, step_s=step_s)
    client = connect(url)
    policy = dataclasses.replace(WorkerPolicy.from_settings(Settings()), max_slots=slots)
    runtime = build_worker(
        worker_id=f"bench-{os.getpid()}",
        role=Role.AGGREGATED,
        model=MODEL,
        parts=generate.parts(engine, None),
        redis=client,
        policy=policy,
        heartbeat_redis_url=url,
    )
    await runtime.run()


# ------------------------------------------------------------------ gateway side


@dataclass
class Tally:
    jobs: int = 0
    tokens: int = 0
    errors: int = 0


class Load:
    """Keeps ``concurrency`` requests in flight through the gateway's own queue parts."""

    def __init__(self, client: aioredis.Redis, max_tokens: int) -> None:
        self.client = client
        self.queue = JobQueue(client)
        self.router = ReplyRouter(client, keys.reply_stream(GATEWAY))
        self.stream = keys.job_stream(MODEL, Role.AGGREGATED)
        self.max_tokens = max_tokens
        self.tally = Tally()
        self.in_flight = 0

    async def one(self) -> None:
        request_id = uuid.uuid4().hex
        replies = self.router.open(request_id)
        now = time.time()
        job = GenerateJob(
            request_id=request_id,
            index=0,
            model=MODEL,
            prompt_token_ids=[1, 2, 3],
            sampling=SamplingOptions(max_tokens=self.max_tokens),
            reply_to=self.router.stream,
            deadline_unix=now + 600,
            created_unix=now,
        )
        self.in_flight += 1
        try:
            result = await self.queue.submit(self.stream, [job], max_depth=1_000_000)
            if result.outcome.value != "queued":
                self.tally.errors += 1
                return
            while True:
                event = await replies.get()
                if isinstance(event, TokenEvent):
                    self.tally.tokens += len(event.token_ids)
                elif isinstance(event, FinishEvent):
                    self.tally.jobs += 1
                    return
                elif isinstance(event, StreamInterrupted) or event is not None:
                    self.tally.errors += 1
                    return
        finally:
            self.in_flight -= 1
            self.router.close(request_id)

    async def keep(self, concurrency: int, stop: asyncio.Event) -> None:
        async def lane() -> None:
            while not stop.is_set():
                await self.one()

        await asyncio.gather(*(lane() for _ in range(concurrency)))


async def gateway_alive(client: aioredis.Redis, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await client.set(keys.gateway_heartbeat(GATEWAY), b"1", ex=10)
        await asyncio.sleep(1)


def redis_cpu(client: redis.Redis) -> float:
    """Seconds of CPU Redis's main thread (the one that runs commands) has used."""
    info: dict[str, Any] = client.info("cpu")
    main = info.get("used_cpu_sys_main_thread", info["used_cpu_sys"])
    return float(main) + float(info.get("used_cpu_user_main_thread", info["used_cpu_user"]))


# ------------------------------------------------------------------ phases


async def throughput(url: str, *, concurrency: int, max_tokens: int, seconds: float) -> None:
    client = aioredis.Redis.from_url(url, max_connections=concurrency + 16)
    sync = redis.Redis.from_url(url)
    load = Load(client, max_tokens)
    await load.queue.ensure_group(load.stream)
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(load.router.run()),
        asyncio.create_task(gateway_alive(client, stop)),
        asyncio.create_task(load.keep(concurrency, stop)),
    ]
    await asyncio.sleep(2)  # warm-up
    start, cpu0, tally0 = time.monotonic(), redis_cpu(sync), dataclasses.replace(load.tally)
    await asyncio.sleep(seconds)
    elapsed, cpu = time.monotonic() - start, redis_cpu(sync) - cpu0
    jobs, tokens = load.tally.jobs - tally0.jobs, load.tally.tokens - tally0.tokens
    stop.set()
    await asyncio.wait_for(tasks[2], 60)
    for task in tasks[:2]:
        task.cancel()
    print(
        f"  {max_tokens:>4} tokens/job, {concurrency:>4} in flight: "
        f"{jobs / elapsed:8.0f} jobs/s {tokens / elapsed:9.0f} tokens/s | Redis main thread "
        f"{cpu / elapsed * 100:4.0f}% busy, {cpu / max(jobs, 1) * 1e6:6.1f} us/job -> "
        f"ceiling ~{jobs / max(cpu, 1e-9):8.0f} jobs/s, ~{tokens / max(cpu, 1e-9):9.0f} tokens/s"
        f" | errors {load.tally.errors}"
    )
    sync.close()
    await client.aclose()


async def memory(url: str, *, requests: int, seconds: float) -> None:
    """``requests`` streams at once, slow tokens: Redis's memory as they run."""
    client = aioredis.Redis.from_url(url, max_connections=requests + 16)
    sync = redis.Redis.from_url(url)
    load = Load(client, max_tokens=100_000)
    await load.queue.ensure_group(load.stream)
    base = int(sync.info("memory")["used_memory"])
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(load.router.run()),
        asyncio.create_task(gateway_alive(client, stop)),
    ]
    lanes = [asyncio.create_task(load.one()) for _ in range(requests)]
    samples = []
    for _ in range(int(seconds)):
        await asyncio.sleep(1)
        used = int(sync.info("memory")["used_memory"]) - base
        samples.append((load.in_flight, load.tally.tokens, used))
    flight, tokens, used = samples[-1]
    early = next(s for s in samples if s[1] > 0)
    per_token = (used - early[2]) / max(tokens - early[1], 1)
    per_job = (used - per_token * tokens) / max(flight, 1)
    print(
        f"  {flight} in flight, {tokens} tokens streamed: Redis +{used / 2**20:.1f} MiB -> "
        f"~{per_job * 1000 / 2**20:.2f} MiB per 1k requests + {per_token:.0f} B per token "
        f"still kept (reply streams keep ~120 s of history)"
    )
    stop.set()
    for task in [*lanes, *tasks]:
        task.cancel()
    sync.close()
    await client.aclose()


def start_workers(url: str, count: int, slots: int, tokens: int, step_s: float) -> list[Any]:
    command = [sys.executable, "-m", "bench.redis_capacity", "--worker", url]
    command += ["--slots", str(slots), "--tokens", str(tokens), "--step-s", str(step_s)]
    return [subprocess.Popen(command) for _ in range(count)]


def wait_for_workers(url: str, count: int) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 120
    while len(list(client.scan_iter(keys.WORKER_HEARTBEAT_PATTERN))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} fake-engine workers did not start")
        time.sleep(0.2)
    client.close()


def stop_workers(workers: list[Any]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--memory-requests", type=int, default=1000)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--slots", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(run_worker(args.worker, args.slots, args.tokens, args.step_s))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        server, url = start_redis(Path(folder))
        try:
            run_phases(url, args)
        finally:
            server.terminate()
            server.wait(10)
    return 0


def run_phases(url: str, args: argparse.Namespace) -> None:
    print(f"one Redis (AOF everysec, noeviction), {args.workers} fake-engine workers:")
    for tokens, concurrency in ((1, 256), (64, 128)):
        redis.Redis.from_url(url).flushdb()
        workers = start_workers(url, args.workers, 256, tokens, 0.0)
        try:
            wait_for_workers(url, args.workers)
            asyncio.run(
                throughput(url, concurrency=concurrency, max_tokens=tokens, seconds=args.seconds)
            )
        finally:
            stop_workers(workers)
    print("memory:")
    redis.Redis.from_url(url).flushdb()
    slots = -(-args.memory_requests // args.workers)
    workers = start_workers(url, args.workers, slots, 100_000, 0.05)
    try:
        wait_for_workers(url, args.workers)
        asyncio.run(memory(url, requests=args.memory_requests, seconds=max(args.seconds, 10)))
    finally:
        stop_workers(workers)


if __name__ == "__main__":
    sys.exit(main())
