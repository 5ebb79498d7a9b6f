"""The usage rows of requests whose gateway died (see shared/queue/open_requests.py).

Every gateway runs one sweep; every ``interval_s`` it:

1. lists the gateways that have open requests (their ``open-requests`` hashes);
2. keeps those whose liveness key has been missing for a whole grace period
   (:class:`~shared.queue.liveness.GatewayWatch`: the same rule workers use before they
   abort a gateway's jobs), never itself;
3. for each of their requests, builds the usage row from what the workers sent and
   closes it: the script queues the row only if the request was still open, so two
   sweeping gateways write it once;
4. the sweep that closed it settles the key's limit reservation with what was used,
   as the dead gateway would have (unused tokens back, the concurrency slot freed).
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.connections.connect import as_text
from shared.errors import ProtocolError
from shared.queue import names
from shared.queue.key_limits import KeyLimitCounters
from shared.queue.liveness import GatewayWatch
from shared.queue.open_requests import OpenRequests, decode_open, orphan_record

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 5.0


class OrphanUsageSweep:
    def __init__(
        self,
        redis: aioredis.Redis,
        gateway_id: str,
        watch: GatewayWatch,
        interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:
        self._redis = redis
        self._gateway_id = gateway_id
        self._watch = watch
        self._interval_s = interval_s
        self._open = OpenRequests(redis)
        self._limits = KeyLimitCounters(redis)
        self.rows_written = 0

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except RedisError as exc:
                log.warning("orphan usage sweep failed (retrying): %s", exc)
            await asyncio.sleep(self._interval_s)

    async def sweep(self) -> int:
        """One pass; returns the usage rows it queued."""
        others = [
            gateway
            async for key in self._redis.scan_iter(names.OPEN_REQUESTS_PATTERN, 100)
            if (gateway := names.gateway_of_open_requests(as_text(key))) != self._gateway_id
        ]
        written = 0
        for gateway in sorted(await self._watch.gone(others)):
            written += await self._close_all(gateway)
        self.rows_written += written
        return written

    async def _close_all(self, gateway: str) -> int:
        written = 0
        for request_id, value in (await self._open.opened(gateway)).items():
            try:
                opened = decode_open(value)
            except ProtocolError as exc:
                log.error(
                    "open request %s of gateway %s is unreadable: %s", request_id, gateway, exc
                )
                await self._redis.hdel(names.open_requests(gateway), request_id)
                continue
            record = orphan_record(request_id, opened, await self._open.sent(request_id))
            if await self._open.close_orphan(gateway, record):
                written += 1
                if opened.reservation is not None:
                    used = record.prompt_tokens + record.completion_tokens
                    await self._limits.settle_reserved(opened.reservation, request_id, used)
                log.warning(
                    "usage of %s written for its dead gateway %s from what workers sent: "
                    "%d completion tokens (%s)",
                    request_id,
                    gateway,
                    record.completion_tokens,
                    record.status,
                )
        return written
