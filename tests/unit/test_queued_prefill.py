"""A worker's queued prefill counts only the prompt tokens it has to compute: the gateway
tells it, on each job it placed by cache, how much of the prompt the worker holds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from gateway.dispatch.dispatcher import _expecting_cached
from shared.protocol import EmbedJob, GenerateJob, ImageRef, Job, decode, encode
from tests.unit.worker_harness import make_job, with_sampling
from workers.assembly import announceable
from workers.intake.active_jobs import ActiveJobs
from workers.roles.base import JobRun


def _run(job: GenerateJob, next_seq: int = 0) -> JobRun:
    lease = SimpleNamespace(job_id=job.job_id, next_seq=next_seq, delivery=SimpleNamespace(job=job))
    return cast(JobRun, SimpleNamespace(lease=lease))


def _prompt(job: GenerateJob, tokens: int, cached: int = 0) -> GenerateJob:
    return msgspec.structs.replace(job, prompt_token_ids=list(range(tokens)), cached_tokens=cached)


async def test_queued_prefill_leaves_out_what_the_gateway_found_cached() -> None:
    jobs = ActiveJobs(max_slots=4)
    task: asyncio.Task[Any] = asyncio.create_task(asyncio.sleep(0))
    jobs.add(_run(_prompt(make_job("placed"), 1500, cached=1280)), task)
    jobs.add(_run(_prompt(make_job("shared"), 300)), task)
    assert jobs.queued_prefill_tokens() == 220 + 300
    await task


async def test_a_job_that_has_sent_something_is_not_queued_prefill() -> None:
    jobs = ActiveJobs(max_slots=4)
    task: asyncio.Task[Any] = asyncio.create_task(asyncio.sleep(0))
    run = _run(_prompt(make_job("started"), 500))
    jobs.add(run, task)
    run.lease.next_seq = 1  # its first event left
    assert jobs.queued_prefill_tokens() == 0
    await task


def test_placed_jobs_carry_the_cached_tokens_and_the_field_travels() -> None:
    embed = EmbedJob(
        request_id="e", index=0, model="m", prompt_token_ids=[1], reply_to="r",
        deadline_unix=0.0, created_unix=0.0,
    )  # fmt: skip
    jobs: list[Job] = [make_job("a"), make_job("a", 1), embed]
    placed = _expecting_cached(jobs, 256)
    assert [getattr(job, "cached_tokens", None) for job in placed] == [256, 256, None]
    assert decode(encode(placed[0])) == placed[0]


def test_only_prompts_named_by_their_tokens_and_computed_here_are_announced() -> None:
    job = make_job("r")
    assert announceable(job)
    assert not announceable(msgspec.structs.replace(job, handoff={"kv": "elsewhere"}))
    assert not announceable(msgspec.structs.replace(job, images=(ImageRef("d" * 64, 10),)))
    assert not announceable(with_sampling(job, cache_salt="tenant"))
