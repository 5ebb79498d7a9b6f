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
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench.fake_cluster import (
    Load,
    gateway_alive,
    start_redis,
    start_workers,
    stop_workers,
    wait_for_workers,
)
from shared.connections.connect import connect
from shared.queue import names
from shared.queue.job_queue import JobQueue
from shared.roles import Role


def redis_cpu(client: redis.Redis) -> float:
    """Seconds of CPU Redis's main thread (the one that runs commands) has used."""
    info: dict[str, Any] = client.info("cpu")
    main = info.get("used_cpu_sys_main_thread", info["used_cpu_sys"])
    return float(main) + float(info.get("used_cpu_user_main_thread", info["used_cpu_user"]))


# ------------------------------------------------------------------ phases


async def throughput(
    url: str, *, concurrency: int, max_tokens: int, prompt_tokens: int, seconds: float
) -> None:
    client = connect(url)
    sync = redis.Redis.from_url(url)
    load = Load(client, max_tokens, prompt_tokens)
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


async def memory(url: str, *, requests: int, prompt_tokens: int, seconds: float) -> None:
    """Redis's memory for ``requests`` queued jobs, then for as many running streams."""
    client = connect(url)  # the gateway's own pool (256 connections), not one per request
    sync = redis.Redis.from_url(url)
    load = Load(client, 100_000, prompt_tokens)
    await load.queue.ensure_group(load.stream)
    base = dataset_bytes(sync)
    idle = JobQueue(client)
    jobs = [load.job(uuid.uuid4().hex) for _ in range(requests)]
    for job in jobs:  # a model no worker serves: the jobs stay queued
        await idle.submit(names.job_stream("idle-model", Role.AGGREGATED), [job], max_depth=10**6)
    queued = dataset_bytes(sync) - base
    await client.delete(names.job_stream("idle-model", Role.AGGREGATED))
    print(f"  {requests} queued jobs: {queued / requests * 1000 / 2**20:.2f} MiB per 1k")
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(load.router.run()),
        asyncio.create_task(gateway_alive(client, stop)),
    ]
    tasks += [asyncio.create_task(load.one()) for _ in range(requests)]
    await all_running(sync, load.stream, requests)
    samples = []
    for _ in range(int(seconds)):
        await asyncio.sleep(1)
        samples.append((load.tally.tokens, dataset_bytes(sync) - base))
    per_token, at_zero = fit_line(samples)
    print(
        f"  {requests} running streams: {at_zero / requests * 1000 / 2**20:.2f} MiB per 1k, "
        f"plus {per_token:.0f} B per streamed token kept (reply-stream history, ~120 s; "
        f"{samples[-1][0]} tokens streamed: +{samples[-1][1] / 2**20:.1f} MiB in all)"
    )
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    sync.close()
    await client.aclose()


async def all_running(client: redis.Redis, stream: str, count: int) -> None:
    """Every job is leased by a worker (pending in the group), none still queued."""
    for _ in range(1200):
        pending: dict[str, Any] = client.xpending(stream, names.JOB_GROUP)  # type: ignore[assignment]
        if int(pending["pending"]) >= count:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{count} jobs never all ran")


def dataset_bytes(client: redis.Redis) -> int:
    """used_memory without client buffers (connections are the gateway's, not per job)."""
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares y = slope * x + intercept."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points) or 1.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--memory-requests", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of every job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server, url = start_redis(Path(folder))
        try:
            run_phases(url, args)
        finally:
            server.terminate()
            server.wait(10)
    return 0


def run_phases(url: str, args: argparse.Namespace) -> None:
    print(
        f"one Redis (AOF everysec, noeviction), {args.workers} fake-engine workers, "
        f"{args.prompt_tokens}-token prompts:"
    )
    for tokens, concurrency in ((1, 256), (64, 128)):
        redis.Redis.from_url(url).flushdb()
        workers = start_workers(url, args.workers, 256, tokens, 0.0)
        try:
            wait_for_workers(url, args.workers)
            asyncio.run(
                throughput(
                    url,
                    concurrency=concurrency,
                    max_tokens=tokens,
                    prompt_tokens=args.prompt_tokens,
                    seconds=args.seconds,
                )
            )
        finally:
            stop_workers(workers)
    print("memory:")
    redis.Redis.from_url(url).flushdb()
    slots = -(-args.memory_requests // args.workers)
    workers = start_workers(url, args.workers, slots, 100_000, 0.05)
    try:
        wait_for_workers(url, args.workers)
        asyncio.run(
            memory(
                url,
                requests=args.memory_requests,
                prompt_tokens=args.prompt_tokens,
                seconds=args.seconds,
            )
        )
    finally:
        stop_workers(workers)


if __name__ == "__main__":
    sys.exit(main())
