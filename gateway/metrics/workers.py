"""Conveyor's per-worker figures, from the live workers' heartbeats (``conveyor_worker_*``,
``conveyor_kv_*``, ``conveyor_embedding_cache_*``; labels ``model_name`` and ``worker``):
jobs stolen and reclaimed, KV transfers of disaggregated prefill/decode, the encode
workers' embedding cache. As the engine figures (gateway/metrics/vllm.py), every gateway
exports every worker once: aggregate with ``max by (model_name, worker)`` (or scrape one
gateway), never a plain sum over gateways.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.metrics.vllm import WORKER
from shared.queue.liveness import WorkerRegistration

CACHE_COUNTERS = ("hits", "misses", "evictions")
CACHE_GAUGES = ("entries", "bytes", "max_bytes")


class WorkerCollector(Collector):
    """The gateway hands it the directory's live workers before each scrape."""

    def __init__(self) -> None:
        self._workers: list[WorkerRegistration] = []

    def set_workers(self, workers: Iterable[WorkerRegistration]) -> None:
        self._workers = list(workers)

    def collect(self) -> Iterator[Metric]:
        steals = CounterMetricFamily(
            "conveyor_worker_steals",
            "Jobs placed on another worker that this one took after they waited longer than "
            "CONVEYOR_PLACEMENT_STEAL_MS (cache-aware placement yielding to load).",
            labels=WORKER,
        )
        reclaims = CounterMetricFamily(
            "conveyor_worker_reclaims",
            "Jobs this worker took over from workers whose heartbeat expired (or that no "
            "live owner renewed) and ran again.",
            labels=WORKER,
        )
        transfers = CounterMetricFamily(
            "conveyor_kv_transfers", "KV-cache transfers from prefill workers received.",
            labels=WORKER,
        )  # fmt: skip
        transfer_s = CounterMetricFamily(
            "conveyor_kv_transfer_seconds", "Time spent receiving KV-cache transfers.",
            labels=WORKER,
        )  # fmt: skip
        transferred = CounterMetricFamily(
            "conveyor_prompt_tokens_transferred",
            "Prompt tokens whose KV cache came from a prefill worker.",
            labels=WORKER,
        )
        computed = CounterMetricFamily(
            "conveyor_prompt_tokens_computed", "Prompt tokens this worker's engine computed.",
            labels=WORKER,
        )  # fmt: skip
        cache_counters = {
            field: CounterMetricFamily(
                f"conveyor_embedding_cache_{field}",
                f"Image embedding cache {field} (encode workers).",
                labels=WORKER,
            )
            for field in CACHE_COUNTERS
        }
        cache_gauges = {
            field: GaugeMetricFamily(
                f"conveyor_embedding_cache_{field}",
                f"Image embedding cache: {field.replace('_', ' ')} (encode workers).",
                labels=WORKER,
            )
            for field in CACHE_GAUGES
        }
        for worker in self._workers:
            labels = [worker.model, worker.worker_id]
            steals.add_metric(labels, worker.steals)
            reclaims.add_metric(labels, worker.reclaims)
            transfers.add_metric(labels, worker.kv_transfers)
            transfer_s.add_metric(labels, worker.kv_transfer_s)
            transferred.add_metric(labels, worker.prompt_tokens_transferred)
            computed.add_metric(labels, worker.prompt_tokens_computed)
            cache = worker.embedding_cache
            if cache is None:
                continue
            for field, counter in cache_counters.items():
                counter.add_metric(labels, cache.get(field, 0))
            for field, gauge in cache_gauges.items():
                gauge.add_metric(labels, cache.get(field, 0))
        yield from (steals, reclaims, transfers, transfer_s, transferred, computed)
        yield from cache_counters.values()
        yield from cache_gauges.values()
