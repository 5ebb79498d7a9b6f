"""Stealing with delay scheduling: the tickets this worker holds, and when it steals.

A placed job waits on its worker's own stream; the steal ticket admission wrote for it
reaches one worker of the pool with free slots (shared/queue/worker_streams.py). That
worker holds the ticket until the job is ``steal_ms`` old, keeps reading meanwhile (its
read blocks no longer than until the ticket is due), and then takes what the victim has
still not read. Tickets about this worker's own stream are retired at once: its jobs are
read here anyway. A worker with no free slot when a ticket falls due keeps it until one
frees (it is the one that would run the job).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from shared.queue.job_queue import Delivery, JobStream
from shared.queue.worker_streams import Ticket, WorkerStreams

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Stealer:
    def __init__(
        self,
        streams: WorkerStreams,
        thief: str,
        *,
        steal_ms: int,
        clock: Clock = time.monotonic,
    ) -> None:
        self._streams = streams
        self._thief = thief
        self.steal_ms = steal_ms
        self._clock = clock
        self._held: dict[tuple[JobStream, str], tuple[float, list[Ticket]]] = {}
        """(pool, victim) -> when its tickets fall due (monotonic s), the tickets."""
        self.steals = 0
        """Jobs taken from other workers' streams since the worker started."""

    async def hold(self, tickets: list[Ticket]) -> None:
        """Keep the tickets about other workers until due; retire those about this one."""
        own: dict[JobStream, list[str]] = {}
        now_s, wall_ms = self._clock(), time.time() * 1000
        for ticket in tickets:
            if ticket.victim == self._thief or not ticket.victim:
                own.setdefault(ticket.pool, []).append(ticket.entry_id)
                continue
            # Redis's clock placed it; a skewed local clock only moves the wake-up (the
            # steal script checks the age on Redis's clock and says how long to wait)
            left_ms = min(max(ticket.at_ms + self.steal_ms - wall_ms, 0.0), self.steal_ms)
            due, held = self._held.get((ticket.pool, ticket.victim), (now_s, []))
            self._held[(ticket.pool, ticket.victim)] = (
                max(due, now_s + left_ms / 1000),
                [*held, ticket],
            )
        for pool, entry_ids in own.items():
            await self._streams.retire(pool, entry_ids)

    def wait_ms(self, block_ms: int) -> int:
        """How long the next read may block: ``block_ms``, or less when a ticket is due
        sooner (0: one is due now)."""
        if not self._held:
            return block_ms
        due = min(due for due, _ in self._held.values())
        return max(0, min(block_ms, int((due - self._clock()) * 1000 + 0.999)))

    async def steal_due(self, free: int, pools: Sequence[JobStream]) -> list[Delivery]:
        """Take up to ``free`` jobs that the workers of the tickets now due left unread
        (in ``pools``, those this worker still serves: the others' tickets are retired)."""
        stolen: list[Delivery] = []
        now_s = self._clock()
        for key, (due, tickets) in sorted(self._held.items(), key=lambda kv: kv[1][0]):
            pool, victim = key
            if pool not in pools:
                del self._held[key]
                await self._streams.retire(pool, [t.entry_id for t in tickets])
                continue
            if due > now_s or free - len(stolen) <= 0:
                continue
            wait_ms, got = await self._streams.steal(
                pool,
                victim,
                self._thief,
                count=free - len(stolen),
                age_ms=self.steal_ms,
                tickets=tickets,
            )
            if wait_ms > 0:
                self._held[key] = (now_s + wait_ms / 1000, tickets)
                continue
            del self._held[key]
            if got:
                log.info("stole %d job(s) placed on %s (%s)", len(got), victim, pool.name)
                stolen += got
        self.steals += len(stolen)
        return stolen
