"""Prometheus metrics of one gateway process, served as text at ``GET /metrics``.

vLLM's own metrics (``vllm:*``, gateway/metrics/vllm.py) and Conveyor's (``conveyor_*``),
in one registry per app (never the process-global one). Conveyor's are of two kinds:

- counted as they happen: HTTP answers by route / model / status
  (:class:`RequestMetrics`, an ASGI middleware), and per finished request its time
  to first token, end-to-end latency and tokens (:meth:`GatewayMetrics.observe_usage`,
  from the usage record the dispatcher writes);
- counted where admission refuses a request: refusals by reason, and per API key
  which limit ran out (:meth:`GatewayMetrics.observe_refusal`);
- read at scrape time (:meth:`GatewayMetrics.refresh`): job-queue depth per stream,
  backlog and oldest job per (model, role), live workers per role, the ledger's
  backlog and lag, the API-key cache and the requests this gateway holds open;
  per-worker figures from the heartbeats (gateway/metrics/workers.py).

Placement (gateway/placement/) counts each decision by reason and the prompt blocks
cached where the job went (:class:`~gateway.metrics.placement.PlacementMetrics`).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.dispatch.refusal import Refusal
from gateway.dispatch.request_tally import RequestTally
from gateway.metrics.placement import PlacementMetrics
from gateway.metrics.vllm import DEFAULT_MAX_MODEL_LEN, ClientMetrics, EngineCollector
from gateway.metrics.workers import WorkerCollector
from shared.queue import names
from shared.queue.job_queue import JobQueue
from shared.queue.usage import UsageRecord

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from gateway.state import GatewayState
    from shared.queue.liveness import WorkerRegistration

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
UNKNOWN_MODEL = "unknown"
"""The model label of a request naming no served model (labels stay a bounded set)."""


class GatewayMetrics:
    def __init__(self, max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.vllm = ClientMetrics(r, max_model_len)
        self.engines = EngineCollector()
        r.register(self.engines)
        self.requests = Counter(
            "conveyor_requests", "HTTP answers.", ["route", "model", "status"], registry=r
        )
        self.ttft = Histogram(
            "conveyor_time_to_first_token_seconds",
            "From admission to the first token delivered.",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.latency = Histogram(
            "conveyor_request_duration_seconds",
            "From admission to the end of the request (any outcome).",
            ["model", "status"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "conveyor_prompt_tokens", "Prompt tokens of finished requests.", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            "conveyor_cached_prompt_tokens",
            "Prompt tokens the engine served from its prefix cache.",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "conveyor_completion_tokens",
            "Completion tokens delivered to clients.",
            ["model"],
            registry=r,
        )
        self.placement = PlacementMetrics(r)
        self.migrations = Counter(
            "conveyor_migrations",
            "Takeovers of a request's sequences by another worker after a failure (per "
            "request, its most-moved sequence), counted when the request ends.",
            ["model"],
            registry=r,
        )
        self.refused = Counter(
            "conveyor_admissions_refused",
            "Requests refused at admission, by reason: full (queue), limited (an API key's "
            "limit), duplicate (Idempotency-Key), no_worker, unavailable (Redis), draining.",
            ["model", "reason"],
            registry=r,
        )
        self.key_refusals = Counter(
            "conveyor_key_limit_refusals",
            "Requests refused for an API key's limit (requests, tokens, concurrency, budget).",
            ["key_id", "limit"],
            registry=r,
        )
        self.fleet = WorkerCollector()
        r.register(self.fleet)
        self._scraped = _ScrapeGauges(r, self.engines, self.fleet)

    def observe_usage(self, record: UsageRecord, tally: RequestTally) -> None:
        """One finished request (its usage record, as the ledger gets it, and its tally)."""
        self.vllm.observe(record, tally)
        model = record.model
        if record.first_token_unix is not None:
            self.ttft.labels(model).observe(
                max(0.0, record.first_token_unix - record.received_unix)
            )
        elapsed_s = max(0.0, record.finished_unix - record.received_unix)
        self.latency.labels(model, record.status).observe(elapsed_s)
        self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        self.completion_tokens.labels(model).inc(record.completion_tokens)
        if record.cached_prompt_tokens:
            self.cached_tokens.labels(model).inc(record.cached_prompt_tokens)
        if tally.migrations:
            self.migrations.labels(model).inc(tally.migrations)

    def observe_refusal(self, refusal: Refusal) -> None:
        self.refused.labels(refusal.model, refusal.reason).inc()
        if refusal.key_id is not None and refusal.limit is not None:
            self.key_refusals.labels(refusal.key_id, refusal.limit).inc()

    async def refresh(self, state: GatewayState) -> None:
        await self._scraped.refresh(state)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeGauges:
    """Gauges read from the gateway's state and Redis at every scrape."""

    def __init__(
        self, r: CollectorRegistry, engines: EngineCollector, fleet: WorkerCollector
    ) -> None:
        self._engines = engines
        self._fleet = fleet
        self.queue_depth = Gauge(
            "conveyor_queue_depth", "Jobs queued or running per job stream.", ["stream"], registry=r
        )
        self.backlog = Gauge(
            "conveyor_backlog",
            "Jobs queued or running per model and role (shared and workers' own streams): "
            "the autoscaling signal.",
            ["model", "role"],
            registry=r,
        )
        self.oldest_job = Gauge(
            "conveyor_oldest_job_age_seconds",
            "Age of the oldest job queued or running per model and role (0: none).",
            ["model", "role"],
            registry=r,
        )
        self.workers = Gauge(
            "conveyor_live_workers",
            "Live workers per model and role.",
            ["model", "role"],
            registry=r,
        )
        self.workers_by_state = Gauge(
            "conveyor_workers",
            "Live workers per model, role and state (starting, ready, draining, paused).",
            ["model", "role", "state"],
            registry=r,
        )
        self.dead_letters = Gauge(
            "conveyor_dead_letters",
            "Jobs in a job stream's dead-letter stream (failed too often).",
            ["stream"],
            registry=r,
        )
        self.open_requests = Gauge(
            "conveyor_open_requests", "Requests this gateway is delivering.", registry=r
        )
        self.ledger_backlog = Gauge(
            "conveyor_ledger_backlog", "Usage records not yet in SQL (all gateways).", registry=r
        )
        self.ledger_lag = Gauge(
            "conveyor_ledger_seconds_since_commit",
            "Seconds since this gateway's ledger consumer last committed (-1: never).",
            registry=r,
        )
        self.ledger_db_ok = Gauge(
            "conveyor_ledger_database_ok", "1 while the ledger can write to SQL.", registry=r
        )
        self.orphan_rows = Gauge(
            "conveyor_orphan_usage_rows",
            "Usage rows this gateway wrote for requests of dead gateways (since start).",
            registry=r,
        )
        self.key_cache = Gauge(
            "conveyor_key_cache",
            "API-key cache: keys held, loaded (1/0), database reachable (1/0), age in s.",
            ["field"],
            registry=r,
        )

    async def refresh(self, state: GatewayState) -> None:
        self.open_requests.set(state.cells.open_requests())
        self.workers.clear()
        self.workers_by_state.clear()
        self.queue_depth.clear()
        self.backlog.clear()
        self.oldest_job.clear()
        self.dead_letters.clear()
        live = []
        for cell in state.cells.all():
            workers = cell.directory.all()
            live.extend(workers)
            await self._queues_and_workers(cell.redis, workers)
        self._engines.set_workers(live)
        self._fleet.set_workers(live)
        control = state.control
        if control is None:
            return
        self.ledger_backlog.set(await control.backlog())
        ledger = control.ledger.status
        committed = ledger.last_commit_unix
        self.ledger_lag.set(time.time() - committed if committed is not None else -1)
        self.ledger_db_ok.set(1 if ledger.db_ok else 0)
        self.orphan_rows.set(control.orphan_rows())
        cache = control.keys.status()
        self.key_cache.labels("keys").set(cache.keys)
        self.key_cache.labels("loaded").set(1 if cache.loaded else 0)
        self.key_cache.labels("db_ok").set(1 if cache.db_ok else 0)
        age = time.time() - cache.loaded_unix if cache.loaded_unix is not None else -1
        self.key_cache.labels("age_s").set(age)

    async def _queues_and_workers(
        self, redis: aioredis.Redis, live: list[WorkerRegistration]
    ) -> None:
        """One Redis's live workers and the depth of their job streams."""
        for (model, role), count in Tally((w.model, w.role.value) for w in live).items():
            self.workers.labels(model, role).set(count)
        states = Tally((w.model, w.role.value, worker_state(w)) for w in live)
        for (model, role, state), count in states.items():
            self.workers_by_state.labels(model, role, state).set(count)
        pools = {names.job_stream(w.model, w.role): (w.model, w.role.value) for w in live}
        streams = sorted(pools)
        queue = JobQueue(redis)
        dead: list[Any] = []
        if streams:
            async with redis.pipeline(transaction=False) as pipe:
                for stream in streams:
                    pipe.xlen(names.dead_letter_stream(stream))
                dead = await pipe.execute()
        for stream, dead_letters in zip(streams, dead, strict=True):
            # the shared stream and the workers' own ones (placement)
            depth = await queue.depth(stream)
            self.queue_depth.labels(stream).set(depth)
            self.backlog.labels(*pools[stream]).set(depth)
            oldest_ms = await queue.oldest_entry_ms(stream) if depth else None
            age_s = 0.0 if oldest_ms is None else max(0.0, time.time() - oldest_ms / 1000)
            self.oldest_job.labels(*pools[stream]).set(age_s)
            self.dead_letters.labels(stream).set(int(dead_letters))


def worker_state(worker: WorkerRegistration) -> str:
    if not worker.ready:
        return "starting"
    if worker.paused:
        return "paused"
    return "draining" if worker.draining else "ready"


class RequestMetrics:
    """ASGI middleware: counts every HTTP answer by route template, model and status
    (the OpenAI routes leave the requested model in ``request.state.model``)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500  # an exception before any answer

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, sending)
        finally:
            # Before the lifespan has built the state (or in a test app without one), the
            # answer is not counted.
            state = getattr(scope["app"].state, "gateway", None)
            metrics = getattr(state, "metrics", None)
            if isinstance(metrics, GatewayMetrics):
                route = getattr(scope.get("route"), "path", "unmatched")
                model = model_label(state, scope.get("state", {}).get("model"))
                metrics.requests.labels(route, model, str(status)).inc()


def model_label(state: Any, model: object) -> str:
    """A requested model as a label: a served model's name, ``unknown``, or empty."""
    if not isinstance(model, str):
        return ""
    served = {m.name for m in state.catalog.all()}
    return model if model in served else UNKNOWN_MODEL
