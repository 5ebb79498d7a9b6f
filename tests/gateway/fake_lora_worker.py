"""A fake aggregated worker that reconciles to the desired LoRA adapters and answers admin
commands, for the in-process gateway (the real reconciler runs in tests/e2e/test_lora.py).

Every ``tick_s`` it reads the desired state (:func:`shared.queue.lora_registry.read_desired`) and
reports each adapter ``loaded`` when its folder exists (a folder holding a ``WRONG_BASE``
file fails as made for another model), else ``failed: no adapter folder at ...``; a loaded
adapter's stream is read by a :class:`FakeWorker` (echo). After :meth:`freeze` it never applies
a generation (a load that never finishes). Admin commands are answered from ``answers``.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import redis.asyncio as aioredis

from shared.connections.connect import db_of
from shared.protocol import WorkerCommand, WorkerCommandResult, decode_bytes
from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import LOADED, failed, read_desired
from shared.queue.worker_commands import answer
from shared.roles import Role
from shared.tasks import cancel_and_wait
from tests.gateway.fake_worker import FakeWorker, echo

WORKER_ID = "aggregated-fake-lora-1"


class FakeLoraWorker:
    def __init__(self, redis: aioredis.Redis, model: str, *, tick_s: float = 0.02) -> None:
        self._redis = redis
        self._model = model
        self._tick_s = tick_s
        self.frozen = False
        self.answers: dict[str, tuple[str, str]] = {}
        """Command -> (status, detail) it answers with (unknown commands: no answer)."""
        self.readers: dict[str, FakeWorker] = {}
        self.report: dict[str, str] = {}
        self._generation = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.sync()
        self._tasks = [
            asyncio.create_task(self._reconcile()),
            asyncio.create_task(self._commands()),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await cancel_and_wait([w.task for w in self.readers.values() if w.task])
        await WorkerRegistry(self._redis, ttl_s=60).remove(WORKER_ID)

    async def freeze(self, report: dict[str, str] | None = None) -> None:
        """Stop applying generations from now on, optionally reporting ``report`` instead.
        Setting ``frozen`` alone races a reconcile pass already past its read of the desired
        state: that pass would still write its report after this one."""
        await cancel_and_wait(self._tasks[:1])
        self.frozen = True
        if report is not None:
            self.report = report
        await self.sync()
        self._tasks[0] = asyncio.create_task(self._reconcile())

    def thaw(self) -> None:
        self.frozen = False

    async def sync(self) -> None:
        desired = None if self.frozen else await read_desired(self._redis, self._model)
        if desired is not None:
            report: dict[str, str] = {}
            for name, spec in desired.specs.items():
                report[name] = _state(Path(spec.path))
                if report[name] == LOADED and name not in self.readers:
                    reader = FakeWorker(self._redis, name, Role.AGGREGATED, echo)
                    await reader.start()
                    self.readers[name] = reader
            self.report, self._generation = report, desired.generation
        await WorkerRegistry(self._redis, ttl_s=60).beat(
            WorkerRegistration(
                worker_id=WORKER_ID,
                role=Role.AGGREGATED,
                model=self._model,
                max_model_len=2048,
                active=0,
                slots=8,
                adapters=self.report,
                adapters_generation=self._generation,
            )
        )

    async def _reconcile(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            await self.sync()

    async def _commands(self) -> None:
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(names.command_channel(db_of(self._redis)))
        try:
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if message is None:
                    await asyncio.sleep(0.005)
                    continue
                with contextlib.suppress(Exception):
                    command = decode_bytes(message["data"])
                    if isinstance(command, WorkerCommand) and command.command in self.answers:
                        status, detail = self.answers[command.command]
                        result = WorkerCommandResult(command.command_id, WORKER_ID, status, detail)
                        await answer(self._redis, result)
        finally:
            await pubsub.aclose()


def _state(folder: Path) -> str:
    if not folder.is_dir():
        return failed(f"no adapter folder at {folder}")
    if (folder / "WRONG_BASE").exists():
        return failed("made for another model (hidden_size 512, this one 256)")
    return LOADED
