"""Closed-loop load generator: ``concurrency`` streams at a time, SSE parsed by hand.

Timings use ``time.perf_counter`` taken when the bytes of an SSE event arrive:
TTFT is request start -> first event carrying generated text (the chat role chunk
does not count); ITL is the gap between consecutive such events, as in vLLM's own
benchmark. A server that falls behind packs several tokens into one event (vLLM and
Conveyor both do): "token events/request" below 64 shows it, and such a gap then
spans several tokens. Throughput counts tokens from ``usage.completion_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

MAX_ERROR_SAMPLES = 5


@dataclass(slots=True)
class RequestResult:
    start: float
    end: float = 0.0
    error: str | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class LoadSummary:
    requests: int
    completed: int
    errors: int
    duration_s: float
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_ms: float
    token_events_per_request: float
    prompt_tokens_seen: list[int]
    error_samples: list[str]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _is_token_event(choice: dict[str, Any]) -> bool:
    """A chunk carrying generated text (vLLM may put the last token in the finish chunk)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if "role" in delta:
            return False
        text = delta.get("content")
    else:
        text = choice.get("text")
    if not isinstance(text, str):
        return False
    return choice.get("finish_reason") is None or text != ""


def _on_data(payload: bytes, now: float, result: RequestResult) -> None:
    if payload == b"[DONE]":
        result.done = True
        return
    body = json.loads(payload)
    if "error" in body:
        result.error = f"error event: {json.dumps(body['error'])[:200]}"
        return
    for choice in body.get("choices") or []:
        if _is_token_event(choice):
            if result.first_token is None:
                result.first_token = now
            result.token_times.append(now)
    usage = body.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")


async def one_request(
    session: aiohttp.ClientSession, path: str, body: dict[str, Any], output_tokens: int
) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    try:
        async with session.post(path, json=body) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                buffer += data.replace(b"\r\n", b"\n")
                while (cut := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:cut], buffer[cut + 2 :]
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            _on_data(line[5:].strip(), now, result)
                if result.error is not None:
                    return result
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        result.end = time.perf_counter()
    if not result.done:
        result.error = "stream ended without [DONE]"
    elif result.completion_tokens != output_tokens:
        result.error = f"usage.completion_tokens={result.completion_tokens}, not {output_tokens}"
    elif result.first_token is None:
        result.error = "no token events"
    return result


def new_session(
    base_url: str, concurrency: int, api_key: str | None = None
) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        base_url=base_url,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        timeout=aiohttp.ClientTimeout(total=600.0, sock_connect=10.0),
        connector=aiohttp.TCPConnector(limit=concurrency),
        trust_env=False,  # never route loopback traffic through a proxy from the environment
    )


async def run_load(
    base_url: str,
    path: str,
    bodies: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    output_tokens: int,
    api_key: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every body, ``concurrency`` at a time; returns the results and the wall time."""
    pending = iter(bodies)
    results: list[RequestResult] = []

    async def user(session: aiohttp.ClientSession) -> None:
        for body in pending:  # the iterator is shared: each body is taken once
            results.append(await one_request(session, path, body, output_tokens))

    async with new_session(base_url, concurrency, api_key) as session:
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(user(session))
        return results, time.perf_counter() - started


def summarize(results: Sequence[RequestResult], duration_s: float) -> LoadSummary:
    good = [r for r in results if r.error is None]
    ttfts = [(r.first_token or r.start) - r.start for r in good]
    itls = [b - a for r in good for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tokens = sum(r.completion_tokens or 0 for r in good)
    events = sum(len(r.token_times) for r in good)
    errors = [r.error for r in results if r.error is not None]
    return LoadSummary(
        requests=len(results),
        completed=len(good),
        errors=len(errors),
        duration_s=duration_s,
        output_tokens=tokens,
        requests_per_s=len(good) / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p99_ms=percentile(ttfts, 99) * 1000,
        itl_p50_ms=percentile(itls, 50) * 1000,
        itl_p99_ms=percentile(itls, 99) * 1000,
        e2e_p50_ms=percentile([r.end - r.start for r in good], 50) * 1000,
        token_events_per_request=events / len(good) if good else 0.0,
        prompt_tokens_seen=sorted({r.prompt_tokens for r in good if r.prompt_tokens is not None}),
        error_samples=sorted(set(errors))[:MAX_ERROR_SAMPLES],
    )
