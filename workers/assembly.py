"""Wiring a worker: its policy from :class:`WorkerSettings`, its units from what they need.

:func:`build_worker` is the one place that constructs the units of a worker and
passes each its collaborators (see :mod:`workers.runtime` for how they run). Tests
build workers with it too, injecting what they need to control (a Redis client,
journal scripts that fail, the timing of the loops, a table of recent cancels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared.protocol import GenerateJob, Job
from shared.queue.job_queue import JobQueue, JobStream
from shared.queue.kv_events import KvEventWriter
from shared.queue.liveness import GatewayWatch, HeartbeatThread, WorkerRegistry
from shared.queue.worker_streams import WorkerStreams
from shared.roles import Role
from shared.settings import WorkerSettings
from shared.tracing.spans import Tracer
from workers.commands.admin import WorkerAdmin
from workers.commands.listener import CommandListener
from workers.commands.lora_sync import LoraReconciler, LoraTiming
from workers.engines.base import PublishesKvEvents
from workers.engines.kv_events import KvEventForwarder
from workers.health.canary import Canary
from workers.health.status import HEALTH_CHECK_INTERVAL_S, EngineMonitor, Heartbeat, WorkerStatus
from workers.intake.active_jobs import ActiveJobs, Lifecycle
from workers.intake.checks import Intake, IntakePolicy
from workers.intake.consumer import JobConsumer, JobReader, Placed
from workers.intake.janitor import (
    JANITOR_INTERVAL_S,
    ORPHAN_CHECK_INTERVAL_S,
    Janitor,
    JanitorTiming,
    Reclaimer,
    stall_check,
)
from workers.intake.recent_cancels import RecentCancels
from workers.intake.run_trace import RunTracer
from workers.intake.stealing import Stealer
from workers.journal.run_journal import JOURNAL_RETRY_S, RunJournal
from workers.journal.scripts import JournalScripts
from workers.roles.base import RoleParts
from workers.runtime import Helper, WorkerRuntime

CACHING_ROLES = (Role.AGGREGATED, Role.PREFILL)
"""Roles whose jobs compute their prompt's KV blocks (announced to the gateways)."""


@dataclass(frozen=True, slots=True)
class WorkerPolicy:
    """A worker's limits and timeouts: always built from :class:`WorkerSettings`."""

    max_slots: int
    heartbeat_ttl_s: float
    claim_idle_s: float
    shutdown_grace_s: float
    max_deliveries: int
    migration_limit: int
    canary_idle_s: float
    job_read_block_ms: int
    gateway_liveness_ttl_s: float
    kv_snapshot_interval_s: float = 10.0
    placement: bool = False
    """Read an own job stream first and steal (CONVEYOR_PLACEMENT)."""
    placement_steal_ms: int = 30
    stream_join_waiting: bool = False
    """A job's token events still waiting to be written leave as one event."""

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> WorkerPolicy:
        return cls(
            max_slots=settings.worker_max_slots,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
            claim_idle_s=settings.claim_idle_s,
            shutdown_grace_s=settings.shutdown_grace_s,
            max_deliveries=settings.max_deliveries,
            migration_limit=settings.migration_limit,
            canary_idle_s=settings.canary_idle_s,
            job_read_block_ms=settings.job_read_block_ms,
            gateway_liveness_ttl_s=settings.gateway_liveness_ttl_s,
            kv_snapshot_interval_s=settings.kv_snapshot_interval_s,
            placement=settings.placement,
            placement_steal_ms=settings.placement_steal_ms,
            stream_join_waiting=settings.stream_join_waiting,
        )


@dataclass(frozen=True, slots=True)
class Timing:
    """How often the helper loops run and how long the journal rides out Redis trouble
    (code constants, not settings; tests shorten them)."""

    janitor_s: float = JANITOR_INTERVAL_S
    orphan_check_s: float = ORPHAN_CHECK_INTERVAL_S
    health_check_s: float = HEALTH_CHECK_INTERVAL_S
    journal_retry_s: float = JOURNAL_RETRY_S
    adapters: LoraTiming = field(default_factory=LoraTiming)


def build_worker(
    *,
    worker_id: str,
    role: Role,
    model: str,
    parts: RoleParts,
    redis: aioredis.Redis,
    policy: WorkerPolicy,
    heartbeat_redis_url: str | None = None,
    timing: Timing = Timing(),
    scripts: JournalScripts | None = None,
    recent_cancels: RecentCancels | None = None,
    tracer: Tracer | None = None,
) -> WorkerRuntime:
    """A worker of ``role`` serving ``model``. ``heartbeat_redis_url`` set: beat from a
    thread with its own connection to that Redis (else from the event loop)."""
    streams = [JobStream(model, role)]
    queue = JobQueue(redis)
    registry = WorkerRegistry(redis, ttl_s=policy.heartbeat_ttl_s)
    jobs = ActiveJobs(policy.max_slots)
    lifecycle = Lifecycle(worker_id, jobs)
    journal = RunJournal(
        redis,
        consumer=worker_id,
        on_fenced=jobs.fence,
        scripts=scripts,
        retry_for_s=timing.journal_retry_s,
        join_tokens=policy.stream_join_waiting,
    )
    recent = recent_cancels or RecentCancels()
    gateways = GatewayWatch(redis, grace_s=policy.gateway_liveness_ttl_s)
    canary = Canary(parts.probe, idle_s=policy.canary_idle_s)
    kv_events = _kv_event_forwarder(parts, redis, worker_id, model, policy)
    own_streams = WorkerStreams(redis, queue) if policy.placement else None
    placed = (
        None
        if own_streams is None
        else Placed(
            own_streams, Stealer(own_streams, worker_id, steal_ms=policy.placement_steal_ms)
        )
    )
    consumer = JobConsumer(
        reader=JobReader(queue, streams, worker_id, policy.job_read_block_ms, placed),
        journal=journal,
        intake=Intake(redis, IntakePolicy(policy.max_deliveries, policy.migration_limit), gateways),
        jobs=jobs,
        lifecycle=lifecycle,
        new_run=parts.new_run,
        recent_cancels=recent,
        on_start=_on_start(canary, kv_events if role in CACHING_ROLES else None),
        runs_traced=RunTracer(tracer, worker_id) if tracer is not None else None,
    )
    adapters = LoraReconciler(
        redis=redis,
        model=model,
        role=role,
        adapters=parts.adapters,
        off_reason=parts.adapters_off,
        streams=consumer,
        timing=timing.adapters,
    )
    admin = WorkerAdmin(
        redis,
        worker_id=worker_id,
        lifecycle=lifecycle,
        consumer=consumer,
        jobs=jobs,
        admin=parts.admin,
    )
    reclaimer = Reclaimer(
        queue=queue,
        registry=registry,
        streams=streams,
        worker_id=worker_id,
        claim_idle_s=policy.claim_idle_s,
        start=consumer.start_all,
        in_hand=lambda: jobs.entries_in_hand() | journal.entries_unwritten(),
        placed=own_streams,
    )
    status = WorkerStatus(
        worker_id=worker_id,
        role=role,
        parts=parts,
        jobs=jobs,
        lifecycle=lifecycle,
        canary=canary,
        adapters=adapters,
        placement=consumer,
        reclaims=lambda: reclaimer.reclaims,
    )
    thread = (
        None
        if heartbeat_redis_url is None
        else HeartbeatThread(
            heartbeat_redis_url,
            worker_id,
            policy.heartbeat_ttl_s,
            lambda: registry.encode(status()),
        )
    )
    if thread is not None and policy.placement:
        jobs.on_change = thread.nudge
    janitor = Janitor(
        jobs=jobs,
        lifecycle=lifecycle,
        journal=journal,
        reclaimer=reclaimer,
        gateways=gateways,
        stalled=stall_check(thread, policy.heartbeat_ttl_s, timing.janitor_s),
        timing=JanitorTiming(timing.janitor_s, timing.orphan_check_s, policy.heartbeat_ttl_s),
    )
    helpers: dict[str, Helper] = {
        "heartbeat": Heartbeat(registry, status, thread).run,
        "commands": CommandListener(
            redis, recent=recent, cancel_request=jobs.cancel_request, on_command=admin.handle
        ).run,
        "lora-sync": adapters.run,
        "engine-monitor": EngineMonitor(
            parts.engine, interval_s=timing.health_check_s, on_dead=lifecycle.engine_died
        ).run,
        "janitor": janitor.run,
        "canary": lambda: canary.run(lifecycle.busy),
    }
    if kv_events is not None:
        helpers["kv-events"] = kv_events.run
    return WorkerRuntime(
        worker_id=worker_id,
        consumer=consumer,
        journal=journal,
        jobs=jobs,
        lifecycle=lifecycle,
        registry=registry,
        helpers=helpers,
        shutdown_grace_s=policy.shutdown_grace_s,
        startup=lambda: adapters.start(lambda: lifecycle.stopping),
    )


def _on_start(canary: Canary, kv_events: KvEventForwarder | None) -> Callable[[Job], None]:
    """What a job's start tells the canary (the worker is in use) and, where the engine's
    cache is indexed, the gateways (the blocks its prompt is about to fill)."""
    if kv_events is None:
        return lambda _job: canary.note_activity()

    def started(job: Job) -> None:
        canary.note_activity()
        if isinstance(job, GenerateJob) and announceable(job):
            kv_events.announce(job.prompt_token_ids, job.adapter, job.cached_tokens)

    return started


def announceable(job: GenerateJob) -> bool:
    """Whether the job's prompt blocks are named by their tokens alone (what the engine
    hashes with images or a cache salt is never indexed) and computed here (a decode job's
    arrive with its handoff)."""
    return job.handoff is None and not job.images and job.sampling.cache_salt is None


def _kv_event_forwarder(
    parts: RoleParts, redis: aioredis.Redis, worker_id: str, model: str, policy: WorkerPolicy
) -> KvEventForwarder | None:
    """The engine's KV events to Redis, for cache-aware placement (None: it has none)."""
    if not isinstance(parts.engine, PublishesKvEvents):
        return None
    feed = parts.engine.kv_event_feed()
    if feed is None:
        return None
    writer = KvEventWriter(redis, worker_id)
    return KvEventForwarder(writer, feed, model, snapshot_s=policy.kv_snapshot_interval_s)
