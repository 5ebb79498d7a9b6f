"""LoRA adapters on a real vLLM worker, driven through Redis as the gateway drives it
(desired state via shared/queue/lora_registry.py, jobs on the adapters' own streams, admin commands
via shared/queue/worker_commands.py). tests/e2e/test_lora_gateway.py drives the same worker
through a real gateway.

The stack (tests/e2e/lora_stack.py, a session fixture): one worker with ``max_loras=2``
and three good adapters registered (more than fit in a step), plus three bad ones.
References come from vLLM's offline ``LLM.generate`` with the same ``LoRARequest``, one
prompt at a time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from shared.protocol import (
    ErrorEvent,
    FinishEvent,
    GenerateJob,
    SamplingOptions,
    TokenEvent,
    decode_events,
)
from shared.queue import names
from shared.queue.job_queue import JobQueue
from shared.queue.liveness import WorkerRegistration, WorkerRegistry, forget_dead_process
from shared.queue.lora_registry import LOADED, adapter_stream, failure_reason, publish_desired
from shared.queue.worker_commands import Command, CommandStatus, send_worker_command
from shared.roles import Role
from tests.e2e.lora_stack import (
    BAD,
    GOOD,
    LORA_REDIS_URL,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    REPLY,
    WORKER_ENV,
    LoraStack,
    registrations,
)
from tests.e2e.stack import Process

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first test also waits for the shared LoRA stack's start
]


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(LORA_REDIS_URL)
    try:
        yield connection
    finally:
        await connection.aclose()


def job(adapter: str | None, prompt: list[int], max_tokens: int = MAX_TOKENS) -> GenerateJob:
    """A greedy job; a long one (more than MAX_TOKENS) ignores EOS so its length is known."""
    now = time.time()
    sampling = SamplingOptions(
        max_tokens=max_tokens, temperature=0, ignore_eos=max_tokens > MAX_TOKENS
    )
    return GenerateJob(
        request_id=f"r-{uuid.uuid4().hex[:12]}",
        index=0,
        model=adapter or MODEL,
        prompt_token_ids=prompt,
        sampling=sampling,
        reply_to=REPLY,
        deadline_unix=now + 300,
        created_unix=now,
        adapter=adapter,
    )


async def submit(client: aioredis.Redis, *jobs: GenerateJob) -> None:
    queue = JobQueue(client)
    for one in jobs:
        stream = (
            adapter_stream(one.adapter) if one.adapter else names.job_stream(MODEL, Role.AGGREGATED)
        )
        result = await queue.submit(stream, [one], max_depth=1000)
        assert result.outcome.value == "queued", result


async def outputs(
    client: aioredis.Redis, jobs: list[GenerateJob], timeout_s: float = 120
) -> list[list[int]]:
    """Each job's tokens once it finished (an error event fails the test)."""
    tokens: dict[str, list[int]] = {j.request_id: [] for j in jobs}
    done: set[str] = set()
    last = b"0"
    deadline = time.monotonic() + timeout_s
    while len(done) < len(jobs):
        assert time.monotonic() < deadline, f"{len(jobs) - len(done)} jobs unfinished"
        reply = await client.xread({REPLY: last}, block=500, count=1000)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                for event in decode_events(fields):
                    rid = getattr(event, "request_id", None)
                    if rid not in tokens:
                        continue
                    assert not isinstance(event, ErrorEvent), event
                    if isinstance(event, TokenEvent):
                        tokens[rid] += event.token_ids
                    elif isinstance(event, FinishEvent):
                        done.add(rid)
    return [tokens[j.request_id] for j in jobs]


async def run(client: aioredis.Redis, jobs: list[GenerateJob]) -> list[list[int]]:
    await submit(client, *jobs)
    return await outputs(client, jobs)


async def first_token(client: aioredis.Redis, one: GenerateJob, timeout_s: float = 60) -> None:
    """Return once ``one`` has streamed a token (it is running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _, fields in await client.xrange(REPLY):
            for event in decode_events(fields):
                if isinstance(event, TokenEvent) and event.request_id == one.request_id:
                    return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{one.request_id} did not start")


def worker_entry(process: Process) -> WorkerRegistration:
    [entry] = [w for w in registrations() if f"-{process.popen.pid}-" in w.worker_id]
    return entry


# ---------------------------------------------------------------------------- tests


def test_each_adapter_is_reported_and_bad_ones_fail_with_their_reason(lora: LoraStack) -> None:
    entry = worker_entry(lora.worker)
    assert entry.ready and entry.adapters_generation == 1
    assert {name: entry.adapters[name] for name in GOOD} == dict.fromkeys(GOOD, LOADED)
    reasons = {name: failure_reason(entry.adapters[name]) or "" for name in BAD}
    assert reasons["missing"].startswith("no adapter folder at ")
    assert "adapter_model.safetensors is corrupt" in reasons["corrupt"]
    assert reasons["wrong-base"].startswith("made for another model")


async def test_adapter_tokens_equal_offline_vllm(lora: LoraStack, client: aioredis.Redis) -> None:
    for name in ("base", *GOOD):
        adapter = None if name == "base" else name
        ours = [(await run(client, [job(adapter, prompt)]))[0] for prompt in PROMPTS]
        assert ours == lora.reference[name], name
    for name in GOOD:  # the adapters visibly change the model
        assert lora.reference[name] != lora.reference["base"]


@pytest.mark.parametrize("adapters", [("a1", "a2"), ("a1", "a2", "a3")])
async def test_32_concurrent_mixed_requests_equal_their_single_references(
    lora: LoraStack, client: aioredis.Redis, adapters: tuple[str, ...]
) -> None:
    """Base requests batched with adapters' requests, every slot used (and, with three
    adapters, more adapters than max_loras=2 at once): each output is its reference."""
    choices = [None, *adapters]
    plan = [(choices[i % len(choices)], i % len(PROMPTS)) for i in range(32)]
    jobs = [job(name, PROMPTS[p]) for name, p in plan]
    ours = await run(client, jobs)
    for (name, p), tokens in zip(plan, ours, strict=True):
        assert tokens == lora.reference[name or "base"][p], (name, p)


async def test_a_bad_adapter_left_the_engine_healthy(
    lora: LoraStack, client: aioredis.Redis
) -> None:
    assert worker_entry(lora.worker).ready and lora.worker.popen.poll() is None
    [tokens] = await run(client, [job(None, PROMPTS[0])])
    assert tokens == lora.reference["base"][0]


async def test_unregistering_during_a_stream_lets_it_finish_then_unloads(
    lora: LoraStack, client: aioredis.Redis
) -> None:
    long = job("a3", PROMPTS[2], max_tokens=300)
    await submit(client, long)
    await asyncio.sleep(0.5)
    await publish_desired(client, MODEL, [s for n, s in lora.specs.items() if n != "a3"])
    [tokens] = await outputs(client, [long])
    reference = lora.reference["a3"][2]
    assert len(tokens) == 300 and tokens[: len(reference)] == reference
    deadline = time.monotonic() + 10
    while "a3" in worker_entry(lora.worker).adapters:
        assert time.monotonic() < deadline, worker_entry(lora.worker).adapters
        await asyncio.sleep(0.1)
    late = job("a3", PROMPTS[0])
    await submit(client, late)
    await asyncio.sleep(1.5)
    assert await client.xlen(adapter_stream("a3")) == 1  # nobody reads it any more
    await client.delete(adapter_stream("a3"))
    await publish_desired(client, MODEL, list(lora.specs.values()))  # loaded again
    deadline = time.monotonic() + 10
    while worker_entry(lora.worker).adapters.get("a3") != LOADED:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    [again] = await run(client, [job("a3", PROMPTS[2])])
    assert again == lora.reference["a3"][2]


async def test_admin_commands_on_a_real_worker(lora: LoraStack, client: aioredis.Redis) -> None:
    worker_id = worker_entry(lora.worker).worker_id
    cleared = await send_worker_command(client, worker_id, Command.CLEAR_KV, 10)
    assert cleared.status == CommandStatus.OK, cleared
    for command in (Command.SLEEP, Command.WAKE):
        result = await send_worker_command(client, worker_id, command, 10)
        assert result.status == CommandStatus.NOT_SUPPORTED
        assert result.detail.startswith("not supported on this engine: vLLM on cpu has no sleep")
    # A job runs through the drain; one submitted after it waits for the resume.
    running = job("a1", PROMPTS[1], max_tokens=800)
    await submit(client, running)
    await first_token(client, running)
    drained = await send_worker_command(client, worker_id, Command.DRAIN, 10)
    assert drained.status == CommandStatus.OK, drained
    waiting = job(None, PROMPTS[0])
    await submit(client, waiting)
    [tokens] = await outputs(client, [running])
    assert len(tokens) == 800
    await asyncio.sleep(1.0)
    entry = worker_entry(lora.worker)
    assert entry.draining and entry.paused and entry.active == 0
    assert await client.xlen(names.job_stream(MODEL, Role.AGGREGATED)) == 1  # not taken
    resumed = await send_worker_command(client, worker_id, Command.RESUME, 10)
    assert resumed.status == CommandStatus.OK
    assert await outputs(client, [waiting]) == [lora.reference["base"][0]]
    deadline = time.monotonic() + 5  # the next heartbeat says so
    while worker_entry(lora.worker).draining:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_a_sigkilled_workers_replacement_loads_adapters_before_it_is_ready(
    lora: LoraStack, client: aioredis.Redis
) -> None:
    old = lora.worker
    os.killpg(old.popen.pid, signal.SIGKILL)
    old.popen.wait(30)
    forget_dead_process(LORA_REDIS_URL, old.popen.pid)
    queued = [job(name, PROMPTS[3]) for name in GOOD]  # waiting for the replacement
    await submit(client, *queued)
    replacement = lora.stack.start_worker("replacement", **WORKER_ENV)
    lora.workers.append(replacement)
    seen: list[WorkerRegistration] = []
    registry = WorkerRegistry(client, ttl_s=1)
    deadline = time.monotonic() + 240
    while not any(entry.ready for entry in seen):
        assert time.monotonic() < deadline and replacement.popen.poll() is None, (
            replacement.log_tail()
        )
        seen += [
            w for w in await registry.live_workers() if f"-{replacement.popen.pid}-" in w.worker_id
        ]
        await asyncio.sleep(0.02)
    for entry in seen:
        if entry.ready:
            assert all(entry.adapters.get(name) == LOADED for name in GOOD), entry.adapters
    assert any(not entry.ready for entry in seen)  # it registered before it was ready
    assert await outputs(client, queued) == [lora.reference[name][3] for name in GOOD]
