"""The usage rows of requests whose gateway died (see shared/queue/open_requests.py).

Every gateway runs one sweep; every ``interval_s`` it:

1. lists the gateways that queued requests on this Redis (``names.GATEWAY_SET``: one
   read however many keys Redis holds);
2. keeps those whose liveness key has been missing for a whole grace period
   (:class:`~shared.queue.liveness.GatewayWatch`: the same rule workers use before they
   abort a gateway's jobs), never itself;
3. for each of their requests, builds the usage row from what the workers sent and
   closes it: the script queues the row only if the request was still open, so two
   sweeping gateways write it once; a gateway with none left leaves the set;
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

FORGET_GATEWAY = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[1]) end
"""
"""A gone gateway leaves the set once it has no open request left (in one step: a request
it queued meanwhile keeps it listed)."""


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
        self._forget = redis.register_script(FORGET_GATEWAY)
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
        listed = await self._redis.smembers(names.GATEWAY_SET)
        others = [g for g in map(as_text, listed) if g != self._gateway_id]
        written = 0
        for gateway in sorted(await self._watch.gone(others)):
            written += await self._close_all(gateway)
            await self._forget(
                keys=[names.open_requests(gateway), names.GATEWAY_SET], args=[gateway]
            )
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
