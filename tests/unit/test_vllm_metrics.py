"""The fleet metrics under vLLM's names: the stat logger's snapshot, the gateway's
collector, and every exported name, type and bucket list against the pinned vLLM."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.dispatch.request_tally import RequestTally
from gateway.metrics.vllm import ClientMetrics, EngineCollector
from shared.engine_stats import EngineStats, StatsRecorder, request_tokens_buckets
from shared.queue.liveness import WorkerRegistration
from shared.queue.usage import UsageRecord
from shared.roles import Role

stats = pytest.importorskip("vllm.v1.metrics.stats")
buckets = pytest.importorskip("vllm.v1.metrics.buckets")

ENGINE = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:iteration_tokens_total": "histogram",
}
CLIENT = {
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
BUCKETS = {
    "vllm:time_to_first_token_seconds": buckets.TIME_TO_FIRST_TOKEN_BUCKETS,
    "vllm:inter_token_latency_seconds": buckets.INTER_TOKEN_LATENCY_BUCKETS,
    "vllm:e2e_request_latency_seconds": buckets.REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": buckets.REQUEST_LATENCY_BUCKETS,
    "vllm:iteration_tokens_total": buckets.ITERATION_TOKENS_BUCKETS,
    "vllm:request_prompt_tokens": buckets.build_1_2_5_buckets(4096),
    "vllm:request_generation_tokens": buckets.build_1_2_5_buckets(4096),
}


def vllm_types() -> dict[str, str]:
    """Each metric's type as vLLM's PrometheusStatLogger creates it (read from its source:
    building the logger needs a whole VllmConfig)."""
    source = Path(stats.__file__).with_name("loggers.py").read_text()
    found = re.findall(r"\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_]+)\"", source)
    return {name: kind for kind, name in found}


def worker(stats: EngineStats) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id="w1", role=Role.AGGREGATED, model="m", max_model_len=4096, active=0,
        slots=4, engine_stats=stats,
    )  # fmt: skip


def exported(registry: CollectorRegistry) -> dict[str, object]:
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_stat_logger_keeps_the_latest_state_and_adds_up_counters() -> None:
    from workers.engines.vllm.stat_logger import record_step

    recorder = StatsRecorder()
    for running, hits in ((3, 16), (2, 0)):
        sched = stats.SchedulerStats(num_running_reqs=running, num_waiting_reqs=1)
        sched.kv_cache_usage = 0.25
        sched.prefix_cache_stats = stats.PrefixCacheStats(requests=1, queries=32, hits=hits)
        iteration = stats.IterationStats()
        iteration.num_generation_tokens = 3
        iteration.num_preempted_reqs = 1
        record_step(recorder, sched, iteration)
    record_step(recorder, None, None)  # a step with nothing to report changes nothing
    snapshot = recorder.snapshot()
    assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (2, 1, 0.25)
    assert (snapshot.prefix_cache_queries, snapshot.prefix_cache_hits) == (64, 16)
    assert snapshot.preemptions == 2
    assert snapshot.iteration_tokens[1] == 2  # two steps of 3 tokens: the le=8 bucket
    assert snapshot.iteration_tokens_sum == 6


def test_every_metric_has_vllms_name_type_and_buckets() -> None:
    registry = CollectorRegistry()
    tally = RequestTally(received_unix=100.0, finish_reasons=["stop"], token_gaps_s=[0.02])
    record = UsageRecord(
        request_id="r", key_id=None, model="m", prompt_tokens=5, completion_tokens=2,
        status="completed", received_unix=100.0, finished_unix=101.0, first_token_unix=100.5,
    )  # fmt: skip
    ClientMetrics(registry, max_model_len=4096).observe(record, tally)
    collector = EngineCollector()
    registry.register(collector)
    recorder = StatsRecorder()
    recorder.step(5)
    collector.set_workers([worker(recorder.snapshot())])
    families = exported(registry)
    types = vllm_types()
    for name, kind in {**ENGINE, **CLIENT}.items():
        assert types[name] == kind, name
        family = families[name.removesuffix("_total") if kind == "counter" else name]
        assert family.type == kind, name  # type: ignore[attr-defined]
    for name, bounds in BUCKETS.items():
        samples = families[name].samples  # type: ignore[attr-defined]
        les = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
        assert les == [*map(float, bounds), float("inf")], name
    assert request_tokens_buckets(4096) == buckets.build_1_2_5_buckets(4096)


def test_collector_exports_each_workers_snapshot() -> None:
    registry = CollectorRegistry()
    collector = EngineCollector()
    registry.register(collector)
    snapshot = EngineStats(
        running=2, waiting=5, kv_cache_usage=0.5, prefix_cache_queries=100,
        prefix_cache_hits=40, preemptions=1,
    )  # fmt: skip
    collector.set_workers([worker(snapshot)])
    value = registry.get_sample_value
    labels = {"model_name": "m", "worker": "w1"}
    assert value("vllm:num_requests_running", labels) == 2
    assert value("vllm:num_requests_waiting", labels) == 5
    assert value("vllm:kv_cache_usage_perc", labels) == 0.5
    assert value("vllm:prefix_cache_queries_total", labels) == 100
    assert value("vllm:prefix_cache_hits_total", labels) == 40
    assert value("vllm:num_preemptions_total", labels) == 1
    assert value("vllm:iteration_tokens_total_count", labels) == 0
    collector.set_workers([])  # the worker left: its series go
    assert value("vllm:num_requests_running", labels) is None


def test_queue_time_is_admission_to_the_first_stage_start_of_first_runs() -> None:
    """Each sequence's finish event says when a worker began it; a sequence taken over
    after a failure (attempt > 0) reports its last run's start, which is not queue time."""
    from shared.protocol import FinishEvent

    registry = CollectorRegistry()
    tally = RequestTally(received_unix=100.0)
    tally.note(FinishEvent("r", 0, 1, 0, "stop", 5, 1, None, 100.75))
    tally.note(FinishEvent("r", 1, 1, 2, "stop", 5, 1, None, 130.0))
    tally.note(FinishEvent("r", 2, 1, 0, "stop", 5, 1))  # an older worker: no start time
    assert tally.queue_times_s == [0.75]
    record = UsageRecord(
        request_id="r", key_id=None, model="m", prompt_tokens=5, completion_tokens=3,
        status="completed", received_unix=100.0, finished_unix=101.0,
    )  # fmt: skip
    ClientMetrics(registry, max_model_len=4096).observe(record, tally)
    labels = {"model_name": "m"}
    assert registry.get_sample_value("vllm:request_queue_time_seconds_count", labels) == 1
    assert registry.get_sample_value("vllm:request_queue_time_seconds_sum", labels) == 0.75
