"""Admin commands for this worker: drain, resume, clear KV, sleep, wake.

The command channel's listener (:mod:`workers.commands.listener`) hands every
:class:`~shared.protocol.WorkerCommand` to :meth:`WorkerAdmin.handle`; the one
addressed to this worker runs in a task of its own and is answered on its reply key
(:func:`shared.queue.worker_commands.answer`) within the sender's ``timeout_s``.

* ``drain``: take no new jobs (the read under way finishes first), let running ones
  finish, stay up and registered (``draining``, ``paused``) until ``resume``.
* ``clear-kv``: the engine's prefix cache; vLLM refuses (returns False) while requests
  run, so it is asked again every ``CLEAR_KV_RETRY_S`` until it accepts or time is up.
* ``sleep`` / ``wake``: where the engine has a sleep mode; otherwise ``not_supported``
  with the engine's reason (vLLM on CPU has none; it is never faked).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.errors import ConveyorError
from shared.protocol import WorkerCommand, WorkerCommandResult
from shared.queue.worker_commands import Command, CommandStatus, answer
from workers.engines.base import EngineAdmin, NotSupported
from workers.intake.active_jobs import ActiveJobs, Lifecycle

log = logging.getLogger(__name__)

CLEAR_KV_RETRY_S = 0.05
ANSWER_MARGIN_S = 0.5
"""Answer this long before the sender stops waiting."""
NO_KV = "not supported on this engine: it keeps no KV cache to clear"
NO_SLEEP = "not supported on this engine: it has no sleep mode"

Outcome = tuple[CommandStatus, str]


class Quiescent(Protocol):
    async def quiesce(self) -> None:
        """Return once no job of a read begun earlier is still being started."""
        ...


class WorkerAdmin:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        worker_id: str,
        lifecycle: Lifecycle,
        consumer: Quiescent,
        jobs: ActiveJobs,
        admin: EngineAdmin | None,
    ) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._lifecycle = lifecycle
        self._consumer = consumer
        self._jobs = jobs
        self._admin = admin
        self._tasks: set[asyncio.Task[None]] = set()

    def handle(self, command: WorkerCommand) -> None:
        """A command off the command channel: serve it if it is addressed here."""
        if command.worker_id != self._worker_id:
            return
        task = asyncio.create_task(self._serve(command), name=f"command-{command.command}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, command: WorkerCommand) -> None:
        started = time.monotonic()
        result = await self.execute(command)
        log.info(
            "admin command %s: %s (%s) in %.3fs",
            command.command,
            result.status,
            result.detail,
            time.monotonic() - started,
        )
        try:
            await answer(self._redis, result)
        except RedisError as exc:
            log.warning("could not answer admin command %s: %s", command.command, exc)

    async def execute(self, command: WorkerCommand) -> WorkerCommandResult:
        try:
            kind = Command(command.command)
        except ValueError:
            return self._result(
                command,
                CommandStatus.UNKNOWN_COMMAND,
                f"this worker does not know the command {command.command!r}",
            )
        budget_s = max(0.1, command.timeout_s - ANSWER_MARGIN_S)
        try:
            status, detail = await self._run(kind, budget_s)
        except NotSupported as exc:
            status, detail = CommandStatus.NOT_SUPPORTED, str(exc)
        except ConveyorError as exc:
            status, detail = CommandStatus.FAILED, exc.message
        return self._result(command, status, detail)

    async def _run(self, kind: Command, budget_s: float) -> Outcome:
        handlers: dict[Command, Callable[[], Awaitable[Outcome]]] = {
            Command.DRAIN: self._drain,
            Command.RESUME: self._resume,
            Command.CLEAR_KV: lambda: self._clear_kv(budget_s),
            Command.SLEEP: lambda: self._engine_admin("sleep"),
            Command.WAKE: lambda: self._engine_admin("wake"),
        }
        return await handlers[kind]()

    async def _drain(self) -> Outcome:
        self._lifecycle.pause()
        await self._consumer.quiesce()
        return CommandStatus.OK, (
            f"draining: takes no new jobs; {len(self._jobs)} running "
            "finish; `resume` takes jobs again"
        )

    async def _resume(self) -> Outcome:
        self._lifecycle.resume()
        return CommandStatus.OK, "taking jobs"

    async def _clear_kv(self, budget_s: float) -> Outcome:
        if self._admin is None:
            raise NotSupported(NO_KV)
        deadline = time.monotonic() + budget_s
        tries = 0
        while True:
            tries += 1
            if await self._admin.clear_kv():
                return CommandStatus.OK, f"prefix cache cleared (engine asked {tries} times)"
            if time.monotonic() >= deadline:
                return CommandStatus.FAILED, (
                    f"the engine refused to clear its KV cache for {budget_s:.1f}s "
                    f"({len(self._jobs)} jobs running); drain the worker first"
                )
            await asyncio.sleep(CLEAR_KV_RETRY_S)

    async def _engine_admin(self, what: str) -> Outcome:
        if self._admin is None:
            raise NotSupported(NO_SLEEP)
        await (self._admin.sleep() if what == "sleep" else self._admin.wake())
        return CommandStatus.OK, f"engine {'asleep' if what == 'sleep' else 'awake'}"

    def _result(
        self, command: WorkerCommand, status: CommandStatus, detail: str
    ) -> WorkerCommandResult:
        return WorkerCommandResult(command.command_id, self._worker_id, status.value, detail)
