"""Admin commands for one worker (drain, resume, clear KV, sleep, wake), both ends.

The sender (the gateway's ``/admin/workers/{id}/...`` routes) calls
:func:`send_worker_command`: it publishes a :class:`~shared.protocol.WorkerCommand`
on the command channel (every worker listens; only the named one acts) and waits on
``names.command_reply(command_id)`` for the worker's
:class:`~shared.protocol.WorkerCommandResult`, which the worker pushes there with
:func:`answer` (the list expires after ``REPLY_TTL_S``). Pub/sub may drop a message
(the worker was reconnecting): the sender then gets ``timeout`` and may send again;
every command is idempotent.

Statuses and the HTTP answer an admin route gives for them:

=================  ====  ==========================================================
``ok``             200   done (drain: no new jobs start; running ones finish)
``not_supported``  501   the engine cannot (``detail``: "not supported on this engine: ...")
``failed``         500   tried and gave up (``detail`` says why)
``unknown_command`` 400  this worker does not know the command
``unknown_worker`` 404   no live worker has that id
``timeout``        504   no answer within ``timeout_s``
=================  ====  ==========================================================
"""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any, Final

import redis.asyncio as aioredis

from shared.connections.connect import MAX_BLOCK_MS, db_of
from shared.errors import ProtocolError
from shared.protocol import WorkerCommand, WorkerCommandResult, decode_bytes, encode_bytes
from shared.queue import names

__all__ = ["Command", "CommandStatus", "answer", "send_worker_command"]

REPLY_TTL_S: Final = 60


class Command(StrEnum):
    DRAIN = "drain"
    """Stop taking jobs, finish the running ones, stay up (registered as draining)."""
    RESUME = "resume"
    """Take jobs again after a drain."""
    CLEAR_KV = "clear-kv"
    """Drop the prefix cache (vLLM ``reset_prefix_cache``), retried until it is accepted."""
    SLEEP = "sleep"
    """Release the engine's memory (where the engine has a sleep mode)."""
    WAKE = "wake"


class CommandStatus(StrEnum):
    OK = "ok"
    NOT_SUPPORTED = "not_supported"
    FAILED = "failed"
    UNKNOWN_COMMAND = "unknown_command"
    UNKNOWN_WORKER = "unknown_worker"
    TIMEOUT = "timeout"


async def send_worker_command(
    redis: aioredis.Redis, worker_id: str, command: Command | str, timeout_s: float
) -> WorkerCommandResult:
    """Send ``command`` to ``worker_id`` and wait up to ``timeout_s`` for its answer.

    Never raises for a worker that is gone or silent: the result's ``status`` says so
    (``unknown_worker``, ``timeout``). Redis errors propagate.
    """
    command_id = uuid.uuid4().hex
    if not await redis.exists(names.worker_heartbeat(worker_id)):
        return WorkerCommandResult(
            command_id, worker_id, CommandStatus.UNKNOWN_WORKER, f"no live worker {worker_id!r}"
        )
    message = WorkerCommand(command_id, worker_id, str(command), float(timeout_s))
    reply_key = names.command_reply(command_id)
    await redis.publish(names.command_channel(db_of(redis)), encode_bytes(message))
    deadline = time.monotonic() + timeout_s
    while (left_s := deadline - time.monotonic()) > 0:
        block_s = min(left_s, MAX_BLOCK_MS / 1000)
        popped: Any = await redis.blpop([reply_key], timeout=max(0.01, block_s))
        if popped is None:
            continue
        result = _result(popped[1])
        if result is not None and result.command_id == command_id:
            await redis.delete(reply_key)
            return result
    return WorkerCommandResult(
        command_id,
        worker_id,
        CommandStatus.TIMEOUT,
        f"worker {worker_id!r} did not answer {str(command)!r} within {timeout_s:g}s",
    )


async def answer(redis: aioredis.Redis, result: WorkerCommandResult) -> None:
    """The worker's side: push ``result`` where the sender waits for it."""
    key = names.command_reply(result.command_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.rpush(key, encode_bytes(result))
        pipe.expire(key, REPLY_TTL_S)
        await pipe.execute()


def _result(data: bytes) -> WorkerCommandResult | None:
    try:
        message = decode_bytes(data)
    except ProtocolError:
        return None
    return message if isinstance(message, WorkerCommandResult) else None
