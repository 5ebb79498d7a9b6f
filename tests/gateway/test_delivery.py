"""What a client receives for what the workers send: SSE and JSON bodies, n choices and
usage, repeated and missing seq numbers, errors mid-stream, keep-alive, deadlines."""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
from collections.abc import AsyncIterator, Sequence
from typing import Any

import openai
import pytest
from msgspec.structs import replace

from gateway.catalog.served_models import ServedModel
from shared.errors import EngineError, InvalidRequest
from shared.protocol import Event, FinishEvent, Job
from shared.queue import names
from shared.queue.usage import decode_usage
from tests.gateway.asgi_call import AsgiCall
from tests.gateway.fake_worker import echo, error, finish, silent, token
from tests.gateway.harness import (
    BODIES,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    LiveGateway,
    error_of,
    live_gateway,
)
from tests.gateway.sse import DONE, SseEvent, content, events, parse_sse
from tests.waiting import eventually

STREAM: dict[str, Any] = {"stream": True}


def chat(**fields: Any) -> dict[str, Any]:
    return {**BODIES[CHAT], **fields}


@pytest.fixture
async def per_event(served_model: ServedModel) -> AsyncIterator[LiveGateway]:
    """A gateway that sends one chunk per event (``stream_join_waiting`` off), for the
    tests that read each event's chunk; the echo worker writes two events per entry."""
    async with live_gateway(served_model, sse_keepalive_s=0.05, stream_join_waiting=False) as live:
        yield live


@pytest.fixture
async def joining(served_model: ServedModel) -> AsyncIterator[LiveGateway]:
    """A gateway that joins events waiting together (``stream_join_waiting`` on)."""
    async with live_gateway(served_model, sse_keepalive_s=0.05, stream_join_waiting=True) as live:
        yield live


# ---------------------------------------------------------------------- the plain path


async def test_chat_non_stream_collects_every_token(gateway: LiveGateway) -> None:
    response = await gateway.client.post(CHAT, json=chat(max_tokens=4))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert response.headers["X-Request-Id"] == body["id"]
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "c0-0 c0-1 c0-2 c0-3 "}
    assert choice["finish_reason"] == "length"
    [job] = gateway.workers[0].generate_jobs()
    prompt = len(job.prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "total_tokens": prompt + 4,
    }


async def test_chat_stream_is_openai_sse_with_event_ids(per_event: LiveGateway) -> None:
    gateway = per_event
    response = await gateway.client.post(CHAT, json=chat(max_tokens=3, **STREAM))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    items = events(response.text)
    role, *deltas, last, done = items
    assert role.id is None
    assert role.data["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [d.id for d in deltas] == ["0", "1", "2"]
    assert [d.data["choices"][0]["delta"]["content"] for d in deltas] == ["c0-0 ", "c0-1 ", "c0-2 "]
    assert last.id == "3"
    assert last.data["choices"][0]["finish_reason"] == "length"
    assert done == SseEvent(None, DONE)
    assert {item.data["id"] for item in items[:-1]} == {response.headers["X-Request-Id"]}


async def test_events_that_arrive_together_leave_as_one_chunk(joining: LiveGateway) -> None:
    """The echo worker writes two tokens per entry: they arrive together and leave as one
    chunk named by the second (a client resuming from it has both)."""
    response = await joining.client.post(CHAT, json=chat(max_tokens=3, **STREAM))
    _role, *deltas, last, _done = events(response.text)
    assert [d.id for d in deltas] == ["1", "2"]
    assert [d.data["choices"][0]["delta"]["content"] for d in deltas] == ["c0-0 c0-1 ", "c0-2 "]
    assert last.id == "3"


async def test_n_prompts_times_n_choices_with_usage_counting_each_prompt_once(
    per_event: LiveGateway,
) -> None:
    gateway = per_event
    body = {
        **BODIES[COMPLETIONS],
        "prompt": ["hello", "hello world"],
        "n": 2,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await gateway.client.post(COMPLETIONS, json=body)
    items = events(response.text)
    *chunks, usage_chunk, done = items
    assert done.data == DONE
    assert all(chunk.data["usage"] is None for chunk in chunks)
    assert {chunk.id for chunk in chunks} == {f"{i}-{seq}" for i in range(4) for seq in range(3)}
    for index in range(4):
        assert content(response.text, index) == f"c{index}-0 c{index}-1 "
    jobs = sorted(gateway.workers[0].generate_jobs(), key=lambda job: job.index)
    assert [job.index for job in jobs] == [0, 1, 2, 3]
    prompt_tokens = len(jobs[0].prompt_token_ids) + len(jobs[2].prompt_token_ids)
    assert usage_chunk.data["choices"] == []
    assert usage_chunk.data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 8,
        "total_tokens": prompt_tokens + 8,
    }


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_continuous_usage_puts_each_choices_usage_so_far_on_every_chunk(
    per_event: LiveGateway, path: str
) -> None:
    gateway = per_event
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**BODIES[path], "n": 2, "max_tokens": 3, "stream": True, "stream_options": options}
    response = await gateway.client.post(path, json=body)
    *chunks, usage_chunk, done = events(response.text)
    assert done.data == DONE
    [job, _] = gateway.workers[0].generate_jobs()
    prompt = len(job.prompt_token_ids)
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        [choice] = chunk.data["choices"]
        index = choice["index"]
        generated = (
            3 if choice.get("finish_reason") else (0 if chunk.id is None else seen[index] + 1)
        )
        seen[index] = generated
        assert chunk.data["usage"] == {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
        }, chunk
    assert seen == {0: 3, 1: 3}
    assert usage_chunk.data["usage"]["completion_tokens"] == 6


async def test_continuous_usage_needs_include_usage(gateway: LiveGateway) -> None:
    options = {"continuous_usage_stats": True}
    response = await gateway.client.post(CHAT, json=chat(stream_options=options, **STREAM))
    assert all("usage" not in item.data for item in events(response.text)[:-1])


async def test_return_token_ids_gives_vllms_prompt_and_completion_ids(
    gateway: LiveGateway,
) -> None:
    chat_body = chat(max_tokens=2, n=2, return_token_ids=True)
    answer = (await gateway.client.post(CHAT, json=chat_body)).json()
    [job, _] = gateway.workers[0].generate_jobs()
    assert answer["prompt_token_ids"] == job.prompt_token_ids
    assert [c["token_ids"] for c in answer["choices"]] == [[7, 7], [7, 7]]
    streamed = events((await gateway.client.post(CHAT, json={**chat_body, **STREAM})).text)
    assert [item.data.get("prompt_token_ids") for item in streamed[:3]] == [
        job.prompt_token_ids,
        None,
        None,
    ]
    text_body = {**BODIES[COMPLETIONS], "prompt": [[5, 6], [8]], "max_tokens": 2}
    text = (
        await gateway.client.post(COMPLETIONS, json={**text_body, "return_token_ids": True})
    ).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in text["choices"]] == [
        ([5, 6], [7, 7]),
        ([8], [7, 7]),
    ]
    stream = {**text_body, "return_token_ids": True, **STREAM}
    chunks = [
        item.data
        for item in events((await gateway.client.post(COMPLETIONS, json=stream)).text)[:-1]
    ]
    firsts = [
        c["choices"][0]["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c["choices"][0]
    ]
    assert sorted(firsts) == [[5, 6], [8]]
    plain = (await gateway.client.post(COMPLETIONS, json=text_body)).json()
    assert "prompt_token_ids" not in plain["choices"][0]


async def test_n_choices_non_stream_come_in_index_order(gateway: LiveGateway) -> None:
    response = await gateway.client.post(CHAT, json=chat(n=3, max_tokens=1, temperature=1.0))
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["message"]["content"] for c in choices] == ["c0-0 ", "c1-0 ", "c2-0 "]


async def cache_hits(job: Job) -> AsyncIterator[Sequence[Event]]:
    """Two tokens; the engine found all but one prompt token in its prefix cache."""
    prompt = len(job.prompt_token_ids)
    yield [token(job, 0, "a "), token(job, 1, "b ")]
    yield [FinishEvent(job.request_id, job.index, 2, 0, "stop", prompt, 2, prompt - 1)]


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_prompt_tokens_reach_usage_and_the_ledger(
    gateway: LiveGateway, stream: bool
) -> None:
    gateway.workers[0].script = cache_hits
    options = {"stream_options": {"include_usage": True}} if stream else {}
    response = await gateway.client.post(CHAT, json=chat(n=2, stream=stream, **options))
    usage = events(response.text)[-2].data["usage"] if stream else response.json()["usage"]
    prompt = usage["prompt_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": prompt - 1}  # once per prompt

    async def recorded() -> bool:
        return bool(await gateway.redis.xlen(names.USAGE_STREAM))

    await eventually(recorded, what="the usage record")
    found: Any = await gateway.redis.xrange(names.USAGE_STREAM)
    [record] = [decode_usage(fields) for _, fields in found]
    assert (record.cached_prompt_tokens, record.completion_tokens) == (prompt - 1, 4)
    # The gateway closed its open record and the request's sent tally with the row.
    assert await gateway.redis.exists(names.open_requests(gateway.state.gateway_id)) == 0


async def test_usage_has_no_cache_details_when_the_engine_reports_none(
    gateway: LiveGateway,
) -> None:
    usage = (await gateway.client.post(CHAT, json=chat())).json()["usage"]
    assert "prompt_tokens_details" not in usage


# ------------------------------------------------------------------- seq bookkeeping


async def replayed(job: Job) -> AsyncIterator[Sequence[Event]]:
    """Every batch sent twice, as a retried journal write would."""
    first = [token(job, 0, "a "), token(job, 1, "b ")]
    yield first
    yield first
    yield [token(job, 1, "b "), token(job, 2, "c ")]
    yield [finish(job, 3, 3)]
    yield [finish(job, 3, 3)]


@pytest.mark.parametrize("stream", [False, True])
async def test_repeated_seqs_reach_the_client_once(per_event: LiveGateway, stream: bool) -> None:
    gateway = per_event
    gateway.workers[0].script = replayed
    response = await gateway.client.post(CHAT, json=chat(stream=stream))
    if not stream:
        assert response.json()["choices"][0]["message"]["content"] == "a b c "
        return
    assert content(response.text) == "a b c "
    assert [item.id for item in events(response.text) if item.id] == ["0", "1", "2", "3"]


async def gap(job: Job) -> AsyncIterator[Sequence[Event]]:
    yield [token(job, 0, "a ")]
    yield [token(job, 2, "c ")]  # seq 1 never came: Redis lost it
    yield [finish(job, 3, 3)]


async def test_a_gap_ends_a_stream_with_a_clean_error_not_a_hole(
    gateway: LiveGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gateway.workers[0].script = gap
    with caplog.at_level(logging.ERROR, logger="gateway.dispatch.request_handle"):
        response = await gateway.client.post(CHAT, json=chat(stream=True))
    assert content(response.text) == "a "
    *_, failure, done = events(response.text)
    assert failure.data["error"]["code"] == "replies_lost"
    assert "events 1..1 of choice 0 were lost" in failure.data["error"]["message"]
    assert done.data == DONE
    assert "seq gap 1..1" in caplog.text


async def test_a_gap_is_a_503_for_a_json_answer(gateway: LiveGateway) -> None:
    gateway.workers[0].script = gap
    response = await gateway.client.post(CHAT, json=chat())
    assert error_of(response, 503)["code"] == "replies_lost"
    assert "Retry-After" in response.headers
    [job] = gateway.workers[0].generate_jobs()
    await gateway.state.cells.wait_background()
    assert await gateway.redis.get(names.cancel_flag(job.request_id)) == b"1"


async def rolled_back(job: Job) -> AsyncIterator[Sequence[Event]]:
    yield [token(job, 0, "a "), token(job, 1, "b ")]
    # the worker died, Redis failed over and lost seq 1: the next run resumes after "a "
    yield [replace(token(job, 1, "x "), attempt=1)]
    yield [replace(finish(job, 2, 2), attempt=1)]


async def test_a_run_resumed_from_before_what_the_client_has_ends_the_stream(
    gateway: LiveGateway, caplog: pytest.LogCaptureFixture
) -> None:
    """ "x " continues "a ", not "a b ": joining it to the client's text would splice two
    different samples. The request ends as a gap does (503 replies_lost)."""
    gateway.workers[0].script = rolled_back
    with caplog.at_level(logging.ERROR, logger="gateway.dispatch.request_handle"):
        response = await gateway.client.post(CHAT, json=chat(stream=True))
    assert content(response.text) == "a b "
    *_, failure, done = events(response.text)
    assert failure.data["error"]["code"] == "replies_lost"
    assert "resumed from before events the client already has (1..1)" in str(failure.data)
    assert done.data == DONE
    assert "run 1 resumed at seq 1" in caplog.text


async def resumed(job: Job) -> AsyncIterator[Sequence[Event]]:
    yield [token(job, 0, "a ")]
    yield [replace(token(job, 1, "b "), attempt=1), replace(token(job, 1, "b "), attempt=1)]
    yield [finish(job, 2, 2)]  # attempt 0 again: a later stage's own first run


async def test_a_run_that_resumes_where_the_client_is_goes_on(gateway: LiveGateway) -> None:
    gateway.workers[0].script = resumed
    response = await gateway.client.post(CHAT, json=chat())
    assert response.json()["choices"][0]["message"]["content"] == "a b "


# -------------------------------------------------------------------- errors and time


def failing(exc: InvalidRequest | EngineError) -> Any:
    async def script(job: Job) -> AsyncIterator[Sequence[Event]]:
        yield [token(job, 0, "a "), token(job, 1, "b ")]
        yield [error(job, 2, exc)]

    return script


async def test_an_error_mid_stream_is_an_openai_error_event_then_done(
    gateway: LiveGateway,
) -> None:
    gateway.workers[0].script = failing(EngineError("the engine fell over"))
    response = await gateway.client.post(CHAT, json=chat(**STREAM))
    assert response.status_code == 200
    *_, failure, done = events(response.text)
    assert content(response.text) == "a b "
    assert failure.id == "2"
    assert failure.data == {
        "error": {
            "message": "the engine fell over",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
    }
    assert done.data == DONE


@pytest.mark.parametrize(
    ("exc", "status"),
    [(EngineError("the engine fell over"), 500), (InvalidRequest("bad schema", param="x"), 400)],
)
async def test_a_workers_error_is_the_status_of_a_json_answer(
    gateway: LiveGateway, exc: InvalidRequest | EngineError, status: int
) -> None:
    gateway.workers[0].script = failing(exc)
    error = error_of(await gateway.client.post(CHAT, json=chat()), status)
    assert (error["message"], error["code"], error["param"]) == (exc.message, exc.code, exc.param)


async def quiet_between(job: Job) -> AsyncIterator[Sequence[Event]]:
    yield [token(job, 0, "a ")]
    await asyncio.sleep(0.3)
    yield [token(job, 1, "b "), finish(job, 2, 2)]


async def test_keepalive_comments_fill_a_quiet_stream(gateway: LiveGateway) -> None:
    gateway.workers[0].script = quiet_between
    response = await gateway.client.post(CHAT, json=chat(**STREAM))
    items = parse_sse(response.text)
    first = items.index(next(item for item in items if isinstance(item, SseEvent) and item.id))
    after = items[first + 1 :]
    quiet = after[: after.index(next(item for item in after if isinstance(item, SseEvent)))]
    assert len(quiet) >= 2, response.text  # 0.3 s of quiet, a comment every 0.05 s
    assert set(quiet) == {": keep-alive"}
    assert content(response.text) == "a b "


async def test_the_openai_sdk_reads_a_stream_with_keepalives_between_ids(
    gateway: LiveGateway,
) -> None:
    """A keep-alive after an ``id:`` line must not look like an (empty) event to the SDK."""
    gateway.workers[0].script = quiet_between
    client = openai.AsyncOpenAI(
        base_url="http://gw/v1",
        api_key="x",
        http_client=gateway.client,  # type: ignore[arg-type]
    )
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "a b "


async def test_a_silent_worker_ends_in_a_504_and_a_cancel(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent
    response = await gateway.client.post(CHAT, json=chat(), headers={"X-Request-Timeout": "0.2"})
    assert error_of(response, 504)["code"] == "deadline_exceeded"
    [job] = gateway.workers[0].generate_jobs()
    assert job.deadline_unix - job.created_unix == pytest.approx(0.2)
    await gateway.state.cells.wait_background()
    assert await gateway.redis.get(names.cancel_flag(job.request_id)) == b"1"


async def test_a_silent_worker_ends_a_stream_with_a_timeout_event(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent
    response = await gateway.client.post(
        CHAT, json=chat(**STREAM), headers={"X-Request-Timeout": "0.2"}
    )
    assert response.status_code == 200  # the headers went out before the deadline
    role, failure, done = events(response.text)
    assert role.data["choices"][0]["delta"]["role"] == "assistant"
    assert failure.data["error"]["code"] == "deadline_exceeded"
    assert failure.data["error"]["type"] == "timeout"
    assert done.data == DONE


async def test_losing_the_reply_stream_ends_a_stream_with_a_503_event(
    gateway: LiveGateway,
) -> None:
    gateway.workers[0].script = silent
    async with gateway.call(CHAT, chat(**STREAM)) as call:
        assert await call.start() == 200
        await call.read_until(": keep-alive")  # the job is queued; nothing came back yet
        gateway.state.cells.home.router.interrupt_all("lost contact with Redis for 9s; retry")
        *_, failure, done = events(await call.read_all())
    assert failure.data["error"]["code"] == "backend_unavailable"
    assert "lost contact with Redis" in failure.data["error"]["message"]
    assert done.data == DONE


def answers_the_second_time() -> Any:
    """Silent for a request's first job; echoes when it is queued again."""
    seen: set[str] = set()

    async def script(job: Job) -> AsyncIterator[Sequence[Event]]:
        if job.request_id not in seen:
            seen.add(job.request_id)
            async for batch in silent(job):
                yield batch
        async for batch in echo(job):
            yield batch

    return script


async def lose_admission(gateway: LiveGateway, call: AsgiCall) -> None:
    """What a fail-over to a replica that never got the admission script leaves: no open
    entry, no admitted marker, no jobs (one script wrote them); then the reply router
    reconnects."""
    cell = gateway.state.cells.home
    opened = names.open_requests(cell.dispatcher.accounting.gateway_id)
    request_id = call.headers["x-request-id"]
    assert await gateway.redis.hdel(opened, request_id) == 1
    assert await gateway.redis.delete(names.admitted(request_id)) == 1
    assert cell.router.on_reconnect is not None
    await cell.router.on_reconnect()


async def test_a_request_whose_admission_redis_lost_is_queued_again_at_the_reconnect(
    gateway: LiveGateway, caplog: pytest.LogCaptureFixture
) -> None:
    gateway.workers[0].script = answers_the_second_time()
    async with (
        gateway.call(CHAT, chat(max_tokens=4, **STREAM)) as lost,
        gateway.call(CHAT, chat(**STREAM)) as kept,
    ):
        for call in (lost, kept):
            assert await call.start() == 200
            await call.read_until(": keep-alive")  # queued; nothing came back yet
        with caplog.at_level(logging.WARNING, logger="gateway.dispatch.lost_admissions"):
            await lose_admission(gateway, lost)
            text = await lost.read_all()
        assert content(text) == "c0-0 c0-1 c0-2 c0-3 "
        assert events(text)[-1].data == DONE
        lost_id = lost.headers["x-request-id"]
        assert [job.request_id for job in gateway.workers[0].generate_jobs()].count(lost_id) == 2
        assert f"queued {lost_id} again after Redis lost its admission" in caplog.text
        assert gateway.state.cells.home.router.open_requests() == 1  # the other one waits


async def first_token_then_silent(job: Job) -> AsyncIterator[Sequence[Event]]:
    yield [token(job, 0, "a ")]
    async for batch in silent(job):
        yield batch


async def test_a_lost_admission_whose_events_came_ends_with_a_503_not_a_second_run(
    gateway: LiveGateway,
) -> None:
    gateway.workers[0].script = first_token_then_silent
    async with gateway.call(CHAT, chat(**STREAM)) as lost:
        assert await lost.start() == 200
        await lost.read_until('"a "')
        await lose_admission(gateway, lost)
        *_, failure, done = events(await lost.read_all())
    assert failure.data["error"]["code"] == "backend_unavailable"
    assert "Redis lost this request's job" in failure.data["error"]["message"]
    assert "its first events had arrived" in failure.data["error"]["message"]
    assert done.data == DONE
    assert len(gateway.workers[0].generate_jobs()) == 1


# ------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("encoding", ["float", "base64"])
async def test_embeddings_in_input_order(gateway: LiveGateway, encoding: str) -> None:
    inputs = [[5], [5, 6], [5, 6, 7]]
    body = {**BODIES[EMBEDDINGS], "input": inputs, "encoding_format": encoding}
    response = await gateway.client.post(EMBEDDINGS, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert response.headers["X-Request-Id"].startswith("embd-")
    vectors = [item["embedding"] for item in answer["data"]]
    if encoding == "base64":
        vectors = [list(struct.unpack("<2f", base64.b64decode(v))) for v in vectors]
    assert [item["index"] for item in answer["data"]] == [0, 1, 2]
    assert vectors == [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]]  # the echo: [index, prompt length]
    assert answer["usage"] == {"prompt_tokens": 6, "total_tokens": 6}


async def test_an_embedding_error_is_the_answers_status(gateway: LiveGateway) -> None:
    async def refuse(job: Job) -> AsyncIterator[Sequence[Event]]:
        yield [error(job, 0, InvalidRequest("dimensions not supported", param="dimensions"))]

    gateway.workers[1].script = refuse
    response = await gateway.client.post(EMBEDDINGS, json={**BODIES[EMBEDDINGS], "dimensions": 2})
    assert error_of(response, 400)["param"] == "dimensions"
