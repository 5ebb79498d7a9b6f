"""Requests whose admission Redis lost, queued again when the gateway reconnects.

A fail-over to a replica that lagged, or a restart from an AOF that had not synced,
can drop writes Redis had acknowledged. The admission script (shared/queue/job_queue.py)
wrote a request's jobs, its admitted marker and its entry in this gateway's
open-requests hash together, and Redis keeps a prefix of its history (a script whole
or not at all): an open entry that is gone means nothing of the request is left, so
queueing the same jobs again cannot run it twice. The reply router calls
:meth:`LostAdmissions.requeue_lost` on its first read after an outage (one ``HMGET``).

A request whose first events had already reached the gateway (read from the old
master before it died) is not run again: a second run could sample other tokens
after the ones its client has; it ends with a 503.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dispatch.plan import AnyPlan
from gateway.dispatch.reply_router import ReplyRouter
from gateway.dispatch.request_handle import RequestHandle
from shared.protocol import Job
from shared.queue import names
from shared.queue.job_queue import Admission, AdmissionResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A queued request, with what queued it."""

    stream: str
    jobs: list[Job]
    plan: AnyPlan
    handle: RequestHandle


class LostAdmissions:
    def __init__(
        self,
        redis: aioredis.Redis,
        router: ReplyRouter,
        gateway_id: str,
        readmit: Callable[[Admitted], Awaitable[AdmissionResult]],
        in_background: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._redis = redis
        self._router = router
        self._open_requests = names.open_requests(gateway_id)
        self._readmit = readmit
        self._in_background = in_background
        self._admitted: dict[str, Admitted] = {}
        """Requests queued and not ended yet."""

    def watch(self, request: Admitted) -> None:
        self._admitted[request.plan.request_id] = request

    def forget(self, request_id: str) -> None:
        self._admitted.pop(request_id, None)

    async def requeue_lost(self) -> None:
        """Queue again the requests whose open entry Redis no longer holds."""
        admitted = list(self._admitted)
        if not admitted:
            return
        try:
            entries = await self._redis.hmget(self._open_requests, admitted)
        except RedisError as exc:
            log.warning(
                "could not check %d open requests after a reconnect: %s", len(admitted), exc
            )
            return
        lost = [
            self._admitted[rid]
            for rid, entry in zip(admitted, entries, strict=True)
            if entry is None and rid in self._admitted  # (not ended meanwhile)
        ]
        if not lost:
            return
        log.error(
            "Redis lost the admission of %d open requests (it restarted or failed over "
            "without writes it had acknowledged): %s",
            len(lost),
            ", ".join(request.plan.request_id for request in lost[:5]),
        )
        for request in lost:
            if request.handle.started:
                self._end(request.plan.request_id, "its first events had arrived")
            else:
                self._in_background(self._requeue(request))

    async def _requeue(self, request: Admitted) -> None:
        request_id = request.plan.request_id
        try:
            result = await self._readmit(request)
        except RedisError as exc:
            self._end(request_id, f"queueing it again failed: {exc}")
            return
        if result.outcome is not Admission.QUEUED:
            self._end(request_id, f"queueing it again was refused ({result.outcome.name})")
            return
        log.warning("queued %s again after Redis lost its admission", request_id)

    def _end(self, request_id: str, why: str) -> None:
        log.error("ending %s, whose admission Redis lost: %s", request_id, why)
        self._router.interrupt(
            [request_id],
            "Redis lost this request's job when it restarted or failed over (the write had "
            f"not reached disk or a replica) and {why}: retry the request",
        )
