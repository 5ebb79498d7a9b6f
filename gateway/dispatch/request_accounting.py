"""What a request costs, settled once when it ends: its key's limits and its usage row.

At admission the dispatcher asks for the request's open record (:meth:`opened_by`:
what a live gateway needs to write the usage row should this one die) and notes
its limit charge (:meth:`opened`), whose concurrency lease :meth:`renew_leases`
keeps alive. When the request's handle closes, :meth:`settle` gives back the
unused token reservation and frees the slot, queues the usage row and closes the
open record (shared/queue/open_requests.py), retrying through a short Redis outage. Requests
that end while such a write is in flight are closed together in the next one
(gateway/dispatch/group_commit.py): under load one script call closes many.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dispatch.group_commit import GroupCommit, WriterCancelled
from gateway.dispatch.plan import AnyPlan
from gateway.dispatch.request_tally import prompt_tokens, sequences
from shared.connections.retry import Backoff, retry
from shared.queue import names
from shared.queue.job_queue import OpenedBy
from shared.queue.key_limits import CONCURRENCY_LEASE_S, KeyLimitCounters, LimitCharge
from shared.queue.open_requests import OpenRequest, OpenRequests
from shared.queue.usage import UsageRecord

log = logging.getLogger(__name__)

SETTLE_RETRY_S = 30.0


class RequestAccounting:
    def __init__(
        self,
        redis: aioredis.Redis,
        gateway_id: str,
    ) -> None:
        self.gateway_id = gateway_id
        self._limits = KeyLimitCounters(redis)
        self._open_requests = OpenRequests(redis)
        self._open_charges: dict[str, LimitCharge] = {}
        self._closes = GroupCommit(self._close_many)

    def opened_by(self, plan: AnyPlan) -> OpenedBy:
        record = OpenRequest(
            key_id=plan.key_id,
            model=plan.model,
            prompt_tokens=prompt_tokens(plan),
            n=sequences(plan),
            received_unix=plan.deadline.created_unix,
            reservation=plan.charge.reservation() if plan.charge is not None else None,
        )
        if plan.resume is not None:  # settled from what was sent, whichever gateway is left
            return OpenedBy(names.request_holder(plan.request_id), record)
        return OpenedBy(self.gateway_id, record)

    def opened(self, plan: AnyPlan) -> None:
        """The request was queued: its concurrency slot is renewed until it ends."""
        if plan.charge is not None:
            self._open_charges[plan.request_id] = plan.charge

    async def settle(self, plan: AnyPlan, record: UsageRecord, used_tokens: int) -> None:
        """The request ended: limits settled, usage queued (run it in its own task)."""
        self._open_charges.pop(plan.request_id, None)
        charge = plan.charge
        try:
            if charge is not None:
                await retry(
                    lambda: self._limits.settle(charge, used_tokens),
                    for_s=SETTLE_RETRY_S,
                    backoff=Backoff(first_s=0.1, max_s=1.0),
                    what=f"limits of {plan.request_id}",
                )
            await self._closes.write(record)
        except (RedisError, WriterCancelled) as exc:
            log.error("usage of %s not recorded: %r", plan.request_id, exc)

    async def _close_many(self, records: list[UsageRecord]) -> None:
        await retry(
            lambda: self._open_requests.close_many(self.gateway_id, records),
            for_s=SETTLE_RETRY_S,
            backoff=Backoff(first_s=0.1, max_s=1.0),
            what=f"usage of {len(records)} request(s)",
        )

    async def renew_leases(self, interval_s: float = CONCURRENCY_LEASE_S / 3) -> None:
        """Keep this gateway's open requests in their keys' concurrency sets."""
        while True:
            await asyncio.sleep(interval_s)
            by_key: dict[str, list[str]] = {}
            for request_id, charge in list(self._open_charges.items()):
                by_key.setdefault(charge.key_id, []).append(request_id)
            try:
                for key_id, request_ids in by_key.items():
                    await self._limits.renew(key_id, request_ids, time.time())
            except RedisError as exc:
                log.warning("could not renew concurrency leases: %s", exc)
