"""Streaming load that records everything a client sees, for the chaos checker."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

MODEL_NAME = "chaos"


@dataclass
class Record:
    prompt_index: int
    sent_at: float = 0.0
    status: str = "hung"
    """completed | failed (clean error) | rejected (HTTP 4xx/5xx) | disconnected | hung"""
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    request_id: str = ""
    keepalives: int = 0
    """SSE comments received (the gateway's keep-alives while no event comes)."""

    def describe(self) -> str:
        """What a client that hung saw, to tell where its stream stopped."""
        last_seq = self.seq_ids[-1] if self.seq_ids else None
        return (
            f"{self.request_id or '(no response)'}: {len(self.tokens)} tokens, last event id "
            f"{last_seq}, finish_reason {self.finish_reason}, {self.keepalives} keep-alives"
        )


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1, *(rng.randrange(10, 4000) for _ in range(rng.randrange(8, 40)))] for _ in range(count)
    ]


async def stream_one(
    client: httpx.AsyncClient,
    base_url: str,
    prompt_index: int,
    prompt: list[int],
    *,
    max_tokens: int,
    timeout_s: float,
    disconnect_after: int | None = None,
) -> Record:
    record = Record(prompt_index, sent_at=time.monotonic())
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                record.request_id = response.headers.get("x-request-id", "")
                if response.status_code != 200:
                    await response.aread()
                    record.status, record.error = "rejected", f"HTTP {response.status_code}"
                    return record
                await _read_stream(response, record, disconnect_after)
    except TimeoutError:
        record.status = "hung"
    except httpx.HTTPError as exc:
        record.status, record.error = "failed", f"transport: {exc!r}"
    return record


async def _read_stream(
    response: httpx.Response, record: Record, disconnect_after: int | None
) -> None:
    async for line in response.aiter_lines():
        if line.startswith(":"):
            record.keepalives += 1
        if line.startswith("id: "):
            record.seq_ids.append(int(line[4:]))
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            if record.status == "hung":
                record.status = "completed" if record.finish_reason else "failed"
            return
        chunk = json.loads(data)
        if "error" in chunk:
            record.status, record.error = "failed", chunk["error"]["message"]
            continue
        for choice in chunk.get("choices", []):
            ids = choice.get("token_ids") or []
            record.tokens.extend(ids)
            record.token_times.extend([time.monotonic()] * len(ids))
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if disconnect_after is not None and len(record.tokens) >= disconnect_after:
            record.status = "disconnected"
            return


async def run_load(
    base_url: str,
    prompt_list: list[list[int]],
    *,
    max_tokens: int,
    concurrency: int,
    timeout_s: float = 90.0,
    disconnect_fraction: float = 0.0,
    seed: int = 0,
) -> list[Record]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=0)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def one(index: int, prompt: list[int]) -> Record:
            disconnect = None
            if rng.random() < disconnect_fraction:
                disconnect = rng.randrange(0, max_tokens)
            async with gate:
                return await stream_one(
                    client,
                    base_url,
                    index,
                    prompt,
                    max_tokens=max_tokens,
                    timeout_s=timeout_s,
                    disconnect_after=disconnect,
                )

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompt_list))))
