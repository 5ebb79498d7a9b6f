"""Resumable work through faults, on the chaos cluster with two extra gateways (A, B)
sharing its Redis and one SQL database:

- a background response accepted by A, then A SIGKILLed and the worker running it
  SIGKILLed: B takes it over, it completes, and its stored text and event log are the
  ones a run with no fault gives, each event once;
- a resumable stream read from A, dropped (the client leaves) or cut by A's SIGKILL,
  resumed on B with ``Last-Event-ID``: the two parts together are the stream a run with
  no fault gives, every token once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass

import httpx
import openai

from tests.chaos.cluster import MODEL_NAME, Cluster
from tests.chaos.scenarios import kill_worker
from tests.e2e.stack import Process, wait_until

MAX_TOKENS = 256
PROMPT = "Tell me a long story about the sea."
KILL_AFTER_EVENTS = 24
DONE_WITHIN_S = 180.0


@dataclass
class Pair:
    """Two gateways of the cluster besides its own; ``a`` is the one faults hit."""

    a: Process
    a_url: str
    b: Process
    b_url: str


def start_pair(cluster: Cluster) -> Pair:
    """Two more gateways, on the cluster's database as well as its Redis: every gateway
    of a Redis may take over a background response, and stores it in that database."""
    assert cluster.stack is not None
    a, a_url = cluster.stack.start_gateway("gateway-a")
    b, b_url = cluster.stack.start_gateway("gateway-b")
    for process, url in ((a, a_url), (b, b_url)):
        wait_until(f"{url}/ready", status=200, process=process, timeout_s=120)
    return Pair(a, a_url, b, b_url)


def restart_a(cluster: Cluster, pair: Pair) -> None:
    """A new gateway A (after a fault killed the last one)."""
    assert cluster.stack is not None
    pair.a, pair.a_url = cluster.stack.start_gateway("gateway-a")
    wait_until(f"{pair.a_url}/ready", status=200, process=pair.a, timeout_s=120)


async def check_all(cluster: Cluster, pair: Pair) -> list[str]:
    """Every scenario; the problems found (none: all good)."""
    problems: list[str] = []
    reference = await background(cluster, pair, faults=False)
    faulted = await background(cluster, pair, faults=True)
    restart_a(cluster, pair)
    cluster.wait_workers(len(cluster.workers))
    for name, result in (("reference", reference), ("faulted", faulted)):
        if result.sequence_numbers != list(range(len(result.sequence_numbers))):
            problems.append(f"background {name}: sequence numbers {result.sequence_numbers}")
        if result.streamed_text != result.text:
            problems.append(f"background {name}: streamed text differs from stored text")
    if faulted.status != reference.status or faulted.text != reference.text:
        problems.append(
            f"background after SIGKILLs: {faulted.status} {faulted.text!r} != "
            f"{reference.status} {reference.text!r}"
        )
    whole = await resumed_stream(pair, fault=None)
    for fault in ("drop", "kill"):
        resumed = await resumed_stream(pair, fault=fault)
        if fault == "kill":
            restart_a(cluster, pair)
        if resumed.text != whole.text:
            problems.append(f"stream resumed after {fault}: {resumed.text!r} != {whole.text!r}")
        if len(set(resumed.ids)) != len(resumed.ids):
            problems.append(f"stream resumed after {fault}: repeated ids {resumed.ids}")
    return problems


def sigkill(process: Process) -> None:
    process.popen.send_signal(signal.SIGKILL)
    process.popen.wait()


# ------------------------------------------------------------------ background


@dataclass
class BackgroundResult:
    status: str
    text: str
    sequence_numbers: list[int]
    streamed_text: str


async def background(cluster: Cluster, pair: Pair, *, faults: bool) -> BackgroundResult:
    """One background response (greedy); with ``faults``, A and then the worker running
    it are SIGKILLed mid-generation. Read back on B."""
    accept = openai.AsyncOpenAI(base_url=f"{pair.a_url}/v1", api_key="unused", max_retries=0)
    read = openai.AsyncOpenAI(base_url=f"{pair.b_url}/v1", api_key="unused", max_retries=0)
    try:
        made = await accept.responses.create(
            model=MODEL_NAME,
            input=PROMPT,
            background=True,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        if faults:
            await _until_events(read, made.id, KILL_AFTER_EVENTS)
            await asyncio.to_thread(sigkill, pair.a)
            await _until_events(read, made.id, KILL_AFTER_EVENTS + 8, timeout_s=60)
            await kill_worker(cluster)
        final = await _until_done(read, made.id)
        events = [e async for e in await read.responses.retrieve(made.id, stream=True)]
    finally:
        await accept.close()
        await read.close()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    return BackgroundResult(
        final.status, final.output_text, [e.sequence_number for e in events], "".join(deltas)
    )


async def _until_events(
    client: openai.AsyncOpenAI, response_id: str, count: int, timeout_s: float = 60
) -> None:
    """Stream the response's events from B until ``count`` have come."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    async with asyncio.timeout(timeout_s):
        async for _event in await client.responses.retrieve(response_id, stream=True):
            seen += 1
            if seen >= count or time.monotonic() > deadline:
                return


async def _until_done(
    client: openai.AsyncOpenAI, response_id: str
) -> openai.types.responses.Response:
    deadline = time.monotonic() + DONE_WITHIN_S
    while True:
        got = await client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------ resumed streams


@dataclass
class ResumedResult:
    text: str
    ids: list[str]
    """The SSE ids received, both parts together."""


async def resumed_stream(pair: Pair, *, fault: str | None) -> ResumedResult:
    """A greedy resumable chat stream read from A; ``fault``: ``drop`` (the client leaves
    after some chunks, resumes on A) or ``kill`` (A is SIGKILLed, resume on B); None: read
    whole."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    text: list[str] = []
    ids: list[str] = []
    headers = {"Conveyor-Resumable": "true"}
    async with httpx.AsyncClient(timeout=DONE_WITHIN_S) as client:
        async with client.stream(
            "POST", f"{pair.a_url}/v1/chat/completions", json=body, headers=headers
        ) as first:
            request_id = first.headers["x-request-id"]
            finished = await _read(first, text, ids, stop_after=None if fault is None else 30)
            if fault == "kill":
                await asyncio.to_thread(sigkill, pair.a)
        if finished:
            return ResumedResult("".join(text), ids)
        url = pair.a_url if fault == "drop" else pair.b_url
        resume = f"{url}/v1/chat/completions/{request_id}/stream"
        async with client.stream("GET", resume, headers={"Last-Event-ID": ids[-1]}) as rest:
            assert rest.status_code == 200, await rest.aread()
            await _read(rest, text, ids, stop_after=None)
    return ResumedResult("".join(text), ids)


async def _read(
    response: httpx.Response, text: list[str], ids: list[str], stop_after: int | None
) -> bool:
    """Chunks into ``text`` and ``ids`` until [DONE] (True) or ``stop_after`` ids (False)."""
    event_id: str | None = None
    taken = 0
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            if data == "[DONE]":
                return True
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
            if event_id is not None:
                ids.append(event_id)
                taken += 1
            event_id = None
            if stop_after is not None and taken >= stop_after:
                return False
    return False
