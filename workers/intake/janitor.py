"""The janitor: what keeps jobs moving when workers and gateways die.

Every ``interval_s``:

1. Renew this worker's claim on each running job, fenced (only while the job is
   still this run's); stop the jobs another run took over.
2. Move the unread jobs placed on workers whose heartbeat expired back to their
   shared streams (at once), and while this worker drains, its own. Reclaim the jobs
   of workers whose heartbeat expired, once idle for ``claim_idle_s`` (on the shared
   streams and on workers' own ones), and start them here; never a live worker's jobs,
   however slow. After a stall (Redis, or this worker) hold off for a heartbeat TTL, so
   that heartbeats that lapsed during it can resume. Safety net: an entry nobody
   renewed for ``STALE_ENTRY_MS`` is restarted, logged as ``SAFETY_NET_LOG``.
3. Restart this worker's own entries that nothing here starts, runs or writes
   (idle for ``LOST_ENTRY_IDLE_MS``, and seen so for ``LOST_CONFIRM_S``): Redis
   lost the write that acked them (a fail-over or a restart drops its last
   acknowledged writes: a prefill's forward, a finish), or a read's reply never
   arrived. Right after Redis trouble that is expected (a warning); with none it
   is a bug (``SAFETY_NET_LOG``).
4. Every ``orphan_check_s``: abort running jobs whose gateway is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from shared.queue import names
from shared.queue.job_queue import Delivery, JobQueue, JobStream
from shared.queue.liveness import GatewayWatch, HeartbeatThread, WorkerRegistry
from shared.queue.worker_streams import Requeue, WorkerStreams
from workers.intake.active_jobs import ActiveJobs, Lifecycle
from workers.journal.run_journal import RunJournal

log = logging.getLogger(__name__)

JANITOR_INTERVAL_S = 0.5
ORPHAN_CHECK_INTERVAL_S = 1.0
STALL_S = 1.0
"""A janitor pass this late means Redis or this worker stalled (see :func:`stall_check`)."""
STALE_ENTRY_MS = 30_000
SAFETY_NET_LOG = "SAFETY NET"
"""Marks the log line of a job served by the stale-entry reclaim (tests fail on it)."""
LOST_ENTRY_IDLE_MS = 2_000
"""An own entry nothing here has touched for this long was lost (renewals: every 0.5 s)."""
LOST_CONFIRM_S = 1.0
"""...once it is still idle and not in hand this much later: a read's reply that was on
its way while this worker (or Redis) stalled has reached the consumer by then."""
TROUBLE_WINDOW_S = 60.0
"""Own entries found lost this soon after Redis trouble are put down to it."""

StallCheck = Callable[[float], bool]
"""Given the time since the previous pass started: did Redis (or this worker) stall?"""


def stall_check(heartbeat: HeartbeatThread | None, ttl_s: float, interval_s: float) -> StallCheck:
    """A heartbeat thread times Redis itself; without one (tests on fakeredis) a late pass
    is the sign."""
    if heartbeat is not None:
        return lambda _: heartbeat.redis_stalled(within_s=ttl_s)
    return lambda since_previous_s: since_previous_s > interval_s + STALL_S


@dataclass(frozen=True, slots=True)
class JanitorTiming:
    interval_s: float
    orphan_check_s: float
    hold_after_stall_s: float
    """The heartbeat TTL: how long lapsed heartbeats need to resume."""


class Reclaimer:
    """Takes over the jobs of workers whose heartbeat expired (never a live worker's)."""

    def __init__(
        self,
        *,
        queue: JobQueue,
        registry: WorkerRegistry,
        streams: Sequence[JobStream],
        worker_id: str,
        claim_idle_s: float,
        start: Callable[[list[Delivery]], Awaitable[None]],
        in_hand: Callable[[], set[str]],
        placed: WorkerStreams | None = None,
    ) -> None:
        self._queue = queue
        self._registry = registry
        self._pools = streams
        self._placed = placed
        self._worker_id = worker_id
        self._claim_idle_s = claim_idle_s
        self._start = start
        self._in_hand = in_hand
        """Entry ids of the jobs this worker starts, runs, or has writes queued for."""
        self._suspects: dict[str, dict[str, float]] = {}
        """Per stream: own entries found idle and not in hand, and since when."""
        self.reclaims = 0
        """Jobs taken over from dead owners (and by the safety net) since start."""
        self._own_pending: dict[JobStream, bool] = {}
        """Per pool: whether this worker's own stream had pending entries at the last
        sweep (checked when unknown): only then is it looked at entry by entry."""

    @property
    def _streams(self) -> list[JobStream]:
        """The shared streams this worker reads (adapters' come and go) and, with
        placement, its own ones that hold pending entries (read here, or stolen)."""
        pools = list(self._pools)
        if self._placed is None:
            return pools
        own = [pool.own(self._worker_id) for pool in pools if self._own_pending.get(pool, True)]
        return pools + own

    async def requeue_dead(self) -> list[JobStream]:
        """Move the unread jobs placed on dead workers back to the shared streams (a
        stream found empty is forgotten); returns the dead workers' streams left, whose
        read jobs are reclaimed as any dead worker's."""
        if self._placed is None:
            return []
        found = []
        for pool in list(self._pools):
            pending, dead = await self._placed.sweep(pool, self._worker_id)
            self._own_pending[pool] = pending > 0
            for worker in sorted(dead):
                moved, kept = await self._placed.requeue_and_look(pool, worker, Requeue.DEAD)
                if moved > 0:
                    log.warning(
                        "moved %d unread job(s) placed on dead worker %s back to %s",
                        moved,
                        worker,
                        pool.name,
                    )
                if moved >= 0 and kept:  # what it had read is pending there
                    found.append(pool.own(worker))
        return found

    async def requeue_own(self) -> None:
        """This worker takes no jobs (it drains or is paused): the jobs placed on it since
        go back to the shared streams."""
        if self._placed is None:
            return
        for pool in list(self._pools):
            moved = await self._placed.requeue(pool, self._worker_id, Requeue.DRAIN)
            if moved:
                log.info("draining: moved %d placed job(s) back to %s", moved, pool.name)

    async def reclaim(self, free_slots: Callable[[], int]) -> None:
        dead_streams = await self.requeue_dead()
        for stream in self._streams + dead_streams:
            free = free_slots()
            if free <= 0:
                return
            try:
                dead = await self._dead_consumers(stream)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue  # a dead worker's stream another janitor has just forgotten
            deliveries = []
            if dead:
                deliveries = await self._queue.reclaim(
                    stream,
                    self._worker_id,
                    min_idle_ms=int(self._claim_idle_s * 1000),
                    count=free,
                    from_consumers=dead,
                )
            if deliveries:
                log.warning(
                    "reclaimed %d jobs of dead workers %s from %s",
                    len(deliveries),
                    sorted(dead),
                    stream.name,
                )
                self.reclaims += len(deliveries)
                await self._start(deliveries)
                continue
            await self._safety_net(stream, free)

    async def restart_lost(self, free_slots: Callable[[], int], *, after_trouble: bool) -> None:
        """Run again the jobs this worker holds in Redis but has no trace of here."""
        for stream in list(self._streams):
            free = free_slots()
            if free <= 0:
                return
            idle = await self._queue.idle_own_entries(
                stream, self._worker_id, min_idle_ms=LOST_ENTRY_IDLE_MS, count=free
            )
            if not idle:  # the usual pass: nothing to compare with what is in hand
                self._suspects.pop(stream.name, None)
                continue
            # Asked after the read: an entry that left our hands since was acked (and
            # deleted) first, so the claim below skips it.
            in_hand = self._in_hand()
            now = time.monotonic()
            earlier = self._suspects.get(stream.name, {})
            suspects = {e: earlier.get(e, now) for e in idle if e not in in_hand}
            lost = [e for e, since in suspects.items() if now - since >= LOST_CONFIRM_S][:free]
            self._suspects[stream.name] = {e: t for e, t in suspects.items() if e not in lost}
            deliveries = await self._queue.claim(
                stream, self._worker_id, min_idle_ms=LOST_ENTRY_IDLE_MS, ids=lost
            )
            if not deliveries:
                continue
            if after_trouble:
                log.warning(
                    "%d jobs on %s are still pending for this worker, which had finished "
                    "or forwarded them: Redis lost their acks in its recent trouble "
                    "(a fail-over or restart); running them again",
                    len(deliveries),
                    stream.name,
                )
            else:
                log.error(
                    "%s: %d jobs on %s are pending for this worker but were never started "
                    "here (a read whose reply was lost, or a bug); starting them",
                    SAFETY_NET_LOG,
                    len(deliveries),
                    stream.name,
                )
            await self._start(deliveries)

    async def _safety_net(self, stream: JobStream, free: int) -> None:
        # An entry nobody has renewed for this long is not being worked on by anyone,
        # live or not (renewals happen every 0.5 s). It must never be what serves a
        # request: when it fires, something upstream lost a job.
        stale = await self._queue.reclaim(
            stream,
            self._worker_id,
            min_idle_ms=STALE_ENTRY_MS,
            count=free,
            include_own=True,
        )
        if stale:
            log.error(
                "%s: %d jobs on %s sat %ds with no live owner working on them "
                "(a bug: a delivery was lost); restarting them",
                SAFETY_NET_LOG,
                len(stale),
                stream.name,
                STALE_ENTRY_MS // 1000,
            )
            self.reclaims += len(stale)
            await self._start(stale)

    async def _dead_consumers(self, stream: JobStream) -> set[str]:
        others = [c for c in await self._queue.consumers(stream) if c != self._worker_id]
        return await self._registry.dead(others)


class Janitor:
    def __init__(
        self,
        *,
        jobs: ActiveJobs,
        lifecycle: Lifecycle,
        journal: RunJournal,
        reclaimer: Reclaimer,
        gateways: GatewayWatch,
        stalled: StallCheck,
        timing: JanitorTiming,
    ) -> None:
        self._jobs = jobs
        self._lifecycle = lifecycle
        self._journal = journal
        self._reclaimer = reclaimer
        self._gateways = gateways
        self._stalled = stalled
        self._timing = timing

    async def run(self) -> None:
        last_orphan_check = 0.0
        previous_start = time.monotonic()
        hold_reclaim_until = 0.0
        trouble_at = -TROUBLE_WINDOW_S
        while True:
            await asyncio.sleep(self._timing.interval_s)
            started = time.monotonic()
            try:
                await self._refresh_ownership()
                # Redis stalled (or, with no heartbeat thread, this process did): every
                # heartbeat may have lapsed meanwhile, the live workers' too. Let them
                # beat again before calling anyone dead.
                if self._stalled(time.monotonic() - previous_start):
                    trouble_at = time.monotonic()
                    hold_reclaim_until = trouble_at + self._timing.hold_after_stall_s
                    log.warning(
                        "Redis or this worker stalled; no reclaim for %.1fs while "
                        "heartbeats resume",
                        self._timing.hold_after_stall_s,
                    )
                taking_jobs = not (self._lifecycle.stopping or self._lifecycle.paused)
                if taking_jobs:
                    recent_trouble = time.monotonic() - trouble_at < TROUBLE_WINDOW_S
                    await self._reclaimer.restart_lost(
                        self._jobs.free, after_trouble=recent_trouble
                    )
                if taking_jobs and time.monotonic() >= hold_reclaim_until:
                    await self._reclaimer.reclaim(self._jobs.free)
                if not taking_jobs:
                    await self._reclaimer.requeue_own()
                if time.monotonic() - last_orphan_check > self._timing.orphan_check_s:
                    last_orphan_check = time.monotonic()
                    await self._drop_orphans()
            except RedisError as exc:
                trouble_at = time.monotonic()
                log.warning("janitor pass failed: %s", exc)
            previous_start = started

    async def _refresh_ownership(self) -> None:
        for job_id in await self._journal.refresh(self._jobs.leases()):
            log.warning("job %s was taken over by another worker; stopping it here", job_id)
            self._jobs.fence(job_id)

    async def _drop_orphans(self) -> None:
        """Abort jobs whose gateway died: nobody will read their tokens."""
        gone = await self._gateways.gone(
            names.gateway_of_reply_stream(run.lease.delivery.job.reply_to)
            for run, _ in self._jobs.runs()
        )
        for run, task in self._jobs.runs():
            gateway = names.gateway_of_reply_stream(run.lease.delivery.job.reply_to)
            if gateway in gone:
                log.warning("aborting job %s: its gateway %s is gone", run.lease.job_id, gateway)
                task.cancel()
