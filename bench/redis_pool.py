"""Client CPU per Redis command with each connection pool (shared/connections/pool.py's reason).

    python -m bench.redis_pool [--url redis://127.0.0.1:6379/15] [--commands 5000]

Runs ``GET`` one at a time and 32 at once through redis-py's ``BlockingConnectionPool``,
its plain ``ConnectionPool`` (which fails past ``max_connections``) and Conveyor's
``BoundedConnectionPool``, rounds interleaved, and prints the median process CPU per
command. CPU time, not wall time: other load on the box moves it less.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import uvloop

from shared.connections.pool import BoundedConnectionPool

POOLS: dict[str, Callable[[str], aioredis.ConnectionPool]] = {
    "blocking (redis-py)": lambda url: aioredis.BlockingConnectionPool.from_url(
        url, max_connections=256, timeout=10
    ),
    "plain (redis-py)": lambda url: aioredis.ConnectionPool.from_url(url, max_connections=256),
    "bounded (conveyor)": lambda url: BoundedConnectionPool.from_url(
        url, max_connections=256, timeout=10
    ),
}


async def cpu_per_command_us(pool: aioredis.ConnectionPool, commands: int, at_once: int) -> float:
    client = aioredis.Redis.from_pool(pool)
    await client.set("conveyor:bench:pool", b"x")

    async def one_by_one(count: int) -> None:
        for _ in range(count):
            await client.get("conveyor:bench:pool")

    started = time.process_time()
    await asyncio.gather(*(one_by_one(commands // at_once) for _ in range(at_once)))
    spent = time.process_time() - started
    await client.aclose()
    return spent / commands * 1e6


async def run(url: str, commands: int, rounds: int) -> None:
    for at_once in (1, 32):
        results: dict[str, list[float]] = {name: [] for name in POOLS}
        for _ in range(rounds):
            for name, make in POOLS.items():
                results[name].append(await cpu_per_command_us(make(url), commands, at_once))
        print(f"GET, {at_once} at a time: median client CPU per command over {rounds} rounds")
        for name, values in results.items():
            print(f"  {name:22s} {statistics.median(values):7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--commands", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    uvloop.run(run(args.url, args.commands, args.rounds))


if __name__ == "__main__":
    main()
