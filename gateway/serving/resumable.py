"""Resumable requests: what any gateway needs to read one's events again.

A client asks for a resumable stream with the header ``Conveyor-Resumable: true`` on a
streaming ``/v1/chat/completions`` or ``/v1/completions``; background responses are
resumable too. :func:`prepare` makes the plan resumable (its own reply stream and lease,
:mod:`gateway.dispatch.request_log`) and stores its :class:`ResumeSpec` (the OpenAI body,
the key, the times) under ``conveyor:resumable:{id}`` for as long as its events are
kept. Any gateway rebuilds the request's writer from the spec and renders its events
again: the rendering is a function of the events, so a resumed stream continues the
first one exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis

from gateway.control.records import Principal, Scope
from gateway.dispatch.plan import Deadline, Generation, RequestPlan, Resume
from gateway.state import GatewayState
from shared.errors import InvalidRequest, StreamNotFound
from shared.queue import names

HEADER = "Conveyor-Resumable"
CLIENT = "client"
"""The holder of a resumable stream's lease: whoever reads it, on any gateway."""

Kind = Literal["chat", "completion", "response"]


class ResumeSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: Kind
    body: dict[str, Any]
    """The OpenAI request (a response's: the chat request it became)."""
    key_id: str | None
    sequences: int
    created_unix: float
    deadline_unix: float
    response: dict[str, Any] | None = None
    """A background response's draft (id, model, echoed request fields)."""

    @property
    def deadline(self) -> Deadline:
        return Deadline(self.created_unix, self.deadline_unix)

    def readable_by(self, principal: Principal) -> bool:
        return principal.key_id == self.key_id or principal.has_scope(Scope.ADMIN)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ResumeSpec)


def resume_of(state: GatewayState, holder: str = CLIENT) -> Resume:
    grace_s = state.settings.resume_grace_s
    if holder == CLIENT:
        return Resume(CLIENT, lease_s=grace_s, keep_s=grace_s)
    return Resume(holder, lease_s=state.settings.gateway_liveness_ttl_s, keep_s=grace_s)


async def prepare(
    state: GatewayState,
    plan: RequestPlan[Generation],
    body: Any,
    *,
    kind: Kind,
    holder: str = CLIENT,
    response: dict[str, Any] | None = None,
) -> RequestPlan[Generation]:
    """``plan`` made resumable, its spec stored (``body``: its OpenAI request)."""
    if not body.stream and holder == CLIENT:
        raise InvalidRequest(f"{HEADER}: true needs a streamed request", param=HEADER)
    resume = resume_of(state, holder)
    spec = ResumeSpec(
        kind=kind,
        body=body.model_dump(mode="json", exclude_unset=True, by_alias=True),
        key_id=plan.key_id,
        sequences=len(plan.work.choices),
        created_unix=plan.deadline.created_unix,
        deadline_unix=plan.deadline.deadline_unix,
        response=response,
    )
    redis = state.cells.for_model(plan.served_by).redis
    ttl_s = plan.deadline.remaining_s() + resume.keep_s
    await redis.set(names.resumable(plan.request_id), _encoder.encode(spec), px=int(ttl_s * 1000))
    return dataclasses.replace(plan, resume=resume)


async def load(state: GatewayState, request_id: str) -> tuple[ResumeSpec, aioredis.Redis]:
    """The spec of ``request_id`` and the Redis of its cell; StreamNotFound if none."""
    for cell in state.cells.all():
        raw = await cell.redis.get(names.resumable(request_id))
        if raw is not None:
            return _decoder.decode(raw), cell.redis
    raise StreamNotFound(
        f"No resumable stream with id '{request_id}' (it was not resumable, or it ended "
        "more than CONVEYOR_RESUME_GRACE_S ago)."
    )


async def forget(redis: aioredis.Redis, request_id: str, keep_s: float) -> None:
    await redis.pexpire(names.resumable(request_id), int(keep_s * 1000))
