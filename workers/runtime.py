"""The worker loop: consume -> run -> journal -> ack.

1. Read up to ``free slots`` jobs from the role's streams (pull = least-loaded
   balancing across workers); the janitor adds jobs reclaimed from dead workers.
2. Lease each job in the run journal and apply the intake checks
   (:mod:`workers.intake`): drop, fail cleanly, or run.
3. Run a :class:`SequenceRun` per job; the engine batches them continuously.
4. On SIGTERM: stop reading, leave the registry, let jobs finish within the
   grace period, then hand what is left back to the queue (it migrates).
   On a dead engine: hand everything back at once and exit non-zero.

Beside the loop: heartbeat, control listener (client cancels), engine monitor,
janitor (fenced ownership refresh, reclaim, orphan check) and idle canary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.errors import EngineDead, EngineError
from shared.job_queue import Delivery, JobQueue
from shared.protocol import CancelCommand, ProtocolError, decode_bytes
from shared.redis_conn import MAX_BLOCK_MS, as_text, db_of
from shared.registry import WorkerRegistration, WorkerRegistry
from shared.tasks import cancel_and_wait
from workers.canary import Canary
from workers.embed import EmbedRun
from workers.encode import EncodeRun
from workers.engines.base import Engine
from workers.engines.vision_engine import VisionEngine
from workers.gateway_watch import GatewayWatch
from workers.heartbeat import HeartbeatThread
from workers.intake import IntakePolicy, Verdict, clients_gone, decide
from workers.journal import RunJournal, RunLease
from workers.prefill import PrefillRun
from workers.prompt_images import PromptImageLoader
from workers.recent_cancels import RecentCancels
from workers.sequence import SequenceRun

JobRun = SequenceRun | PrefillRun | EmbedRun | EncodeRun

log = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 2.0
JANITOR_INTERVAL_S = 0.5
ORPHAN_CHECK_INTERVAL_S = 1.0
STALL_S = 1.0
"""A janitor pass this late means Redis or this worker stalled (see ``_janitor``)."""
STALE_ENTRY_MS = 30_000
START_RETRY_FIRST_S = 0.05
START_RETRY_MAX_S = 1.0
SAFETY_NET_LOG = "SAFETY NET"
"""Marks the log line of a job served by the stale-entry reclaim (tests fail on it)."""


@dataclass(frozen=True, slots=True)
class WorkerPolicy:
    max_slots: int = 64
    heartbeat_ttl_s: float = 6.0
    claim_idle_ms: int = 2000
    shutdown_grace_s: float = 30.0
    max_deliveries: int = 3
    migration_limit: int = 3
    canary_idle_s: float = 10.0
    read_block_ms: int = 1000
    gateway_grace_s: float = 10.0
    heartbeat_redis_url: str | None = None
    """Set: beat from a thread with its own connection to this Redis (see heartbeat.py)."""


class WorkerRuntime:
    def __init__(
        self,
        *,
        worker_id: str,
        role: str,
        streams: Sequence[str],
        engine: Engine,
        redis: aioredis.Redis,
        policy: WorkerPolicy,
        images: PromptImageLoader | None = None,
    ) -> None:
        self.worker_id = worker_id
        self._images = images
        self._role = role
        self._streams = list(streams)
        self._engine = engine
        self._redis = redis
        self._policy = policy
        self._intake = IntakePolicy(policy.max_deliveries, policy.migration_limit)
        self._queue = JobQueue(redis)
        self._journal = RunJournal(redis, consumer=worker_id, on_fenced=self._fence)
        self._registry = WorkerRegistry(redis, ttl_s=policy.heartbeat_ttl_s)
        self._heartbeat_thread = None if policy.heartbeat_redis_url is None else HeartbeatThread(
            policy.heartbeat_redis_url,
            keys.worker_heartbeat(worker_id),
            policy.heartbeat_ttl_s,
            lambda: self._registry.encode(self._registration()),
        )
        self._canary = Canary(
            engine,
            idle_s=policy.canary_idle_s,
            embeds=role == "embed",
            probe=engine.encoding.probe if isinstance(engine, VisionEngine) else None,
        )
        self._gateways = GatewayWatch(redis, grace_s=policy.gateway_grace_s)
        self._active: dict[str, tuple[JobRun, asyncio.Task[None]]] = {}
        self._orphaned: list[RunLease] = []
        self._fenced: set[str] = set()
        self._recent_cancels = RecentCancels()
        self._handing_back = False
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._immediate = False
        self.engine_dead = False
        self.journal_failed = False

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        for stream in self._streams:
            await self._queue.ensure_group(stream)
        journal = asyncio.create_task(self._journal.run(), name="journal")
        journal.add_done_callback(self._journal_stopped)
        helpers = [
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._listen_for_cancels(), name="control"),
            asyncio.create_task(self._monitor_engine(), name="engine-monitor"),
            asyncio.create_task(self._janitor(), name="janitor"),
            asyncio.create_task(self._canary.run(self._busy), name="canary"),
        ]
        log.info("worker %s (%s) reading %s", self.worker_id, self._role, self._streams)
        try:
            await self._consume()
        finally:
            # Keep beating (as draining) until every job is finished or handed back:
            # a worker that left the registry first would have its jobs reclaimed while
            # it hands them back, and the job would end up queued twice.
            await self._finish_or_hand_back()
            await cancel_and_wait(helpers)
            await self._leave_registry()
            with contextlib.suppress(RedisError):
                await self._journal.flush()
            await cancel_and_wait([journal])

    def _journal_stopped(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        log.error("the run journal stopped (%s): Redis is unreachable; exiting so other "
                  "workers reclaim this worker's jobs", task.exception())
        self.journal_failed = True
        self.stop(immediate=True)

    def stop(self, *, immediate: bool = False) -> None:
        """Stop taking jobs; in-flight ones get the grace period unless ``immediate``."""
        self._immediate = self._immediate or immediate
        self._stopping.set()
        self._slot_freed.set()

    def active_jobs(self) -> int:
        return len(self._active)

    def _busy(self) -> bool:
        return bool(self._active) or self._stopping.is_set()

    async def _leave_registry(self) -> None:
        with contextlib.suppress(RedisError):
            await self._registry.remove(self.worker_id)

    async def _finish_or_hand_back(self) -> None:
        tasks = [task for _, task in self._active.values()]
        grace = 0.0 if self._immediate else self._policy.shutdown_grace_s
        if tasks and grace > 0:
            log.info("draining: %d jobs get up to %.0fs to finish", len(tasks), grace)
            await asyncio.wait(tasks, timeout=grace)
        leases = [run.lease for run, _ in self._active.values()] + self._orphaned
        if not leases:
            return
        self._handing_back = True
        for _, task in list(self._active.values()):
            task.cancel()
        await asyncio.gather(*(task for _, task in self._active.values()), return_exceptions=True)
        with contextlib.suppress(RedisError):
            await self._journal.flush()
            failed = self.engine_dead or self.journal_failed
            # All at once: a dying worker's loop may be slow, and the jobs' next worker
            # should get them in one read, not one by one.
            handed = await asyncio.gather(
                *(self._journal.hand_back(lease, failed=failed) for lease in leases)
            )
            log.info("handed %d unfinished jobs back to the queue", sum(handed))

    # ---------------------------------------------------------------- consuming

    async def _consume(self) -> None:
        while not self._stopping.is_set():
            free = self._free_slots()
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                deliveries = await self._queue.read(
                    self._streams,
                    self.worker_id,
                    count=free,
                    block_ms=min(self._policy.read_block_ms, MAX_BLOCK_MS),
                )
                await self._start_all(deliveries)
            except RedisError as exc:
                log.warning("job read failed (%s); retrying", exc)
                await asyncio.sleep(0.5)

    def _free_slots(self) -> int:
        return self._policy.max_slots - len(self._active)

    async def _start_all(self, deliveries: list[Delivery]) -> None:
        """Lease and start every delivery of one read, in one round trip for the batch.

        A delivery must never wait for the stale-entry reclaim: if Redis fails the
        lease, the whole batch is tried again at once (with a short backoff) for as
        long as the worker runs.
        """
        delay = START_RETRY_FIRST_S
        while deliveries:
            try:
                leases, gone = await asyncio.gather(
                    self._journal.begin_all(deliveries),
                    clients_gone(self._redis, [d.job for d in deliveries], self._gateways),
                )
            except RedisError as exc:
                if self._stopping.is_set():
                    log.warning("could not start %d jobs (%s) while stopping; they go to "
                                "another worker once this one has left", len(deliveries), exc)
                    return
                log.warning("could not start %d jobs (%s); trying again in %.2fs",
                            len(deliveries), exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, START_RETRY_MAX_S)
                continue
            for lease, why_gone in zip(leases, gone, strict=True):
                await self._start(lease, why_gone)
            return

    async def _start(self, lease: RunLease, gone: str | None) -> None:
        run = self._new_run(lease)
        decision = await decide(self._redis, lease, self._intake, gone)
        if decision.verdict is Verdict.DROP:
            log.info("job %s dropped at dequeue: %s", lease.job_id, decision.reason)
            self._journal.finish(lease)
            return
        if decision.verdict is Verdict.FAIL and decision.error is not None:
            log.warning("job %s not run: %s", lease.job_id, decision.reason)
            run.fail(decision.error)
            return
        if lease.attempt:
            log.info("job %s resumes after %d tokens (attempt %d)", lease.job_id,
                     len(lease.emitted), lease.attempt)
        # A cancel published while this job was being leased found nothing to cancel:
        # catch it here, where no await separates the check from the registration.
        if self._recent_cancels.holds(lease.delivery.job.request_id):
            log.info("job %s dropped at dequeue: client disconnected", lease.job_id)
            self._journal.finish(lease)
            return
        self._canary.note_activity()
        task = asyncio.create_task(self._run_sequence(run), name=lease.job_id)
        self._active[lease.job_id] = (run, task)

    def _new_run(self, lease: RunLease) -> JobRun:
        if isinstance(self._engine, VisionEngine):
            return EncodeRun(lease, self._engine.encoding, self._journal)
        if self._role == "prefill":
            return PrefillRun(lease, self._engine, self._journal, self._images)
        if self._role == "embed":
            return EmbedRun(lease, self._engine, self._journal)
        return SequenceRun(lease, self._engine, self._journal, self._images)

    async def _run_sequence(self, run: JobRun) -> None:
        job_id = run.lease.job_id
        try:
            await run.run()
        except asyncio.CancelledError:
            if job_id not in self._fenced and not self._handing_back:
                self._journal.finish(run.lease)  # the client left: the job is done
        except EngineDead:
            self._orphaned.append(run.lease)
            self._engine_died()
        except Exception:
            log.exception("job %s crashed", job_id)
            run.fail(EngineError("the worker hit an internal error running this request"))
        finally:
            self._fenced.discard(job_id)
            if not self._handing_back:
                self._active.pop(job_id, None)
                self._slot_freed.set()

    def _engine_died(self) -> None:
        if not self.engine_dead:
            log.error("engine is dead; handing jobs back and stopping worker %s", self.worker_id)
        self.engine_dead = True
        self.stop(immediate=True)

    # ------------------------------------------------------------------ control

    def cancel_request(self, request_id: str) -> int:
        """Abort every sequence of ``request_id`` running here; returns how many."""
        cancelled = 0
        for run, task in list(self._active.values()):
            if run.job.request_id == request_id:
                task.cancel()
                cancelled += 1
        return cancelled

    def _fence(self, job_id: str) -> None:
        """Another run owns ``job_id`` now: stop ours without acking."""
        entry = self._active.get(job_id)
        if entry is not None:
            self._fenced.add(job_id)
            entry[1].cancel()

    async def _listen_for_cancels(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(keys.control_channel(db_of(self._redis)))
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._on_control(message["data"])
            except RedisError as exc:
                log.warning("control channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _on_control(self, data: bytes) -> None:
        try:
            command = decode_bytes(data)
        except ProtocolError as exc:
            log.error("bad control message: %s", exc)
            return
        if not isinstance(command, CancelCommand):
            return
        self._recent_cancels.add(command.request_id)
        if self.cancel_request(command.request_id):
            log.info("cancelled %s: client disconnected", command.request_id)

    # ------------------------------------------------------------------ janitor

    async def _janitor(self) -> None:
        last_orphan_check = 0.0
        previous_start = time.monotonic()
        hold_reclaim_until = 0.0
        while True:
            await asyncio.sleep(JANITOR_INTERVAL_S)
            started = time.monotonic()
            try:
                await self._refresh_ownership()
                # Redis stalled (or, with no heartbeat thread, this process did): every
                # heartbeat may have lapsed meanwhile, the live workers' too. Let them
                # beat again before calling anyone dead.
                if self._stalled(time.monotonic() - previous_start):
                    hold_reclaim_until = time.monotonic() + self._policy.heartbeat_ttl_s
                    log.warning("Redis or this worker stalled; no reclaim for %.1fs while "
                                "heartbeats resume", self._policy.heartbeat_ttl_s)
                if not self._stopping.is_set() and time.monotonic() >= hold_reclaim_until:
                    await self._reclaim()
                if time.monotonic() - last_orphan_check > ORPHAN_CHECK_INTERVAL_S:
                    last_orphan_check = time.monotonic()
                    await self._drop_orphans()
            except RedisError as exc:
                log.warning("janitor pass failed: %s", exc)
            previous_start = started

    def _stalled(self, since_previous_pass_s: float) -> bool:
        if self._heartbeat_thread is not None:  # its beats time Redis itself
            return self._heartbeat_thread.redis_stalled(within_s=self._policy.heartbeat_ttl_s)
        return since_previous_pass_s > JANITOR_INTERVAL_S + STALL_S

    async def _refresh_ownership(self) -> None:
        leases = [run.lease for run, _ in self._active.values()]
        for job_id in await self._journal.refresh(leases):
            log.warning("job %s was taken over by another worker; stopping it here", job_id)
            self._fence(job_id)

    async def _reclaim(self) -> None:
        """Take over jobs of workers whose heartbeat expired (never a live worker's)."""
        for stream in self._streams:
            free = self._free_slots()
            if free <= 0:
                return
            dead = await self._dead_consumers(stream)
            deliveries = []
            if dead:
                deliveries = await self._queue.reclaim(
                    stream, self.worker_id, min_idle_ms=self._policy.claim_idle_ms,
                    count=free, from_consumers=dead,
                )
            if deliveries:
                log.warning("reclaimed %d jobs of dead workers %s from %s",
                            len(deliveries), sorted(dead), stream)
                await self._start_all(deliveries)
                continue
            # Safety net: an entry nobody has renewed for this long is not being worked
            # on by anyone, live or not (renewals happen every 0.5 s). It must never be
            # what serves a request: when it fires, something upstream lost a job.
            stale = await self._queue.reclaim(
                stream, self.worker_id, min_idle_ms=STALE_ENTRY_MS, count=free,
                include_own=True,
            )
            if stale:
                log.error("%s: %d jobs on %s sat %ds with no live owner working on them "
                          "(a bug: a delivery was lost); restarting them", SAFETY_NET_LOG,
                          len(stale), stream, STALE_ENTRY_MS // 1000)
                await self._start_all(stale)

    async def _dead_consumers(self, stream: str) -> set[str]:
        summary: Any = await self._redis.xpending(stream, keys.JOB_GROUP)
        names = [as_text(c["name"]) for c in summary.get("consumers") or []]
        others = [name for name in names if name != self.worker_id]
        if not others:
            return set()
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in others:
                pipe.exists(keys.worker_heartbeat(name))
            alive = await pipe.execute()
        return {name for name, live in zip(others, alive, strict=True) if not live}

    async def _drop_orphans(self) -> None:
        """Abort jobs whose gateway died: nobody will read their tokens."""
        gone = await self._gateways.gone(
            keys.gateway_of_reply_stream(run.job.reply_to) for run, _ in self._active.values()
        )
        for run, task in list(self._active.values()):
            gateway = keys.gateway_of_reply_stream(run.job.reply_to)
            if gateway in gone:
                log.warning("aborting job %s: its gateway %s is gone", run.lease.job_id, gateway)
                task.cancel()

    # ------------------------------------------------------------------- health

    def _registration(self) -> WorkerRegistration:
        return WorkerRegistration(
            worker_id=self.worker_id,
            role=self._role,
            model=self._engine.info.model,
            max_model_len=self._engine.info.max_model_len,
            active=len(self._active),
            engine_running=self._engine.running(),
            slots=self._policy.max_slots,
            draining=self._stopping.is_set(),
            ready=self._canary.healthy,
            can_decode_alone=self._engine.info.can_decode_alone,
            prompt_tokens_computed=self._engine.prompt_stats.computed,
            prompt_tokens_transferred=self._engine.prompt_stats.transferred,
            kv_transfers=self._engine.prompt_stats.kv_transfers,
            kv_transfer_s=round(self._engine.prompt_stats.kv_transfer_s, 6),
            embedding_cache=self._embedding_cache_stats(),
        )

    async def _heartbeat(self) -> None:
        if self._heartbeat_thread is not None:
            await self._heartbeat_thread.run()
            return
        while True:  # from the event loop (tests on fake Redis)
            try:
                await self._registry.beat(self._registration())
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self._registry.ttl_s / 4)

    def _embedding_cache_stats(self) -> dict[str, int] | None:
        if not isinstance(self._engine, VisionEngine):
            return None
        return dataclasses.asdict(self._engine.encoding.cache.stats)

    async def _monitor_engine(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
            try:
                await self._engine.check_health()
            except EngineDead:
                self._engine_died()
                return
