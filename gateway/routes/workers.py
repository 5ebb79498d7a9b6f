"""Worker admin routes: ``GET /admin/workers`` and ``POST /admin/workers/{id}/<command>``
(drain, resume, clear-kv, sleep, wake) over the worker command channel
(:mod:`shared.queue.worker_commands`) of the worker's own Redis. ``admin`` scope.

A worker's answer becomes: ``ok`` 200; ``not_supported`` 501 with the engine's reason
(vLLM on CPU has no sleep mode: never faked); ``failed`` 500; an unknown worker 404; no
answer within ``worker_command_timeout_s`` 504.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Depends

from gateway.auth import require_scope
from gateway.control.records import Scope
from gateway.state import StateDep
from shared.errors import (
    InvalidRequest,
    NotSupportedByEngine,
    WorkerCommandFailed,
    WorkerCommandTimeout,
    WorkerNotFound,
)
from shared.protocol import WorkerCommandResult
from shared.queue.liveness import WorkerRegistry
from shared.queue.worker_commands import Command, CommandStatus, send_worker_command

router = APIRouter(prefix="/admin/workers", dependencies=[Depends(require_scope(Scope.ADMIN))])

MAX_WORKER_ID_CHARS = 256


@router.get("")
async def list_workers(state: StateDep) -> dict[str, Any]:
    """Every live worker's registry entry (adapters: loaded/loading/failed with reason)."""
    workers = [
        worker
        for cell in state.cells.all()
        for worker in await WorkerRegistry(cell.redis, ttl_s=1.0).live_workers()
    ]
    ordered = sorted(workers, key=lambda w: w.worker_id)
    return {"object": "list", "data": [msgspec.to_builtins(w) for w in ordered]}


@router.post("/{worker_id}/{command}")
async def worker_command(worker_id: str, command: str, state: StateDep) -> dict[str, Any]:
    kind = _command(command)
    if len(worker_id) > MAX_WORKER_ID_CHARS:
        raise WorkerNotFound(f"no live worker {worker_id[:64]!r}...", param="worker_id")
    result = await send_worker_command(
        state.cells.of_worker(worker_id).redis,
        worker_id,
        kind,
        state.settings.worker_command_timeout_s,
    )
    _raise_unless_ok(result)
    return {"worker_id": worker_id, "command": kind.value, "status": "ok", "detail": result.detail}


def _command(command: str) -> Command:
    try:
        return Command(command)
    except ValueError:
        known = ", ".join(c.value for c in Command)
        raise InvalidRequest(
            f"unknown worker command {command[:64]!r}: use one of {known}", param="command"
        ) from None


def _raise_unless_ok(result: WorkerCommandResult) -> None:
    status = result.status
    if status == CommandStatus.OK:
        return
    if status == CommandStatus.NOT_SUPPORTED:
        raise NotSupportedByEngine(result.detail)
    if status == CommandStatus.UNKNOWN_WORKER:
        raise WorkerNotFound(result.detail, param="worker_id")
    if status == CommandStatus.TIMEOUT:
        raise WorkerCommandTimeout(result.detail)
    if status == CommandStatus.UNKNOWN_COMMAND:
        raise InvalidRequest(result.detail, param="command")
    raise WorkerCommandFailed(result.detail)
