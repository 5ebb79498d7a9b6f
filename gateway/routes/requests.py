"""Where a request is: ``GET /v1/requests/{id}`` and ``POST /v1/requests/{id}/cancel``.

The id is the response's ``X-Request-Id`` (the completion's ``id``). Any gateway answers:
the status is read from Redis (shared/queue/request_status.py), from every cell, since
the request's model decides its Redis. Only the key that made the request, or an admin
key, sees it: any other gets 404, as for an id that does not exist.

A cancel goes to the gateway delivering the request, as a :class:`CancelCommand` on its
reply stream: its reply router ends the request (the stream's last event is a
``request_cancelled`` error) and the request's handle cancels its jobs on the workers.
The workers are told directly too, so a cancel still stops them when that gateway died.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from gateway.auth import require_scope
from gateway.control.records import Principal, Scope
from gateway.dispatch.cells import Cell
from gateway.state import GatewayState, StateDep
from shared.connections.connect import db_of
from shared.errors import RequestNotFound
from shared.protocol import CancelCommand, encode, encode_bytes
from shared.queue import names
from shared.queue.request_status import RequestStatus, read_status

router = APIRouter(prefix="/v1/requests")

Inference = Annotated[Principal, Depends(require_scope(Scope.INFERENCE))]
CANCEL_FLAG_TTL_S = 3600


@router.get("/{request_id}")
async def request_status(request_id: str, state: StateDep, principal: Inference) -> Any:
    cell, status = await _find(state, request_id, principal)
    status.eta_s = _eta_s(cell, status)
    return status.as_json()


@router.post("/{request_id}/cancel")
async def cancel_request(request_id: str, state: StateDep, principal: Inference) -> Any:
    cell, status = await _find(state, request_id, principal)
    if status.state != "finished":
        async with cell.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(names.reply_stream(status.gateway_id), encode(CancelCommand(request_id)))  # type: ignore[arg-type]
            pipe.set(names.cancel_flag(request_id), b"1", ex=CANCEL_FLAG_TTL_S)
            pipe.publish(
                names.command_channel(db_of(cell.redis)), encode_bytes(CancelCommand(request_id))
            )
            await pipe.execute()
    return {**status.as_json(), "cancel_requested": status.state != "finished"}


async def _find(
    state: GatewayState, request_id: str, principal: Principal
) -> tuple[Cell, RequestStatus]:
    for cell in state.cells.all():
        status = await read_status(cell.redis, request_id)
        if status is None:
            continue
        if principal.has_scope(Scope.ADMIN) or status.key_id == principal.key_id:
            return cell, status
        break
    raise RequestNotFound(f"No request with id {request_id!r} (or not one of this key's).")


def _eta_s(cell: Cell, status: RequestStatus) -> float | None:
    """Seconds until a queued request's turn, at its stream's observed drain rate."""
    if status.position is None:
        return None
    drain = cell.dispatcher.drain
    drain.watch(status.stream)
    rate = drain.rate_per_s.get(status.stream, 0.0)
    return round(status.position / rate, 1) if rate > 0 else None
