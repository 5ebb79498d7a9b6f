"""The worker loop: consume -> run -> journal -> ack, and the way out.

0. Before the first read: load every registered LoRA adapter (:mod:`workers.commands.lora_sync`;
   the worker reports ready only then).
1. Read up to ``free slots`` jobs from the role's stream (and those of the adapters
   loaded here); the janitor adds jobs reclaimed from dead workers
   (:mod:`workers.intake.consumer`, :mod:`workers.intake.janitor`).
2. Lease each read in one round trip and apply the intake checks
   (:mod:`workers.intake.checks`): drop, fail cleanly, or run.
3. Run the role's job run per job (:mod:`workers.roles`); the engine batches them
   continuously; the run journal (:mod:`workers.journal.run_journal`) writes each engine step.
4. On SIGTERM: stop reading, keep beating as draining, let jobs finish within the
   grace period, hand what is left back to the queue (it migrates), then leave the
   registry. On a dead engine or a journal that gave up: hand back at once, exit 1.

Beside the loop run the helpers :func:`workers.assembly.build_worker` wires in:
heartbeat and engine monitor (:mod:`workers.health.status`), the command listener
(:mod:`workers.commands.listener`: cancels, and admin commands for :mod:`workers.commands.admin`),
the adapter reconciler, the janitor and the idle canary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from redis.exceptions import RedisError

from shared.queue.liveness import WorkerRegistry
from shared.queue.worker_streams import Requeue
from shared.tasks import cancel_and_wait
from workers.intake.active_jobs import ActiveJobs, Lifecycle
from workers.intake.consumer import JobConsumer
from workers.intake.janitor import SAFETY_NET_LOG
from workers.journal.run_journal import RunJournal, RunLease

__all__ = ["SAFETY_NET_LOG", "WorkerRuntime"]

log = logging.getLogger(__name__)

Helper = Callable[[], Coroutine[Any, Any, None]]


class WorkerRuntime:
    """The coordinator: starts the helpers, runs the consumer, and hands back on the way out."""

    def __init__(
        self,
        *,
        worker_id: str,
        consumer: JobConsumer,
        journal: RunJournal,
        jobs: ActiveJobs,
        lifecycle: Lifecycle,
        registry: WorkerRegistry,
        helpers: Mapping[str, Helper],
        shutdown_grace_s: float,
        startup: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self._consumer = consumer
        self._journal = journal
        self._jobs = jobs
        self._lifecycle = lifecycle
        self._registry = registry
        self._helpers = helpers
        self._shutdown_grace_s = shutdown_grace_s
        self._startup = startup
        """Runs after the helpers start and before the first read (adapters load)."""

    @property
    def engine_dead(self) -> bool:
        return self._lifecycle.engine_dead

    @property
    def journal_failed(self) -> bool:
        return self._lifecycle.journal_failed

    async def run(self) -> None:
        await self._consumer.prepare()
        journal = asyncio.create_task(self._journal.run(), name="journal")
        journal.add_done_callback(self._lifecycle.journal_stopped)
        helpers = [asyncio.create_task(run(), name=name) for name, run in self._helpers.items()]
        try:
            if self._startup is not None:
                await self._startup()
            await self._consumer.run()
        finally:
            # The jobs placed on this worker and not read yet go to the shared streams
            # at once: other workers start them while this one drains.
            await self._requeue_own(Requeue.DRAIN)
            # Keep beating (as draining) until every job is finished or handed back:
            # a worker that left the registry first would have its jobs reclaimed while
            # it hands them back, and the job would end up queued twice.
            await self._finish_or_hand_back()
            await cancel_and_wait(helpers)
            with contextlib.suppress(RedisError):
                await self._registry.remove(self.worker_id)
            # Nothing is placed here once the liveness key is gone: this moves the last.
            await self._requeue_own(Requeue.LEAVE)
            with contextlib.suppress(RedisError):
                await self._journal.flush()
            await cancel_and_wait([journal])

    async def _requeue_own(self, mode: Requeue) -> None:
        try:
            await self._consumer.requeue_own(mode)
        except RedisError as exc:  # the janitors of the pool move them once it is gone
            log.warning("could not move this worker's placed jobs back: %s", exc)

    def stop(self, *, immediate: bool = False) -> None:
        """Stop taking jobs; in-flight ones get the grace period unless ``immediate``."""
        self._lifecycle.stop(immediate=immediate)

    def active_jobs(self) -> int:
        return len(self._jobs)

    def cancel_request(self, request_id: str) -> int:
        """Abort every sequence of ``request_id`` running here; returns how many."""
        return self._jobs.cancel_request(request_id)

    async def _finish_or_hand_back(self) -> None:
        tasks = [task for _, task in self._jobs.runs()]
        grace = 0.0 if self._lifecycle.immediate else self._shutdown_grace_s
        if tasks and grace > 0:
            log.info("draining: %d jobs get up to %.0fs to finish", len(tasks), grace)
            await asyncio.wait(tasks, timeout=grace)
        leases = self._jobs.leases() + self._jobs.orphaned
        if not leases:
            return
        self._jobs.handing_back = True
        for _, task in self._jobs.runs():
            task.cancel()
        await asyncio.gather(*(task for _, task in self._jobs.runs()), return_exceptions=True)
        with contextlib.suppress(RedisError):
            await self._journal.flush()

            # A dead engine charges a failed delivery only to the jobs it was running
            # (a job that kills every engine is dead-lettered, not its neighbours).
            def failed(lease: RunLease) -> bool:
                return self._lifecycle.journal_failed or self._jobs.charged(lease.job_id)

            # All at once: a dying worker's loop may be slow, and the jobs' next worker
            # should get them in one read, not one by one.
            handed = await asyncio.gather(
                *(self._journal.hand_back(lease, failed=failed(lease)) for lease in leases)
            )
            log.info("handed %d unfinished jobs back to the queue", sum(handed))
