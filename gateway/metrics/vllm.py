"""The fleet's metrics under vLLM's own names, labels and buckets (the pinned vLLM's
``vllm/v1/metrics/loggers.py``), so dashboards and autoscaling rules made for vLLM work.

Two sources:

- client-felt, measured here as requests are delivered (:class:`ClientMetrics`, label
  ``model_name``): time to first token, inter-token latency, end-to-end latency, queue
  time (admission to a worker beginning the job: its final event says when),
  prompt and generation tokens, finished sequences by reason. Each gateway counts its
  own requests, so a sum over gateways is the fleet's.
- engine state, from the workers' heartbeats (:class:`EngineCollector`, labels
  ``model_name`` and ``worker``): running and waiting sequences, KV-cache usage, prefix
  cache, preemptions, tokens per engine step. Read at scrape time from the live workers
  this gateway's directory holds; every gateway exports every worker, so aggregate
  them with ``max by (model_name, worker)`` (or scrape one gateway), never a plain sum
  over gateways.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.dispatch.request_tally import RequestTally
from shared.engine_stats import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EngineStats,
    request_tokens_buckets,
)
from shared.queue.liveness import WorkerRegistration
from shared.queue.usage import UsageRecord

MODEL = ["model_name"]
WORKER = ["model_name", "worker"]
DEFAULT_MAX_MODEL_LEN = 32768


class ClientMetrics:
    """Client-felt latencies and tokens of the requests this gateway delivered."""

    def __init__(self, r: CollectorRegistry, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        tokens = request_tokens_buckets(max_model_len)
        self.ttft = _histogram(r, "time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = _histogram(r, "inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = _histogram(r, "e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)
        self.queue_time = _histogram(r, "request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.prompt_hist = _histogram(r, "request_prompt_tokens", tokens)
        self.generation_hist = _histogram(r, "request_generation_tokens", tokens)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", MODEL, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", MODEL, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*MODEL, "finished_reason"],
            registry=r,
        )

    def start_series(self, models: Iterable[str]) -> None:
        """Each served model's token counters at 0 from the start (as vLLM's own), so the
        first request's tokens are an increase ``rate()`` sees, not a new series."""
        for model in models:
            self.prompt_tokens.labels(model)
            self.generation_tokens.labels(model)

    def observe(self, record: UsageRecord, tally: RequestTally) -> None:
        """One finished request (its usage record and what its handle counted)."""
        model = record.model
        if record.first_token_unix is not None:
            self.ttft.labels(model).observe(
                max(0.0, record.first_token_unix - record.received_unix)
            )
        observe_all(self.itl.labels(model), tally.token_gaps_s)
        self.e2e.labels(model).observe(max(0.0, record.finished_unix - record.received_unix))
        queue_time = self.queue_time.labels(model)
        for wait_s in tally.queue_times_s:
            queue_time.observe(wait_s)
        self.prompt_hist.labels(model).observe(record.prompt_tokens)
        self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        self.generation_tokens.labels(model).inc(record.completion_tokens)
        for reason in tally.finish_reasons:
            self.success.labels(model, reason).inc()
        if tally.finish_reasons:  # a generation, not an embedding
            for tokens in tally.tokens_by_choice.values() or [0]:
                self.generation_hist.labels(model).observe(tokens)


def observe_all(histogram: Histogram, values: Sequence[float]) -> None:
    """``histogram.observe`` of each value, with one update per bucket: a request's
    inter-token gaps are one per token, and ``observe`` scans the buckets and takes a
    lock for each. Uses the child's ``_upper_bounds``, ``_buckets`` and ``_sum``, which
    ``observe`` itself updates (prometheus_client 0.2x); tests/unit/test_observe_all.py
    checks the result is the same."""
    if len(values) < 4:
        for value in values:
            histogram.observe(value)
        return
    bounds: list[float] = histogram._upper_bounds
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1
    histogram._sum.inc(sum(values))
    for bucket, count in zip(histogram._buckets, counts, strict=True):
        if count:
            bucket.inc(count)


def _histogram(r: CollectorRegistry, name: str, buckets: Iterable[float]) -> Histogram:
    return Histogram(f"vllm:{name}", _HELP[name], MODEL, buckets=tuple(buckets), registry=r)


_HELP = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
}


class EngineCollector(Collector):
    """The engine figures of the live workers, from their latest heartbeat; the gateway
    hands it the directory's workers before each scrape (:meth:`set_workers`)."""

    def __init__(self) -> None:
        self._workers: list[WorkerRegistration] = []

    def set_workers(self, workers: Iterable[WorkerRegistration]) -> None:
        self._workers = [w for w in workers if w.engine_stats is not None]

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            labels=WORKER,
        )  # fmt: skip
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            labels=WORKER,
        )  # fmt: skip
        kv = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            labels=WORKER,
        )  # fmt: skip
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=WORKER,
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels=WORKER,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            labels=WORKER,
        )  # fmt: skip
        steps = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            labels=WORKER,
        )  # fmt: skip
        for worker in self._workers:
            stats = worker.engine_stats
            assert stats is not None
            labels = [worker.model, worker.worker_id]
            running.add_metric(labels, stats.running)
            waiting.add_metric(labels, stats.waiting)
            kv.add_metric(labels, stats.kv_cache_usage)
            queries.add_metric(labels, stats.prefix_cache_queries)
            hits.add_metric(labels, stats.prefix_cache_hits)
            preemptions.add_metric(labels, stats.preemptions)
            steps.add_metric(labels, _cumulative(stats), stats.iteration_tokens_sum)
        yield from (running, waiting, kv, queries, hits, preemptions, steps)


def _cumulative(stats: EngineStats) -> list[tuple[str, float]]:
    counts = list(stats.iteration_tokens) or [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    bounds = [*(_bound(b) for b in ITERATION_TOKENS_BUCKETS), "+Inf"]
    total = 0
    buckets = []
    for bound, count in zip(bounds, counts, strict=False):
        total += count
        buckets.append((bound, float(total)))
    return buckets


def _bound(value: float) -> str:
    return repr(float(value))
