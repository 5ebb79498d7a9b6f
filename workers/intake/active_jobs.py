"""The jobs a worker runs right now, one slot each, and whether it still takes more.

:class:`ActiveJobs` is the table every unit of the worker shares: the consumer
adds to it and waits for a free slot, the cancel listener and the janitor stop
jobs in it, the heartbeat reports its size, and on the way out the runtime
hands back what is left. :class:`Lifecycle` says whether the worker still takes
jobs and, once it stopped, why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from workers.journal.run_journal import RunLease
from workers.roles.base import JobRun

log = logging.getLogger(__name__)


class ActiveJobs:
    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._runs: dict[str, tuple[JobRun, asyncio.Task[None]]] = {}
        self._fenced: set[str] = set()
        self._starting: set[str] = set()
        self._slot_freed = asyncio.Event()
        self.orphaned: list[RunLease] = []
        """Leases of jobs whose engine died under them: handed back on the way out."""
        self._in_engine: set[str] = set()
        self._crashed: set[str] | None = None
        """The jobs in the engine when it died (None while it lives)."""
        self.handing_back = False
        """Set while the runtime hands every job back: finished tasks keep their slots."""
        self._first_seq: dict[str, int] = {}
        """Each job's seq when it started here: no event taken since = prompt not done."""
        self.on_change: Callable[[], None] = lambda: None
        """Called when a job starts or ends (the heartbeat reports the load early)."""

    def __len__(self) -> int:
        return len(self._runs)

    def free(self) -> int:
        return self.max_slots - len(self._runs)

    def add(self, run: JobRun, task: asyncio.Task[None]) -> None:
        self._runs[run.lease.job_id] = (run, task)
        self._first_seq[run.lease.job_id] = run.lease.next_seq
        self.on_change()

    def not_started(self) -> int:
        """Jobs read here that have not reached the engine yet."""
        running = {run.lease.delivery.entry_id for run, _ in self._runs.values()}
        leasing = len(self._starting - running)
        return leasing + len(self._runs) - len(self._in_engine & self._runs.keys())

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens of the jobs here that have not sent anything yet, less those the
        gateway found cached here when it placed them (a multi-turn prompt is mostly
        cached: counting all of it made a worker look busier than it was)."""
        return sum(
            run.lease.delivery.job.uncached_tokens
            for job_id, (run, _) in self._runs.items()
            if run.lease.next_seq == self._first_seq.get(job_id)
        )

    def done(self, job_id: str) -> None:
        """The job's task has ended: its slot is free (unless everything is handed back)."""
        self._fenced.discard(job_id)
        self._in_engine.discard(job_id)
        if not self.handing_back:
            self._runs.pop(job_id, None)
            self._first_seq.pop(job_id, None)
            self._slot_freed.set()
            self.on_change()

    def entering_engine(self, job_id: str) -> bool:
        """The job's run is about to reach the engine; False once the engine is dead
        (the job is handed back, uncharged: it never ran on the engine that died)."""
        if self._crashed is not None:
            return False
        self._in_engine.add(job_id)
        return True

    def engine_died(self) -> None:
        """Note which jobs were in the engine: only they are charged a failed delivery."""
        if self._crashed is None:
            self._crashed = set(self._in_engine)

    def charged(self, job_id: str) -> bool:
        """Whether handing ``job_id`` back counts as a failed delivery (its engine died
        while running it)."""
        return self._crashed is not None and job_id in self._crashed

    @contextmanager
    def starting(self, entry_ids: Iterable[str]) -> Iterator[None]:
        """Stream entries on their way from a read (or reclaim) to a running job."""
        entries = set(entry_ids)
        self._starting |= entries
        try:
            yield
        finally:
            self._starting -= entries

    def entries_in_hand(self) -> set[str]:
        """Stream entry ids of every job starting or running here."""
        running = {run.lease.delivery.entry_id for run, _ in self._runs.values()}
        return running | self._starting

    def runs(self) -> list[tuple[JobRun, asyncio.Task[None]]]:
        return list(self._runs.values())

    def leases(self) -> list[RunLease]:
        return [run.lease for run, _ in self._runs.values()]

    def fence(self, job_id: str) -> None:
        """Another run owns ``job_id`` now: stop ours without acking."""
        entry = self._runs.get(job_id)
        if entry is not None:
            self._fenced.add(job_id)
            entry[1].cancel()

    def fenced(self, job_id: str) -> bool:
        return job_id in self._fenced

    def cancel_request(self, request_id: str) -> int:
        """Abort every sequence of ``request_id`` running here; returns how many."""
        cancelled = 0
        for run, task in list(self._runs.values()):
            if run.lease.delivery.job.request_id == request_id:
                task.cancel()
                cancelled += 1
        return cancelled

    def wake(self) -> None:
        """Wake a consumer waiting for a slot (to see a stop)."""
        self._slot_freed.set()

    async def wait_for_slot(self) -> None:
        self._slot_freed.clear()
        await self._slot_freed.wait()


class Lifecycle:
    """Whether the worker still takes jobs, and why it stopped (or paused: an admin's
    drain, undone by resume)."""

    def __init__(self, worker_id: str, jobs: ActiveJobs) -> None:
        self._worker_id = worker_id
        self._jobs = jobs
        self._stopping = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.immediate = False
        """Stop without the grace period: hand every job back at once."""
        self.engine_dead = False
        self.journal_failed = False

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self, *, immediate: bool = False) -> None:
        """Stop taking jobs; in-flight ones get the grace period unless ``immediate``."""
        self.immediate = self.immediate or immediate
        self._stopping.set()
        self._unpaused.set()  # a paused consumer wakes up to see the stop
        self._jobs.wake()

    @property
    def paused(self) -> bool:
        """Drained by an admin: takes no jobs (running ones finish) until resumed."""
        return not self._unpaused.is_set() and not self.stopping

    def pause(self) -> None:
        if not self.stopping:
            self._unpaused.clear()
            self._jobs.wake()

    def resume(self) -> None:
        self._unpaused.set()

    async def wait_unpaused(self) -> None:
        await self._unpaused.wait()

    def engine_died(self) -> None:
        self._jobs.engine_died()
        if not self.engine_dead:
            log.error("engine is dead; handing jobs back and stopping worker %s", self._worker_id)
        self.engine_dead = True
        self.stop(immediate=True)

    def journal_stopped(self, task: asyncio.Task[None]) -> None:
        """Done-callback of the journal's task: a journal that gave up stops the worker."""
        if task.cancelled():
            return
        log.error(
            "the run journal stopped (%s): Redis is unreachable; exiting so other "
            "workers reclaim this worker's jobs",
            task.exception(),
        )
        self.journal_failed = True
        self.stop(immediate=True)

    def busy(self) -> bool:
        """Running jobs or stopping: no time for a canary."""
        return bool(len(self._jobs)) or self.stopping
