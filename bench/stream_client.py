"""A cheap closed-loop streaming client for the ceiling benchmark (one process).

    python -m bench.stream_client '{"base_url": ..., "lanes": 256, ...}'

Each lane sends a streaming completion, reads it to the end, and sends the next, until
``stop_at`` (``time.monotonic``, which every process on the host shares). Token events
are counted, not parsed: each carries ``"finish_reason":null``, and only the chunk with
the usage is searched for ``completion_tokens``. Inter-token gaps and completions count
only inside [``window_start``, ``window_end``]; the result is one JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench.knee import LatencyHistogram

TOKEN_MARK = b'"finish_reason":null'
USAGE_MARK = b'"completion_tokens":'
MAX_ERROR_SAMPLES = 5


@dataclass(slots=True)
class Tally:
    window_events: int = 0
    done_events: int = 0
    done_tokens: int = 0
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Plan:
    base_url: str
    lanes: int
    body: dict[str, Any]
    window_start: float
    window_end: float
    stop_at: float
    stagger_s: float = 0.0
    """Lanes start spread over this long, so requests do not start and end in lockstep."""


def _completion_tokens(chunk: bytes) -> int | None:
    at = chunk.find(USAGE_MARK)
    if at < 0:
        return None
    digits = chunk[at + len(USAGE_MARK) :].lstrip()
    end = 0
    while end < len(digits) and digits[end : end + 1].isdigit():
        end += 1
    return int(digits[:end]) if end else None


class Client:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.payload = json.dumps(plan.body).encode()
        self.tally = Tally()
        self.gaps = LatencyHistogram()

    def _error(self, text: str) -> None:
        self.tally.errors += 1
        if len(self.tally.error_samples) < MAX_ERROR_SAMPLES:
            self.tally.error_samples.append(text[:200])

    async def one(self, session: aiohttp.ClientSession) -> None:
        plan = self.plan
        headers = {"Content-Type": "application/json"}
        events, tokens, last = 0, None, 0.0
        async with session.post("/v1/completions", data=self.payload, headers=headers) as resp:
            if resp.status != 200:
                self._error(f"HTTP {resp.status}: {await resp.text(errors='replace')}")
                return
            async for chunk in resp.content.iter_any():
                now = time.monotonic()
                count = chunk.count(TOKEN_MARK)
                if count:
                    if events and plan.window_start <= now < plan.window_end:
                        self.gaps.add(now - last)
                        if count > 1:
                            self.gaps.add(0.0, count - 1)
                        self.tally.window_events += count
                    events += count
                    last = now
                if tokens is None:
                    tokens = _completion_tokens(chunk)
        now = time.monotonic()
        if tokens is None:
            self._error("stream ended without usage")
        elif plan.window_start <= now < plan.window_end:
            self.tally.requests += 1
            self.tally.done_events += events
            self.tally.done_tokens += tokens

    async def lane(self, session: aiohttp.ClientSession, number: int) -> None:
        await asyncio.sleep(self.plan.stagger_s * number / self.plan.lanes)
        while time.monotonic() < self.plan.stop_at:
            try:
                await self.one(session)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._error(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.1)

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.plan.lanes)
        timeout = aiohttp.ClientTimeout(total=600.0, sock_connect=30.0)
        async with aiohttp.ClientSession(
            base_url=self.plan.base_url, connector=connector, timeout=timeout, trust_env=False
        ) as session:
            lanes = range(self.plan.lanes)
            await asyncio.gather(*(self.lane(session, number) for number in lanes))

    def result(self) -> dict[str, Any]:
        counts = {i: c for i, c in enumerate(self.gaps.counts) if c}
        return {**asdict(self.tally), "gaps": counts}


def main() -> None:
    plan = Plan(**json.loads(sys.argv[1]))
    client = Client(plan)
    asyncio.run(client.run())
    sys.stdout.write(json.dumps(client.result()) + "\n")


if __name__ == "__main__":
    main()
