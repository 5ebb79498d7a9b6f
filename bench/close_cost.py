"""Client CPU to close a request: :meth:`OpenRequests.close` (one script call) against the
same commands as a MULTI (what it sent before).

    python -m bench.close_cost [--url redis://127.0.0.1:6379/15] [--closes 3000] [--rounds 3]

A close queues the request's usage row on the ledger stream, forgets it in its gateway's
open-requests hash, drops its sent tally and marks its status record finished. Rounds
alternate; the median process CPU per close is printed (CPU time, not wall time: other
load on the box moves it less). Give it a Redis db of its own: it refuses one that holds a
usage stream already, and deletes the stream and the records it made after.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import uvloop

from shared.connections.connect import connect
from shared.queue import names
from shared.queue.open_requests import STATUS_FINISHED_TTL_S, OpenRequests, finish_note_of
from shared.queue.usage import UsageRecord, encode_usage

GATEWAY = "bench-close"

Close = Callable[[UsageRecord], Awaitable[None]]


def record(n: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"bench-close-{n}",
        key_id=None,
        model="bench",
        prompt_tokens=128,
        completion_tokens=64,
        status="completed",
        finish_reason="length",
        received_unix=time.time(),
        finished_unix=time.time(),
    )


def as_multi(redis: aioredis.Redis) -> Close:
    async def close(usage: UsageRecord) -> None:
        status = names.request_status(usage.request_id)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.xadd(names.USAGE_STREAM, encode_usage(usage))  # type: ignore[arg-type]
            pipe.hdel(names.open_requests(GATEWAY), usage.request_id)
            pipe.delete(names.sent_tally(usage.request_id))
            pipe.hset(status, "f", finish_note_of(usage))
            pipe.expire(status, STATUS_FINISHED_TTL_S)
            await pipe.execute()

    return close


def as_script(redis: aioredis.Redis) -> Close:
    book = OpenRequests(redis)

    async def close(usage: UsageRecord) -> None:
        await book.close(GATEWAY, usage)

    return close


async def cpu_per_close_us(close: Close, closes: int) -> float:
    started = time.process_time()
    for n in range(closes):
        await close(record(n))
    return (time.process_time() - started) / closes * 1e6


async def run(url: str, closes: int, rounds: int) -> None:
    redis = connect(url)
    if await redis.exists(names.USAGE_STREAM):
        await redis.aclose()
        raise SystemExit(f"{url} holds a usage stream: give the benchmark an empty Redis db")
    ways = {"MULTI": as_multi(redis), "script": as_script(redis)}
    results: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for _ in range(rounds):
            for name, close in ways.items():
                results[name].append(await cpu_per_close_us(close, closes))
    finally:
        await redis.delete(names.USAGE_STREAM)
        await redis.delete(*(names.request_status(record(n).request_id) for n in range(closes)))
        await redis.aclose()
    print(f"one request closed at a time: median client CPU per close over {rounds} rounds")
    for name, values in results.items():
        spread = ", ".join(f"{v:.0f}" for v in values)
        print(f"  {name:7s} {statistics.median(values):7.1f} us  (rounds: {spread})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--closes", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    uvloop.run(run(args.url, args.closes, args.rounds))


if __name__ == "__main__":
    main()
