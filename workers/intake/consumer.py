"""Steps 1-3 of the worker loop: read jobs, lease them through the intake checks, run them.

1. Read up to ``free slots`` jobs from the role's stream (pull = least-loaded
   balancing across workers); with placement, this worker's own stream first, in the
   same blocking read, and the jobs the steal tickets it holds let it take
   (:mod:`workers.intake.stealing`); the janitor passes in jobs it reclaimed.
2. Lease a whole read in one round trip (:meth:`RunJournal.begin_all`, with
   :meth:`Intake.clients_gone`) and apply the intake checks: drop, fail cleanly,
   or run. A start that Redis fails is tried again at once, with backoff, for as
   long as the worker runs: a delivery must never wait for the stale-entry reclaim.
3. Run the role's :class:`~workers.roles.base.JobRun` per job as a task; the
   engine batches them continuously.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from shared.connections.connect import MAX_BLOCK_MS
from shared.connections.retry import Backoff
from shared.errors import EngineDead, EngineError
from shared.protocol import Job
from shared.queue.job_queue import Delivery, JobQueue, JobStream
from shared.queue.worker_streams import Requeue, WorkerStreams
from workers.intake.active_jobs import ActiveJobs, Lifecycle
from workers.intake.checks import Intake, Verdict
from workers.intake.recent_cancels import RecentCancels
from workers.intake.run_trace import RunEnd, RunTimes, RunTracer
from workers.intake.stealing import Stealer
from workers.journal.run_journal import RunJournal, RunLease
from workers.roles.base import JobRun, NewRun

log = logging.getLogger(__name__)

READ_RETRY_S = 0.5
START_RETRY_FIRST_S = 0.05
START_RETRY_MAX_S = 1.0


@dataclass(frozen=True, slots=True)
class Placed:
    """Reading with placement on: this worker's own streams, and stealing."""

    streams: WorkerStreams
    stealer: Stealer


@dataclass(frozen=True, slots=True)
class JobReader:
    """This worker's reads of its role's job streams (the model's, plus one per LoRA
    adapter loaded here: :meth:`add` / :meth:`remove`; the janitor shares the list)."""

    queue: JobQueue
    streams: list[JobStream]
    """The shared streams of the pools this worker serves."""
    consumer: str
    block_ms: int
    placed: Placed | None = None

    async def prepare(self) -> None:
        for stream in self.streams:
            await self._ensure_groups(stream)

    async def _ensure_groups(self, stream: JobStream) -> None:
        await self.queue.ensure_group(stream.name)
        if self.placed is not None:
            await self.placed.streams.ensure_groups(stream, self.consumer)

    async def read(self, count: int) -> list[Delivery]:
        block_ms = min(self.block_ms, MAX_BLOCK_MS)
        if not self.streams:
            await asyncio.sleep(block_ms / 1000)
            return []
        if self.placed is None:
            return await self.queue.read(
                self.streams, self.consumer, count=count, block_ms=block_ms
            )
        return await self._read_placed(self.placed, count, block_ms)

    async def _read_placed(self, placed: Placed, count: int, block_ms: int) -> list[Delivery]:
        """Own streams first, then the shared ones, and the steal tickets, in one blocking
        read (it blocks no longer than until a held ticket is due); then the steals due."""
        pools = list(self.streams)
        wait_ms = placed.stealer.wait_ms(block_ms)
        try:
            read = await placed.streams.read(
                [pool.own(self.consumer) for pool in pools] + pools,
                pools,
                self.consumer,
                count=count,
                block_ms=wait_ms or None,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # a stream forgotten while this worker looked dead (a stall): make it again
            log.warning("job read found a stream without its group (%s); recreating", exc)
            await self.prepare()
            return []
        await placed.stealer.hold(read.tickets)
        stolen = await placed.stealer.steal_due(count - len(read.deliveries), pools)
        return read.deliveries + stolen

    async def requeue_own(self, mode: Requeue) -> int:
        """Move the unread jobs placed on this worker back to their shared streams."""
        if self.placed is None:
            return 0
        moved = 0
        for pool in list(self.streams):
            moved += max(0, await self.placed.streams.requeue(pool, self.consumer, mode))
        if moved:
            log.info("moved %d unread placed job(s) back to the shared streams", moved)
        return moved

    async def add(self, stream: JobStream) -> None:
        """Read ``stream`` too, from the next read on (its consumer group is created)."""
        await self._ensure_groups(stream)
        if stream not in self.streams:
            self.streams.append(stream)

    async def remove(self, stream: JobStream) -> None:
        if stream in self.streams:
            self.streams.remove(stream)
        if self.placed is not None:
            await self.placed.streams.requeue(stream, self.consumer, Requeue.LEAVE)


class JobConsumer:
    def __init__(
        self,
        *,
        reader: JobReader,
        journal: RunJournal,
        intake: Intake,
        jobs: ActiveJobs,
        lifecycle: Lifecycle,
        new_run: NewRun,
        recent_cancels: RecentCancels,
        on_start: Callable[[Job], None],
        runs_traced: RunTracer | None = None,
    ) -> None:
        self._reader = reader
        self._journal = journal
        self._intake = intake
        self._jobs = jobs
        self._lifecycle = lifecycle
        self._new_run = new_run
        self._recent_cancels = recent_cancels
        self._on_start = on_start
        self._runs_traced = runs_traced
        self._reading = asyncio.Lock()
        """Held from a read until its jobs are started (see :meth:`quiesce`)."""

    async def prepare(self) -> None:
        """Make sure the streams and their consumer group exist."""
        await self._reader.prepare()

    async def run(self) -> None:
        """Read and start jobs until the worker stops."""
        backoff = Backoff(READ_RETRY_S, READ_RETRY_S)
        log.info(
            "worker %s reading %s",
            self._reader.consumer,
            [stream.name for stream in self._reader.streams],
        )
        while not self._lifecycle.stopping:
            if self._lifecycle.paused:
                await self._lifecycle.wait_unpaused()
                continue
            free = self._jobs.free()
            if free <= 0:
                await self._jobs.wait_for_slot()
                continue
            try:
                async with self._reading:
                    deliveries = await self._reader.read(free)
                    await self.start_all(deliveries)
                backoff.reset()
            except RedisError as exc:
                log.warning("job read failed (%s); retrying", exc)
                await backoff.wait()

    async def quiesce(self) -> None:
        """Return once every read begun before this call has had its jobs started: after a
        pause or :meth:`remove_stream`, no job of an earlier read is still on its way."""
        async with self._reading:
            pass

    async def add_stream(self, stream: JobStream) -> None:
        await self._reader.add(stream)

    async def remove_stream(self, stream: JobStream) -> None:
        """Stop reading ``stream``; returns once no job read from it is still starting
        (the jobs placed on this worker in its pool go back to its shared stream)."""
        await self._reader.remove(stream)
        await self.quiesce()

    async def requeue_own(self, mode: Requeue) -> int:
        return await self._reader.requeue_own(mode)

    @property
    def steals(self) -> int:
        placed = self._reader.placed
        return 0 if placed is None else placed.stealer.steals

    @property
    def reads_placed(self) -> bool:
        return self._reader.placed is not None

    async def start_all(self, deliveries: list[Delivery]) -> None:
        """Lease and start every delivery of one read, in one round trip for the batch.

        A delivery must never wait for the stale-entry reclaim: if Redis fails the
        lease, the whole batch is tried again at once (with a short backoff) for as
        long as the worker runs.
        """
        with self._jobs.starting(d.entry_id for d in deliveries):
            await self._start_all(deliveries)

    async def _start_all(self, deliveries: list[Delivery]) -> None:
        backoff = Backoff(START_RETRY_FIRST_S, START_RETRY_MAX_S)
        while deliveries:
            try:
                leases, gone = await asyncio.gather(
                    self._journal.begin_all(deliveries),
                    self._intake.clients_gone([d.job for d in deliveries]),
                )
            except RedisError as exc:
                if self._lifecycle.stopping:
                    log.warning(
                        "could not start %d jobs (%s) while stopping; they go to "
                        "another worker once this one has left",
                        len(deliveries),
                        exc,
                    )
                    return
                delay = backoff.next_delay()
                log.warning(
                    "could not start %d jobs (%s); trying again in %.2fs",
                    len(deliveries),
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            for lease, why_gone in zip(leases, gone, strict=True):
                await self._start(lease, why_gone)
            return

    async def _start(self, lease: RunLease, gone: str | None) -> None:
        run = self._new_run(lease, self._journal)
        decision = await self._intake.decide(lease, gone)
        if decision.verdict is Verdict.DROP:
            log.info("job %s dropped at dequeue: %s", lease.job_id, decision.reason)
            self._journal.finish(lease)
            return
        if decision.verdict is Verdict.FAIL and decision.error is not None:
            log.warning("job %s not run: %s", lease.job_id, decision.reason)
            run.fail(decision.error)
            return
        if lease.attempt:
            log.info(
                "job %s resumes after %d tokens (attempt %d)",
                lease.job_id,
                len(lease.emitted),
                lease.attempt,
            )
        # A cancel published while this job was being leased found nothing to cancel:
        # catch it here, where no await separates the check from the registration.
        if self._recent_cancels.holds(lease.delivery.job.request_id):
            log.info("job %s dropped at dequeue: client disconnected", lease.job_id)
            self._journal.finish(lease)
            return
        self._on_start(lease.delivery.job)
        task = asyncio.create_task(self._run_job(run), name=lease.job_id)
        self._jobs.add(run, task)

    async def _run_job(self, run: JobRun) -> None:
        job_id = run.lease.job_id
        started = time.time()
        end = RunEnd.DONE
        try:
            if not self._jobs.entering_engine(job_id):
                self._jobs.orphaned.append(run.lease)  # handed back on the way out
                end = RunEnd.HANDED_BACK
                return
            await run.run()
        except asyncio.CancelledError:
            end = RunEnd.CANCELLED
            if self._jobs.fenced(job_id):
                end = RunEnd.FENCED
            elif self._jobs.handing_back:
                end = RunEnd.HANDED_BACK
            else:
                self._journal.finish(run.lease)  # the client left: the job is done
        except EngineDead:
            end = RunEnd.ENGINE_DEAD
            self._jobs.orphaned.append(run.lease)
            self._lifecycle.engine_died()
        except Exception:
            end = RunEnd.CRASHED
            log.exception("job %s crashed", job_id)
            run.fail(EngineError("the worker hit an internal error running this request"))
        finally:
            self._jobs.done(job_id)
            if self._runs_traced is not None:
                self._runs_traced.finished(run.lease, RunTimes(started, time.time(), end))
