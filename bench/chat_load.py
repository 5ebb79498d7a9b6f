"""Runs a conversation plan (:mod:`bench.conversations`) against a server, as chat clients
would: the official ``openai`` async client, streaming with ``include_usage`` (for
``prompt_tokens_details.cached_tokens``), every conversation a task of its own that
sends a turn, appends the answer to its history, thinks, and sends the next.

TTFT is request start -> first chunk carrying text; ITL the gap between such chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam

from bench.conversations import ConversationPlan, Plan, words_text

Message = dict[str, str]
CONNECTION_LIMITS = httpx2.Limits(
    max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0
)
"""The openai client's limits, but idle connections are dropped after 2 s, before the
gateway's 5 s keep-alive closes them: a request sent on a connection the server is
closing at that moment fails with a ReadError (seen under load)."""


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int
    messages: list[Message]
    """The messages sent (the ideal cache ratio is computed from them)."""
    start: float = 0.0
    end: float = 0.0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


def new_client(base_url: str, api_key: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=api_key or "unused",
        max_retries=0,
        timeout=600.0,
        # never route loopback traffic through a proxy from the environment
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False, limits=CONNECTION_LIMITS),
    )


async def run_plan(
    base_url: str,
    model: str,
    plan: Plan,
    words: Sequence[str],
    *,
    api_key: str | None = None,
) -> tuple[list[TurnResult], float]:
    """Every conversation of ``plan`` at once; returns the turns (in the order sent) and
    the wall time from the first turn sent to the last answer."""
    results: list[TurnResult] = []
    client = new_client(base_url, api_key)
    async with client:
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for conversation in plan.conversations:
                group.create_task(_converse(client, model, plan, conversation, words, results))
    results.sort(key=lambda r: r.start)
    first = results[0].start if results else started
    last = max((r.end for r in results), default=first)
    return results, last - first


async def _converse(
    client: openai.AsyncOpenAI,
    model: str,
    plan: Plan,
    conversation: ConversationPlan,
    words: Sequence[str],
    into: list[TurnResult],
) -> None:
    await asyncio.sleep(conversation.start_s)
    history: list[Message] = []
    for number, turn in enumerate(conversation.turns):
        if turn.fresh:
            history = [{"role": "system", "content": words_text(words, plan.systems[turn.system])}]
        history.append({"role": "user", "content": words_text(words, turn.user_words)})
        result = TurnResult(conversation.number, number, list(history))
        into.append(result)
        await send_turn(client, model, plan.spec.output_tokens, result)
        history.append({"role": "assistant", "content": result.text})
        await asyncio.sleep(turn.think_s)


async def send_turn(
    client: openai.AsyncOpenAI, model: str, output_tokens: int, result: TurnResult
) -> None:
    """Stream one chat completion of ``result.messages`` into ``result``."""
    parts: list[str] = []
    result.start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=cast(list[ChatCompletionMessageParam], result.messages),
            max_tokens=output_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            _on_chunk(chunk, time.perf_counter(), result, parts)
    except (openai.OpenAIError, OSError, ValueError) as exc:
        cause = exc.__cause__ or exc.__context__
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        result.error = f"{type(exc).__name__}: {exc}{why}"[:300]
    finally:
        result.end = time.perf_counter()
        result.text = "".join(parts)
    if result.error is None and result.completion_tokens != output_tokens:
        result.error = f"usage.completion_tokens={result.completion_tokens}, not {output_tokens}"


def _on_chunk(chunk: Any, now: float, result: TurnResult, parts: list[str]) -> None:
    for choice in chunk.choices:
        text = choice.delta.content if choice.delta is not None else None
        if text:
            if result.first_token is None:
                result.first_token = now
            result.token_times.append(now)
            parts.append(text)
    usage = chunk.usage
    if usage is not None:
        result.prompt_tokens = usage.prompt_tokens
        result.completion_tokens = usage.completion_tokens
        details = usage.prompt_tokens_details
        result.cached_tokens = details.cached_tokens if details is not None else None
