"""GET /metrics: Prometheus text with requests by route/model/status, latency histograms,
tokens, queue depth and live workers (the real app in process, fake workers)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.engine_stats import EngineStats
from shared.errors import KeyRateLimited
from shared.protocol import Event, FinishEvent, Job
from shared.queue.key_limits import Limits
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role
from tests.gateway.fake_worker import echo
from tests.gateway.harness import BODIES, CHAT, EMBEDDINGS, LiveGateway, error_of

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(live: LiveGateway) -> Samples:
    response = await live.client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_requests_are_counted_by_route_model_and_status(gateway: LiveGateway) -> None:
    for _ in range(2):
        assert (await gateway.client.post(CHAT, json=BODIES[CHAT])).status_code == 200
    error_of(await gateway.client.post(CHAT, json={**BODIES[CHAT], "model": "nope"}), 404)
    error_of(await gateway.client.post(CHAT, json={**BODIES[CHAT], "n": 0}), 400)
    assert (await gateway.client.post(EMBEDDINGS, json=BODIES[EMBEDDINGS])).status_code == 200
    samples = await scrape(gateway)
    chat = {"route": CHAT, "model": "tiny"}
    assert value(samples, "conveyor_requests_total", **chat, status="200") == 2
    invalid = {"route": CHAT, "model": "", "status": "400"}  # refused before its model is read
    assert value(samples, "conveyor_requests_total", **invalid) == 1
    unknown = {"route": CHAT, "model": "unknown", "status": "404"}
    assert value(samples, "conveyor_requests_total", **unknown) == 1
    embed_model = BODIES[EMBEDDINGS]["model"]
    embeds = {"route": EMBEDDINGS, "model": embed_model, "status": "200"}
    assert value(samples, "conveyor_requests_total", **embeds) == 1


async def test_latency_and_tokens_of_finished_requests(gateway: LiveGateway) -> None:
    answer = (await gateway.client.post(CHAT, json={**BODIES[CHAT], "max_tokens": 3})).json()
    samples = await scrape(gateway)
    assert value(samples, "conveyor_time_to_first_token_seconds_count", model="tiny") == 1
    done = {"model": "tiny", "status": "completed"}
    assert value(samples, "conveyor_request_duration_seconds_count", **done) == 1
    assert value(samples, "conveyor_request_duration_seconds_bucket", **done, le="+Inf") == 1
    usage = answer["usage"]
    assert value(samples, "conveyor_completion_tokens_total", model="tiny") == 3
    prompt = value(samples, "conveyor_prompt_tokens_total", model="tiny")
    assert prompt == usage["prompt_tokens"]


async def test_queue_depth_and_live_workers(gateway: LiveGateway) -> None:
    samples = await scrape(gateway)
    assert value(samples, "conveyor_live_workers", model="tiny", role="aggregated") == 1
    assert value(samples, "conveyor_live_workers", model="tiny-embed", role="embed") == 1
    depth = ("conveyor_queue_depth", frozenset({("stream", "conveyor:jobs:tiny:aggregated")}))
    assert samples[depth] == 0
    assert value(samples, "conveyor_open_requests") == 0


async def test_vllm_client_metrics_of_a_streamed_request(gateway: LiveGateway) -> None:
    body = {**BODIES[CHAT], "max_tokens": 4, "stream": True}
    response = await gateway.client.post(CHAT, json=body)
    assert response.status_code == 200
    samples = await scrape(gateway)
    model = {"model_name": "tiny"}
    assert value(samples, "vllm:time_to_first_token_seconds_count", **model) == 1
    assert value(samples, "vllm:e2e_request_latency_seconds_count", **model) == 1
    # One gap between each two of a choice's token events (the echo worker's: one token
    # each), as vLLM observes one latency per token after the first.
    assert value(samples, "vllm:inter_token_latency_seconds_count", **model) == 3
    assert value(samples, "vllm:generation_tokens_total", **model) == 4
    assert value(samples, "vllm:request_generation_tokens_sum", **model) == 4
    prompt = value(samples, "vllm:prompt_tokens_total", **model)
    assert prompt > 0
    assert value(samples, "vllm:request_prompt_tokens_sum", **model) == prompt
    assert value(samples, "vllm:request_success_total", **model, finished_reason="length") == 1
    ttft_le = {**model, "le": "0.001"}  # vLLM's first TTFT bucket
    assert ("vllm:time_to_first_token_seconds_bucket", frozenset(ttft_le.items())) in samples


async def test_queue_time_is_admission_to_the_workers_start(gateway: LiveGateway) -> None:
    """The worker's finish event says when it began the job; the gateway observes
    vllm:request_queue_time_seconds from its own admission time to that."""

    async def began_late(job: Job) -> AsyncIterator[Sequence[Event]]:
        async for batch in echo(job):
            yield [
                msgspec.structs.replace(e, started_unix=job.created_unix + 0.4)
                if isinstance(e, FinishEvent)
                else e
                for e in batch
            ]

    gateway.workers[0].script = began_late
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "max_tokens": 2, "n": 2})
    assert response.status_code == 200
    samples = await scrape(gateway)
    model = {"model_name": "tiny"}
    assert value(samples, "vllm:request_queue_time_seconds_count", **model) == 2
    assert abs(value(samples, "vllm:request_queue_time_seconds_sum", **model) - 0.8) < 1e-6
    assert value(samples, "vllm:request_queue_time_seconds_bucket", **model, le="0.3") == 0
    assert value(samples, "vllm:request_queue_time_seconds_bucket", **model, le="0.5") == 2


async def test_vllm_engine_metrics_come_from_the_heartbeats(gateway: LiveGateway) -> None:
    cell = gateway.state.cells.for_model("tiny")
    registry = WorkerRegistry(cell.redis, ttl_s=60)
    stats = EngineStats(
        running=3, waiting=2, kv_cache_usage=0.75, prefix_cache_queries=64,
        prefix_cache_hits=32, preemptions=1, iteration_tokens=(0, 2) + (0,) * 12,
        iteration_tokens_sum=10,
    )  # fmt: skip
    await registry.beat(
        WorkerRegistration(
            worker_id="w-stats",
            role=Role.AGGREGATED,
            model="tiny",
            max_model_len=2048,
            active=3,
            slots=8,
            engine_stats=stats,
        )
    )
    await cell.directory.refresh()
    samples = await scrape(gateway)
    labels = {"model_name": "tiny", "worker": "w-stats"}
    assert value(samples, "vllm:num_requests_running", **labels) == 3
    assert value(samples, "vllm:num_requests_waiting", **labels) == 2
    assert value(samples, "vllm:kv_cache_usage_perc", **labels) == 0.75
    assert value(samples, "vllm:prefix_cache_queries_total", **labels) == 64
    assert value(samples, "vllm:prefix_cache_hits_total", **labels) == 32
    assert value(samples, "vllm:num_preemptions_total", **labels) == 1
    assert value(samples, "vllm:iteration_tokens_total_count", **labels) == 2
    assert value(samples, "vllm:iteration_tokens_total_bucket", **labels, le="8.0") == 2
    # Workers whose engine reports nothing (the harness's) have no engine series.
    running = [key for key in samples if key[0] == "vllm:num_requests_running"]
    assert [dict(labels)["worker"] for _, labels in running] == ["w-stats"]


async def test_workers_by_state_dead_letters_and_migrations(gateway: LiveGateway) -> None:
    """Live workers by state (the registry entry's flags), each stream's dead letters,
    and migrated sequence runs (events of a later attempt) when the request ends."""
    cell = gateway.state.cells.for_model("tiny")
    registry = WorkerRegistry(cell.redis, ttl_s=60)
    for worker_id, flags in (("w-new", {"ready": False}), ("w-drain", {"draining": True})):
        await registry.beat(
            WorkerRegistration(
                worker_id=worker_id,
                role=Role.AGGREGATED,
                model="tiny",
                max_model_len=2048,
                active=0,
                slots=8,
                **flags,
            )
        )
    await cell.directory.refresh()
    await cell.redis.xadd("conveyor:jobs:tiny:aggregated:dead", {"reason": "poison"})

    async def migrated(job: Job) -> AsyncIterator[Sequence[Event]]:
        async for batch in echo(job):
            yield [msgspec.structs.replace(e, attempt=1) for e in batch]

    gateway.workers[0].script = migrated
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "max_tokens": 2, "n": 2})
    assert response.status_code == 200
    await gateway.state.cells.wait_background()
    samples = await scrape(gateway)
    tiny = {"model": "tiny", "role": "aggregated"}
    assert value(samples, "conveyor_workers", **tiny, state="ready") == 1  # the harness's
    assert value(samples, "conveyor_workers", **tiny, state="starting") == 1
    assert value(samples, "conveyor_workers", **tiny, state="draining") == 1
    stream = "conveyor:jobs:tiny:aggregated"
    assert value(samples, "conveyor_dead_letters", stream=stream) == 1
    assert value(samples, "conveyor_migrations_total", model="tiny") == 1


async def test_admissions_refused_by_reason_and_key_limit_refusals(gateway: LiveGateway) -> None:
    headers = {"Idempotency-Key": "once"}
    assert (await gateway.client.post(CHAT, json=BODIES[CHAT], headers=headers)).status_code == 200
    error_of(await gateway.client.post(CHAT, json=BODIES[CHAT], headers=headers), 409)
    gateway.state.draining = True
    error_of(await gateway.client.post(CHAT, json=BODIES[CHAT]), 503)
    gateway.state.draining = False
    dispatcher = gateway.state.cells.for_model("tiny").dispatcher
    with pytest.raises(KeyRateLimited):  # over its limit even for the cheapest request
        await dispatcher.check_limits("key-a", Limits(rpm=0), "tiny")
    samples = await scrape(gateway)
    refused = "conveyor_admissions_refused_total"
    assert value(samples, refused, model="tiny", reason="duplicate") == 1
    assert value(samples, refused, model="tiny", reason="draining") == 1
    assert value(samples, refused, model="tiny", reason="limited") == 1
    limit = {"key_id": "key-a", "limit": "requests"}
    assert value(samples, "conveyor_key_limit_refusals_total", **limit) == 1


async def test_backlog_and_oldest_job_per_model_and_role(gateway: LiveGateway) -> None:
    """Jobs waiting on a pool no worker reads (a prefill worker that has not read yet)."""
    cell = gateway.state.cells.for_model("tiny")
    await WorkerRegistry(cell.redis, ttl_s=60).beat(
        WorkerRegistration(
            worker_id="w-prefill", role=Role.PREFILL, model="tiny", max_model_len=2048,
            active=0, slots=8,
        )
    )  # fmt: skip
    await cell.directory.refresh()
    added_ms = int(time.time() * 1000) - 5_000
    for n in range(2):
        await cell.redis.xadd("conveyor:jobs:tiny:prefill", {"job": b"x"}, id=f"{added_ms}-{n}")
    samples = await scrape(gateway)
    prefill = {"model": "tiny", "role": "prefill"}
    assert value(samples, "conveyor_backlog", **prefill) == 2
    assert value(samples, "conveyor_oldest_job_age_seconds", **prefill) >= 5
    aggregated = {"model": "tiny", "role": "aggregated"}
    assert ("conveyor_backlog", frozenset(aggregated.items())) in samples
    assert value(samples, "conveyor_oldest_job_age_seconds", **aggregated) == 0


async def test_per_worker_figures_come_from_the_heartbeats(gateway: LiveGateway) -> None:
    """Steals, reclaims, KV transfers (P/D) and the embedding cache, per worker."""
    cell = gateway.state.cells.for_model("tiny")
    registry = WorkerRegistry(cell.redis, ttl_s=60)
    cache = {"hits": 3, "misses": 2, "evictions": 1, "entries": 4, "bytes": 4096}
    await registry.beat(
        WorkerRegistration(
            worker_id="w-decode", role=Role.DECODE, model="tiny", max_model_len=2048,
            active=0, slots=8, steals=2, reclaims=3, kv_transfers=5, kv_transfer_s=0.25,
            prompt_tokens_transferred=640, embedding_cache=cache,
        )
    )  # fmt: skip
    await cell.directory.refresh()
    samples = await scrape(gateway)
    labels = {"model_name": "tiny", "worker": "w-decode"}
    assert value(samples, "conveyor_worker_steals_total", **labels) == 2
    assert value(samples, "conveyor_worker_reclaims_total", **labels) == 3
    assert value(samples, "conveyor_kv_transfers_total", **labels) == 5
    assert value(samples, "conveyor_kv_transfer_seconds_total", **labels) == 0.25
    assert value(samples, "conveyor_prompt_tokens_transferred_total", **labels) == 640
    assert value(samples, "conveyor_embedding_cache_hits_total", **labels) == 3
    assert value(samples, "conveyor_embedding_cache_misses_total", **labels) == 2
    assert value(samples, "conveyor_embedding_cache_bytes", **labels) == 4096
    # Workers with no embedding cache (the harness's) have no cache series.
    hits = [key for key in samples if key[0] == "conveyor_embedding_cache_hits_total"]
    assert [dict(labels)["worker"] for _, labels in hits] == ["w-decode"]
