"""What a gateway's periodic reads of Redis cost as Redis fills with other keys.

    python -m bench.keyspace [--url redis://127.0.0.1:6379/14] [--keys 10000 200000]

A running system holds keys per request (run hashes, emitted tokens, sent tallies,
status records, admission markers that live 10 minutes), so its keyspace grows with
its load. Every gateway reads the worker registry each second and sweeps for dead
gateways' requests every 5 s. Both read sets (``names.WORKER_SET``,
``names.GATEWAY_SET``); the reference row is a SCAN of the keyspace for the same
keys, as a pattern match must. For each size the database is filled with that many
other keys and 16 workers beat; it prints per read the wall time, this process's CPU
and Redis's time (``INFO commandstats``). The database is emptied before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import redis
import redis.asyncio as aioredis

from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role

WORKERS = 16
READS = 20


def fill(client: redis.Redis, keys: int) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.set(f"{names.PREFIX}:run:aggregated:bench-{i}", b"x")
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()


async def per_read(
    sync: redis.Redis, read: Callable[[], Awaitable[object]]
) -> tuple[float, float, float]:
    """Wall ms, client CPU ms and Redis ms per read, averaged over READS reads."""
    await read()
    sync.config_resetstat()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(READS):
        await read()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    stats = sync.info("commandstats")
    redis_us = sum(v["usec"] for k, v in stats.items() if k != "cmdstat_config")
    return wall * 1000 / READS, cpu * 1000 / READS, redis_us / 1000 / READS


async def measure(url: str, keys: int) -> None:
    sync = redis.Redis.from_url(url)
    client = aioredis.Redis.from_url(url)
    try:
        sync.flushdb()
        fill(sync, keys)
        registry = WorkerRegistry(client, ttl_s=60)
        for n in range(WORKERS):
            await registry.beat(
                WorkerRegistration(
                    worker_id=f"aggregated-bench-{n}-x",
                    role=Role.AGGREGATED,
                    model="bench",
                    max_model_len=1,
                    active=0,
                    slots=1,
                )
            )
        await client.sadd(names.GATEWAY_SET, "gw-bench")

        async def scan_registry() -> object:
            found = [k async for k in client.scan_iter(names.worker_heartbeat("*"), 500)]
            return await client.mget(found) if found else []

        async def gateways() -> object:
            return await client.smembers(names.GATEWAY_SET)

        rows = [
            ("worker registry, the set", registry.live_workers),
            ("worker registry, SCAN (reference)", scan_registry),
            ("gateways with open requests, the set", gateways),
        ]
        for name, read in rows:
            wall, cpu, at_redis = await per_read(sync, read)
            print(
                f"{keys:>9,} other keys  {name:38s} wall {wall:8.2f} ms  "
                f"client CPU {cpu:7.2f} ms  Redis {at_redis:7.2f} ms",
                flush=True,
            )
    finally:
        sync.flushdb()
        sync.close()
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.keyspace", description=__doc__)
    parser.add_argument("--url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--keys", type=int, nargs="+", default=[10_000, 200_000])
    args = parser.parse_args()
    for keys in args.keys:
        asyncio.run(measure(args.url, keys))


if __name__ == "__main__":
    main()
