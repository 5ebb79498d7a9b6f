"""The pieces of a Conveyor cluster without a model, for bench.redis_capacity.

Worker processes run the real worker runtime (``workers.assembly.build_worker``) around
the tests' scripted FakeEngine; the gateway side is the gateway's own queue parts
(``JobQueue.submit`` with its admission script, ``ReplyRouter`` on one reply stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from gateway.dispatch.reply_router import ReplyRouter, StreamInterrupted
from shared.protocol import FinishEvent, GenerateJob, SamplingOptions, TokenEvent
from shared.queue import names
from shared.queue.job_queue import JobQueue
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


async def run_worker(url: str, slots: int, tokens: int, step_s: float) -> None:
    from shared.connections.connect import connect
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


@dataclass
class Tally:
    jobs: int = 0
    tokens: int = 0
    errors: int = 0


class Load:
    """Keeps ``concurrency`` requests in flight through the gateway's own queue parts."""

    def __init__(self, client: aioredis.Redis, max_tokens: int, prompt_tokens: int) -> None:
        self.client = client
        self.queue = JobQueue(client)
        self.router = ReplyRouter(client, names.reply_stream(GATEWAY))
        self.stream = names.job_stream(MODEL, Role.AGGREGATED)
        self.max_tokens = max_tokens
        self.prompt = [1000 + i % 30_000 for i in range(prompt_tokens)]  # 3 msgpack bytes each
        self.tally = Tally()
        self.in_flight = 0

    def job(self, request_id: str) -> GenerateJob:
        now = time.time()
        return GenerateJob(
            request_id=request_id,
            index=0,
            model=MODEL,
            prompt_token_ids=self.prompt,
            sampling=SamplingOptions(max_tokens=self.max_tokens),
            reply_to=self.router.stream,
            deadline_unix=now + 600,
            created_unix=now,
        )

    async def one(self) -> None:
        request_id = uuid.uuid4().hex
        replies = self.router.open(request_id)
        job = self.job(request_id)
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
        await client.set(names.gateway_heartbeat(GATEWAY), b"1", ex=10)
        await asyncio.sleep(1)


def start_workers(url: str, count: int, slots: int, tokens: int, step_s: float) -> list[Any]:
    """``count`` worker processes, each with ``slots`` slots; every job streams ``tokens``
    tokens, one per ``step_s``."""
    command = [sys.executable, "-m", "bench.fake_cluster", url]
    command += [str(slots), str(tokens), str(step_s)]
    return [subprocess.Popen(command) for _ in range(count)]


def wait_for_workers(url: str, count: int) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 120
    while len(list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} fake-engine workers did not start")
        time.sleep(0.2)
    client.close()


def stop_workers(workers: list[Any]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.wait(30)


if __name__ == "__main__":  # one worker process: URL SLOTS TOKENS STEP_S
    url, slots, tokens, step_s = sys.argv[1:5]
    asyncio.run(run_worker(url, int(slots), int(tokens), float(step_s)))
