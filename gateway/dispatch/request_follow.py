"""A reader of a resumable request's events: a :class:`RequestHandle` fed from its log.

:func:`follow` returns a handle whose events come from the request's own reply stream
(:class:`~gateway.dispatch.request_log.RequestLog`) instead of this gateway's, while a
task keeps the request's lease alive. Closing the handle stops both and never cancels
the request: an unfinished one runs on until its lease lapses (nobody resumed it within
the grace period: the workers abort it) or its deadline. A finished one's lease is
released, so its usage is settled at once from what the workers sent
(gateway/control/orphan_usage.py), and its log is kept only ``keep_s`` more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dispatch.plan import Deadline, Resume
from gateway.dispatch.reply_inbox import ReplyInbox
from gateway.dispatch.reply_router import StreamInterrupted
from gateway.dispatch.request_handle import RequestHandle
from gateway.dispatch.request_log import RequestLog
from shared.errors import BackendUnavailable
from shared.queue.liveness import hold_request, release_request
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class LeaseLost(BackendUnavailable):
    """Another gateway holds the request now (it took it over): stop reading here."""


QUEUE_SIZE = 4096
"""Events read ahead of the handle's owner (the reader waits when it is full)."""

Spawn = Callable[[Coroutine[Any, Any, None]], None]


def follow(
    redis: aioredis.Redis,
    request_id: str,
    sequences: int,
    deadline: Deadline,
    resume: Resume,
    spawn: Spawn,
    *,
    after: str = "0-0",
) -> RequestHandle:
    """The handle of ``request_id``'s events after log entry ``after``; ``spawn`` runs
    the work left when it closes (it must outlive a cancelled caller)."""
    queue: ReplyInbox[Any] = ReplyInbox(QUEUE_SIZE)
    request_log = RequestLog(redis, request_id)
    reader = asyncio.get_running_loop().create_task(
        _read(redis, request_log, queue, resume, after), name=f"follow-{request_id}"
    )

    def closed(unfinished: bool) -> None:
        reader.cancel()
        if not unfinished:
            spawn(_ended(redis, request_log, resume))

    return RequestHandle(request_id, sequences, queue, deadline, on_close=closed)


async def _read(
    redis: aioredis.Redis,
    request_log: RequestLog,
    queue: ReplyInbox[Any],
    resume: Resume,
    after: str,
) -> None:
    lease = asyncio.create_task(_keep_lease(redis, request_log.request_id, resume))
    try:
        async for events in request_log.follow(after):
            if lease.done():
                reason = _lease_lost(lease)
                queue.put_nowait(StreamInterrupted(reason, LeaseLost(reason)))
                return
            for event in events:
                await queue.put(event)
    finally:
        await cancel_and_wait([lease])


def _lease_lost(lease: asyncio.Task[None]) -> str:
    if not lease.cancelled() and lease.exception() is not None:
        return f"the request's lease could not be kept: {lease.exception()}"
    return "another gateway serves this request now"


async def _keep_lease(redis: aioredis.Redis, request_id: str, resume: Resume) -> None:
    """Renew the lease every third of its TTL; return when another holder has it."""
    while True:
        try:
            if not await hold_request(redis, request_id, resume.holder, resume.lease_s):
                log.warning("%s is held by another gateway now; stopping here", request_id)
                return
        except RedisError as exc:
            log.warning("could not renew the lease of %s: %s", request_id, exc)
        await asyncio.sleep(min(1.0, resume.lease_s / 3))


async def _ended(redis: aioredis.Redis, request_log: RequestLog, resume: Resume) -> None:
    try:
        await release_request(redis, request_log.request_id)
        await request_log.keep_for(resume.keep_s)
    except RedisError as exc:
        log.warning("could not release %s (its TTLs will): %s", request_log.request_id, exc)
