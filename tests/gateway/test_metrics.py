"""GET /metrics: Prometheus text with requests by route/model/status, latency histograms,
tokens, queue depth and live workers (the real app in process, fake workers)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

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
