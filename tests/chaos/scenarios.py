"""Fault scenarios: each runs a streaming load, injects one fault mid-stream, and reports."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx

from shared.queue.liveness import forget_dead_process
from tests.chaos.checker import Report, check
from tests.chaos.cluster import Cluster
from tests.chaos.load import Record, prompts, run_load

MAX_TOKENS = 384
REQUESTS = 24
CONCURRENCY = 24
LOAD_TIMEOUT_S = 240.0
"""A request with no [DONE] by then counts as hung: generous, so a slow machine is not a hang."""

Fault = Callable[[Cluster], Awaitable[None]]


async def baseline(cluster: Cluster) -> dict[int, list[int]]:
    records = await run_load(
        cluster.base_url,
        prompts(REQUESTS),
        max_tokens=MAX_TOKENS,
        concurrency=CONCURRENCY,
        timeout_s=LOAD_TIMEOUT_S,
    )
    bad = [r for r in records if r.status != "completed"]
    if bad:
        raise RuntimeError(f"baseline had failures: {[(r.status, r.error) for r in bad][:3]}")
    return {r.prompt_index: r.tokens for r in records}


async def run_with_fault(
    cluster: Cluster, name: str, fault: Fault, reference: dict[int, list[int]]
) -> Report:
    load = asyncio.create_task(
        run_load(
            cluster.base_url,
            prompts(REQUESTS),
            max_tokens=MAX_TOKENS,
            concurrency=CONCURRENCY,
            timeout_s=LOAD_TIMEOUT_S,
        )
    )
    await _until_every_worker_streams(cluster)
    fault_at = time.monotonic()
    await fault(cluster)
    records: list[Record] = await load
    return check(name, records, reference, fault_at, OUTAGE_S.get(name, 0.0))


async def _until_every_worker_streams(cluster: Cluster, timeout_s: float = 60) -> None:
    """Inject faults mid-stream: wait until every worker runs jobs, then a little more.

    Pull balancing can hand one worker nearly all of a burst (a cold, just-restarted
    worker takes one job and finishes it), so after half a second it is enough that
    some worker streams: the fault then still lands mid-stream, not after the load.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        running = [int(str(w["engine_running"])) for w in cluster.live_workers()]
        if running and all(running):
            break
        if time.monotonic() - started > 0.5 and any(running):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # the whole load streams for ~3 s: land well inside it


# ------------------------------------------------------------------------ faults

RESTART_DELAY_S = 1.0
"""`conveyor up` restarts a dead worker after 1 s (then 2, 4, ... s): do the same."""


def _busiest_worker(cluster: Cluster) -> str:
    held = cluster.jobs_held()
    return max(held, key=lambda name: held[name])


async def kill_worker(cluster: Cluster) -> None:
    name = _busiest_worker(cluster)
    pid = cluster.workers[name].popen.pid
    cluster.workers[name].popen.send_signal(signal.SIGKILL)
    await asyncio.to_thread(cluster.workers[name].popen.wait)
    # What `conveyor up`'s supervisor does: no orphaned engine core, and the dead
    # worker leaves the registry so the others reclaim its jobs without waiting.
    cluster.workers[name].kill_group()
    forget_dead_process(cluster.redis_url, pid)
    await asyncio.sleep(RESTART_DELAY_S)
    cluster.start_worker(name)


async def term_worker(cluster: Cluster) -> None:
    name = _busiest_worker(cluster)
    cluster.workers[name].popen.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(cluster.workers[name].popen.wait)
    cluster.workers[name].kill_group()
    if code != 0:
        raise RuntimeError(f"SIGTERM'd worker exited {code}")
    await asyncio.sleep(RESTART_DELAY_S)
    cluster.start_worker(name)


async def stop_then_continue_worker(cluster: Cluster) -> None:
    """A zombie: frozen past the reclaim time, then resumed. It must not duplicate."""
    name = _busiest_worker(cluster)
    pid = cluster.workers[name].popen.pid
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(4.0)
    os.kill(pid, signal.SIGCONT)


async def kill_redis(cluster: Cluster) -> None:
    cluster.kill_redis()
    await asyncio.sleep(0.5)
    cluster.start_redis()


async def stall_redis(cluster: Cluster) -> None:
    client = cluster.redis_client()
    try:
        await asyncio.to_thread(client.execute_command, "DEBUG", "SLEEP", "3")
    finally:
        client.close()


async def kill_engine(cluster: Cluster) -> None:
    name = _busiest_worker(cluster)
    os.kill(cluster.engine_pid(name), signal.SIGKILL)
    code = await asyncio.to_thread(cluster.workers[name].popen.wait)
    cluster.workers[name].kill_group()
    if code == 0:
        raise RuntimeError("a worker whose engine died must exit non-zero")
    await asyncio.sleep(RESTART_DELAY_S)
    cluster.start_worker(name)


SCENARIOS: dict[str, Fault] = {
    "worker SIGKILL": kill_worker,
    "worker SIGTERM": term_worker,
    "worker SIGSTOP+SIGCONT": stop_then_continue_worker,
    "redis SIGKILL (AOF)": kill_redis,
    "redis stall (DEBUG SLEEP 3)": stall_redis,
    "engine process killed": kill_engine,
}

ENGINE_PROCESS_SCENARIOS = frozenset({"engine process killed"})
"""Scenarios that need an engine in a process of its own (vLLM's engine core); the fake
engine runs inside its worker."""

OUTAGE_S: dict[str, float] = {
    "redis SIGKILL (AOF)": 0.5,
    "redis stall (DEBUG SLEEP 3)": 3.0,
}
"""Downtime a fault imposes on purpose; recovery is counted from its end."""


# ------------------------------------------------------- load-shape scenarios


async def disconnect_storm(cluster: Cluster, requests: int = 1000) -> Report:
    records = await run_load(
        cluster.base_url,
        prompts(requests, seed=1),
        max_tokens=16,
        concurrency=64,
        disconnect_fraction=0.5,
        seed=1,
    )
    return check("client disconnect storm", records, {}, None)


async def overload(cluster: Cluster, factor: int = 10) -> Report:
    capacity = 32 * len(cluster.workers)
    records = await run_load(
        cluster.base_url,
        prompts(capacity * factor, seed=2),
        max_tokens=32,
        concurrency=capacity * factor,
        timeout_s=180,
    )
    return check(f"{factor}x overload", records, {}, None)


async def leftovers(cluster: Cluster, timeout_s: float = 15.0) -> dict[str, int]:
    """Everything a finished or abandoned request could leave behind; all must be 0."""
    from shared.queue import names
    from shared.roles import Role

    deadline = time.monotonic() + timeout_s
    while True:
        client = cluster.redis_client()
        try:
            stream = names.job_stream("chaos", Role.AGGREGATED)
            placed = client.scan_iter(names.worker_job_stream(stream, "*"))
            state = {
                "queued_or_running": int(client.xlen(stream)),
                "placed_queued_or_running": sum(int(client.xlen(key)) for key in placed),
                "pending_entries": int(client.xpending(stream, names.JOB_GROUP)["pending"]),
                "run_journals": len(list(client.scan_iter(names.RUN_PATTERN))),
                "engine_requests": sum(
                    int(str(w["engine_running"])) for w in cluster.live_workers()
                ),
                "worker_jobs": sum(int(str(w["active"])) for w in cluster.live_workers()),
            }
        finally:
            client.close()
        try:
            state["gateway_open_requests"] = int(str(cluster.admin_state()["open_requests"]))
        except httpx.HTTPError:
            state["gateway_open_requests"] = -1
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)
