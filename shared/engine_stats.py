"""What a worker's engine reports for the fleet metrics, and vLLM's histogram buckets.

A worker puts its engine's :class:`EngineStats` in its registry entry every heartbeat
(:class:`shared.queue.liveness.WorkerRegistration`); a gateway exports it under vLLM's
metric names (gateway/metrics/vllm.py). Counters are cumulative since the worker
started: a restarted worker starts from 0, which Prometheus reads as a counter reset.

The bucket boundaries are those of the pinned vLLM (``vllm/v1/metrics/buckets.py``),
copied so that the gateway never imports vLLM; tests/unit/test_vllm_metrics.py checks
them against the installed vLLM.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

import msgspec

ENGINE_STATS_VERSION: Final = 1

REQUEST_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS: Final[tuple[float, ...]] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: Final[tuple[float, ...]] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``request_tokens`` family: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's state (gauges) and its counters since the worker started."""

    v: int = ENGINE_STATS_VERSION
    running: int = 0
    """Sequences in the engine's running batch (vLLM's ``num_running_reqs``)."""
    waiting: int = 0
    """Sequences waiting to be scheduled."""
    kv_cache_usage: float = 0.0
    """Fraction of KV-cache blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens found."""
    preemptions: int = 0
    iteration_tokens: tuple[int, ...] = ()
    """Engine steps per :data:`ITERATION_TOKENS_BUCKETS` bucket (not cumulative), the
    last one for +Inf; empty when no step ran."""
    iteration_tokens_sum: int = 0
    engine_cpu_s: float = 0.0
    """CPU seconds the engine's own code took in the worker's process: the fake
    engine's step loop (planning steps, making outputs). 0 for vLLM, whose engine core
    is a process of its own. Benchmarks take it off the worker's CPU."""


class StatsRecorder:
    """Accumulates an engine's figures (from its step loop or its stat logger) and makes
    the :class:`EngineStats` a heartbeat publishes. Plain ints, so a heartbeat thread
    may read while the event loop writes."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        """False: the engine does not collect its figures (``engine_stats`` off)."""
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0
        self._steps = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._steps_tokens = 0
        self.engine_cpu_s = 0.0

    def scheduler(self, *, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running, self.waiting, self.kv_cache_usage = running, waiting, kv_cache_usage

    def prefix_lookup(self, queries: int, hits: int) -> None:
        self.prefix_cache_queries += queries
        self.prefix_cache_hits += hits

    def step(self, tokens: int) -> None:
        """One engine step that computed ``tokens`` tokens (prompt and generated)."""
        self._steps[bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1
        self._steps_tokens += tokens

    def snapshot(self) -> EngineStats:
        steps = tuple(self._steps)
        return EngineStats(
            running=self.running,
            waiting=self.waiting,
            kv_cache_usage=round(self.kv_cache_usage, 6),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            preemptions=self.preemptions,
            iteration_tokens=steps if any(steps) else (),
            iteration_tokens_sum=self._steps_tokens,
            engine_cpu_s=round(self.engine_cpu_s, 6),
        )
