"""vLLM stat loggers: what AsyncLLM reports after every engine step, kept for the worker.

:func:`stats_logger` keeps the latest ``SchedulerStats`` and adds up the counters vLLM's
own PrometheusStatLogger adds up (``vllm/v1/metrics/loggers.py``), into a
:class:`~shared.engine_stats.StatsRecorder` the heartbeat publishes.
:func:`prompt_stats_logger` counts where prompt tokens came from (disaggregated
serving's telemetry).
"""

from __future__ import annotations

from typing import Any

from shared.engine_stats import StatsRecorder
from workers.engines.base import PromptTokenStats


def record_step(recorder: StatsRecorder, scheduler_stats: Any, iteration_stats: Any) -> None:
    """One step's ``SchedulerStats`` / ``IterationStats`` (either may be None), as
    PrometheusStatLogger.record reads them."""
    if scheduler_stats is not None:
        recorder.scheduler(
            running=int(scheduler_stats.num_running_reqs),
            waiting=int(scheduler_stats.num_waiting_reqs)
            + int(getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)),
            kv_cache_usage=float(scheduler_stats.kv_cache_usage),
        )
        prefix = scheduler_stats.prefix_cache_stats
        recorder.prefix_lookup(int(prefix.queries), int(prefix.hits))
    if iteration_stats is not None:
        recorder.preemptions += int(iteration_stats.num_preempted_reqs)
        computed = int(iteration_stats.prompt_token_stats.computed)
        recorder.step(computed + int(iteration_stats.num_generation_tokens))


def stats_logger(recorder: StatsRecorder) -> Any:
    """A ``StatLoggerFactory`` for ``AsyncLLM(stat_loggers=[...])``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class EngineStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any
        ) -> None:
            record_step(recorder, scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return EngineStatsLogger


def prompt_stats_logger(stats: PromptTokenStats) -> Any:
    """A vLLM stat logger that counts where prompt tokens came from."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PromptStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any
        ) -> None:
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt is not None and prompt.total:
                stats.computed += int(prompt.computed)
                stats.from_local_cache += int(prompt.local_cache_hit)
                stats.transferred += int(prompt.external_kv_transfer)
            transfers = getattr(scheduler_stats, "kv_connector_stats", None) or {}
            durations = transfers.get("transfer_duration") if isinstance(transfers, dict) else None
            if durations:
                stats.kv_transfers += len(durations)
                stats.kv_transfer_s += float(sum(durations))

        def log_engine_initialized(self) -> None:
            pass

    return PromptStatsLogger
