"""Resumable streams (``Conveyor-Resumable: true``) through the real gateway in process:
a client that leaves mid-stream resumes with ``Last-Event-ID``, on the same gateway or
another one, and gets every later chunk exactly once; the request is not cancelled by
the disconnect; bad resumes are refused with OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fakeredis.aioredis import FakeRedis

from gateway.catalog.served_models import ServedModel
from shared.connections.connect import connect
from shared.connections.model_redis import ModelRedis
from shared.protocol import Event, Job
from shared.queue import names
from tests.gateway.fake_worker import finish, token
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, LiveGateway, error_of, live_gateway
from tests.gateway.sse import DONE, SseEvent, events

RESUMABLE = {"Conveyor-Resumable": "true"}
TOKENS = 12


async def paced(job: Job) -> AsyncIterator[Sequence[Event]]:
    """``TOKENS`` tokens, one every 20 ms, then ``stop``."""
    for seq in range(TOKENS):
        yield [token(job, seq, f"t{seq} ")]
        await asyncio.sleep(0.02)
    yield [finish(job, TOKENS, TOKENS)]


def text_of(chunks: list[SseEvent]) -> str:
    parts = []
    for chunk in chunks:
        if chunk.data == DONE:
            continue
        for choice in chunk.data["choices"]:
            parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def body_of(path: str, **fields: Any) -> dict[str, Any]:
    return {**BODIES[path], "max_tokens": TOKENS, "stream": True, **fields}


async def leave_after(live: LiveGateway, path: str, marker: str) -> tuple[str, list[SseEvent]]:
    """Start a resumable stream, read until ``marker``, leave: (request id, what came)."""
    async with live.call(path, body_of(path), **RESUMABLE) as call:
        assert await call.start() == 200
        await call.read_until(marker)
        call.leave()
        await call.finished()
    return call.headers["x-request-id"], events(call.received.decode())


def resume_path(path: str, request_id: str) -> str:
    return f"{path}/{request_id}/stream"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_resumed_stream_continues_exactly_once(gateway: LiveGateway, path: str) -> None:
    gateway.workers[0].script = paced
    whole = await gateway.client.post(path, json=body_of(path))
    expected = text_of(events(whole.text))
    request_id, first = await leave_after(gateway, path, "t3 ")
    assert all(e.id is not None for e in first if text_of([e]))  # every token chunk
    last_id = [e.id for e in first if e.id is not None][-1]
    resumed = await gateway.client.get(
        resume_path(path, request_id), headers={"Last-Event-ID": last_id}
    )
    assert resumed.status_code == 200, resumed.text
    rest = events(resumed.text)
    assert rest[-1].data == DONE
    assert text_of(first) + text_of(rest) == expected
    assert await gateway.redis.get(names.cancel_flag(request_id)) is None


async def test_a_stream_resumes_on_another_gateway(served_model: ServedModel) -> None:
    shared = FakeRedis()
    async with (
        live_gateway(served_model, model_redis=_on(shared)) as first,
        live_gateway(served_model, model_redis=_on(shared), workers=()) as second,
    ):
        first.workers[0].script = paced
        request_id, got = await leave_after(first, CHAT, "t2 ")
        last_id = [e.id for e in got if e.id is not None][-1]
        resumed = await second.client.get(
            resume_path(CHAT, request_id), headers={"Last-Event-ID": last_id}
        )
        assert resumed.status_code == 200, resumed.text
        text = text_of(got) + text_of(events(resumed.text))
        assert text == "".join(f"t{i} " for i in range(TOKENS))


def _on(redis: FakeRedis) -> ModelRedis:
    return ModelRedis("redis://fake", {}, connect, home=redis)


async def test_a_stream_nobody_resumes_loses_its_lease(served_model: ServedModel) -> None:
    async with live_gateway(served_model, resume_grace_s=0.3) as live:
        live.workers[0].script = paced
        request_id, _ = await leave_after(live, CHAT, "t1 ")
        lease = names.gateway_heartbeat(names.request_holder(request_id))
        assert await live.redis.exists(lease)
        await asyncio.sleep(0.5)
        assert not await live.redis.exists(lease)  # the workers abort it after their grace


async def test_bad_resumes_are_refused(gateway: LiveGateway) -> None:
    gateway.workers[0].script = paced
    request_id, _ = await leave_after(gateway, CHAT, "t1 ")
    path = resume_path(CHAT, request_id)
    for bad in ("x", "0-1", "99"):
        error = error_of(await gateway.client.get(path, headers={"Last-Event-ID": bad}))
        assert error["param"] == "Last-Event-ID"
    error_of(await gateway.client.get(resume_path(CHAT, "chatcmpl-nope")), 404)
    error_of(await gateway.client.get(resume_path(COMPLETIONS, request_id)), 404)
    plain = await gateway.client.post(CHAT, json={**BODIES[CHAT]}, headers=RESUMABLE)
    assert error_of(plain)["param"] == "Conveyor-Resumable"
    with contextlib.suppress(Exception):
        await gateway.client.get(path)  # read it to its end: nothing is left running
