"""What one engine step's journal write costs Redis and the worker, per token.

Drives the real run journal (workers/journal/run_journal.py) as a worker's engine loop
does: ``--jobs`` leased jobs, then ``--steps`` steps of one token event each, every step
one script call. Prints, per row (one job's token in one step), Redis's CPU (from
``INFO cpu``), the time inside the journal script (``INFO commandstats``, wall time,
the calls it makes included) and the calls it made, and the worker's CPU. ``--step-ms``
pauses before every step, as an engine's step time does in a run: after a pause both
start on cold caches, and a row costs more.

Needs a Redis of its own (it resets the command stats and flushes the database)::

    redis-server --port 6412 --save '' --appendonly no --daemonize yes
    python -m bench.journal_cost --redis-url redis://127.0.0.1:6412/0
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.connections.connect import connect
from shared.protocol import GenerateJob, SamplingOptions, TokenEvent
from shared.queue import names
from shared.queue.job_queue import Delivery, JobQueue, JobStream
from shared.roles import Role
from workers.journal.run_journal import RunJournal, RunLease

STAGE = Role.AGGREGATED
POOL = JobStream("journal-cost", STAGE)
REPLY = names.reply_stream("gw-journal-cost")
TEXTS = (" the", " serving", " path", ",", " token", " by", " token", ".")


@dataclass(frozen=True, slots=True)
class Costs:
    rows: int
    redis_cpu_us: float
    script_us: float
    calls: dict[str, int]
    worker_cpu_us: float

    def line(self) -> str:
        per_row = ", ".join(f"{name} {count / self.rows:.2f}" for name, count in self.calls.items())
        return (
            f"{self.rows} rows: Redis CPU {self.redis_cpu_us / self.rows:.2f} µs/row, "
            f"in the script {self.script_us / self.rows:.2f} µs/row, "
            f"worker CPU {self.worker_cpu_us / self.rows:.2f} µs/row; calls per row: {per_row}"
        )


async def _redis_cpu_us(redis: aioredis.Redis) -> float:
    cpu: Any = await redis.info("cpu")
    return (float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])) * 1e6


async def _command_stats(redis: aioredis.Redis) -> dict[str, dict[str, float]]:
    stats: Any = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): values for name, values in stats.items()}


async def _leases(redis: aioredis.Redis, journal: RunJournal, jobs: int) -> list[RunLease]:
    queue = JobQueue(redis)
    await queue.ensure_group(POOL.name)
    now = time.time()
    submitted = [
        GenerateJob(
            request_id=f"cmpl-cost-{i}",
            index=0,
            model=POOL.model,
            prompt_token_ids=[1, 2, 3],
            sampling=SamplingOptions(max_tokens=1 << 20),
            reply_to=REPLY,
            deadline_unix=now + 3600,
            created_unix=now,
        )
        for i in range(jobs)
    ]
    await queue.submit(POOL.name, submitted, max_depth=jobs)
    deliveries: list[Delivery] = await queue.read([POOL], "w-cost", count=jobs, block_ms=1000)
    return await journal.begin_all(deliveries)


async def _steps(
    journal: RunJournal, leases: list[RunLease], steps: int, first: int, pause_s: float = 0.0
) -> None:
    for step in range(first, first + steps):
        if pause_s:
            await asyncio.sleep(pause_s)
        for lease in leases:
            job = lease.delivery.job
            token = 1000 + step % 3000
            event = TokenEvent(
                job.request_id,
                job.index,
                lease.take_seq(),
                lease.attempt,
                [token],
                TEXTS[step % len(TEXTS)],
            )
            journal.publish(lease, event, [token])
        await journal.flush()


async def measure(redis_url: str, jobs: int, steps: int, pause_s: float = 0.0) -> Costs:
    redis = connect(redis_url)
    await redis.flushdb()
    journal = RunJournal(redis, consumer="w-cost")
    writer = asyncio.create_task(journal.run())
    try:
        leases = await _leases(redis, journal, jobs)
        await _steps(journal, leases, 10, 0)  # warm: scripts loaded, connection open
        await redis.config_resetstat()
        redis_before = await _redis_cpu_us(redis)
        worker_before = time.process_time()
        await _steps(journal, leases, steps, 10, pause_s)
        worker_us = (time.process_time() - worker_before) * 1e6
        redis_us = await _redis_cpu_us(redis) - redis_before
        stats = await _command_stats(redis)
    finally:
        writer.cancel()
        await redis.aclose()
    inner = ("hmget", "hincrby", "append", "hset", "xadd")
    return Costs(
        rows=jobs * steps,
        redis_cpu_us=redis_us,
        script_us=float(stats.get("evalsha", {}).get("usec", 0)),
        calls={name: int(stats.get(name, {}).get("calls", 0)) for name in inner},
        worker_cpu_us=worker_us,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--jobs", type=int, default=128, help="rows per step (sequences)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="a pause before every step, as an engine's"
    )
    args = parser.parse_args()
    for _ in range(args.rounds):
        costs = asyncio.run(measure(args.redis_url, args.jobs, args.steps, args.step_ms / 1000))
        print(costs.line(), flush=True)


if __name__ == "__main__":
    main()
