"""The worker's side of the LoRA registry: reconcile the engine to the desired adapters.

1. Poll the generation counter of this worker's model every ``poll_s``
   (:mod:`shared.queue.lora_registry`); when it moved, read the desired adapters.
2. Load each desired adapter that is not loaded (the engine checks the folder, then
   loads it) and read its job stream from then on; report ``loading``, then ``loaded``
   or ``failed: <reason>``. Failed ones are tried again every ``retry_failed_s`` (a
   folder that appears later) and whenever the desired state changes.
3. An adapter no longer desired (or whose spec changed) is reported ``unloading``: the
   worker keeps reading its stream until the stream is empty (every request admitted
   before the removal is served, at most ``drain_max_s``), stops reading it, waits for
   its running sequences and unloads it, in the background.
4. Desired state unknown (nothing published, or Redis lost it): keep what is loaded.

:meth:`LoraReconciler.start` runs the first pass to its end before the worker reads
any job, so a worker that starts, restarts or replaces another has loaded every
registered adapter before it reports ready (``ready`` waits for :attr:`synced`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.connections.retry import Backoff
from shared.errors import EngineDead
from shared.queue.job_queue import JobStream
from shared.queue.lora_registry import (
    LOADED,
    LOADING,
    POLL_S,
    UNLOADING,
    LoraSpec,
    desired_generation,
    failed,
    read_desired,
)
from shared.roles import Role
from shared.tasks import cancel_and_wait
from workers.engines.base import EngineLoras, LoraLoadError

log = logging.getLogger(__name__)


class StreamSet(Protocol):
    """The job streams a worker reads (:class:`workers.intake.consumer.JobConsumer`)."""

    async def add_stream(self, stream: JobStream) -> None: ...

    async def remove_stream(self, stream: JobStream) -> None: ...


@dataclass(frozen=True, slots=True)
class LoraTiming:
    poll_s: float = POLL_S
    retry_failed_s: float = 30.0
    drain_max_s: float = 300.0
    """How long an unloading adapter's queue may take to empty before it is unloaded."""


class LoraReconciler:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        model: str,
        role: Role,
        adapters: EngineLoras | None,
        off_reason: str,
        streams: StreamSet,
        timing: LoraTiming = LoraTiming(),
    ) -> None:
        self._redis = redis
        self._model = model
        self._role = role
        self._adapters = adapters
        self._off_reason = off_reason
        self._streams = streams
        self._timing = timing
        self._loaded: dict[str, LoraSpec] = {}
        self._failed: dict[str, tuple[LoraSpec, float]] = {}
        self._unloading: dict[str, asyncio.Task[None]] = {}
        self._report: Mapping[str, str] = {}
        self._undecodable: set[str] = set()
        self._seen: int | None = None
        self.generation = 0
        """The desired-state generation applied (0: none known yet)."""
        self.synced = False
        """The first pass has run to its end (the worker may report ready)."""

    def report(self) -> dict[str, str]:
        """Adapter name -> state, for the registry entry (a copy: the heartbeat thread
        reads it while the event loop replaces it)."""
        return dict(self._report)

    async def start(self, stopping: Callable[[], bool]) -> None:
        """The first pass, tried again while Redis fails (until the worker stops)."""
        backoff = Backoff(0.2, 2.0)
        while not stopping():
            try:
                await self.sync()
            except RedisError as exc:
                log.warning("reading the desired adapters failed (%s); trying again", exc)
                await backoff.wait()
                continue
            self.synced = True
            return

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._timing.poll_s)
                try:
                    generation = await desired_generation(self._redis, self._model)
                    if generation is not None and (generation != self._seen or self._retry_due()):
                        await self.sync()
                except RedisError as exc:
                    log.warning("adapter poll failed: %s", exc)
        finally:
            await cancel_and_wait(list(self._unloading.values()))

    async def sync(self) -> None:
        """One pass: load what is desired and missing, start unloading what is not."""
        desired = await read_desired(self._redis, self._model)
        if desired is None:
            return
        for name in self._undecodable - set(desired.undecodable):
            self._drop(name)
        self._undecodable = set(desired.undecodable)
        for name in desired.undecodable:
            self._set(
                name, failed("this worker cannot read its registration (another Conveyor version?)")
            )
        for name, spec in list(self._loaded.items()):
            if desired.specs.get(name) != spec:
                self._start_unload(spec)
        for name in list(self._failed):
            if name not in desired.specs:
                del self._failed[name]
                self._drop(name)
        for name, spec in sorted(desired.specs.items()):
            if name not in self._loaded and name not in self._unloading and self._due(spec):
                await self._load(spec)
        self._seen = desired.generation
        self.generation = desired.generation

    def _due(self, spec: LoraSpec) -> bool:
        attempt = self._failed.get(spec.name)
        if attempt is None or attempt[0] != spec:
            return True
        return time.monotonic() - attempt[1] >= self._timing.retry_failed_s

    def _retry_due(self) -> bool:
        return any(self._due(spec) for spec, _ in self._failed.values())

    async def _load(self, spec: LoraSpec) -> None:
        if self._adapters is None:
            self._fail(spec, self._off_reason)
            return
        self._set(spec.name, LOADING)
        started = time.monotonic()
        try:
            await self._adapters.load(spec.name, spec.path)
        except LoraLoadError as exc:
            log.warning("adapter %s (%s) failed to load: %s", spec.name, spec.path, exc)
            self._fail(spec, str(exc))
            return
        except EngineDead as exc:  # the engine monitor stops the worker
            self._fail(spec, f"the engine died: {exc}")
            return
        await self._streams.add_stream(JobStream(spec.name, self._role))
        self._failed.pop(spec.name, None)
        self._loaded[spec.name] = spec
        self._set(spec.name, LOADED)
        log.info(
            "adapter %s ready in %.3fs; reading its stream", spec.name, time.monotonic() - started
        )

    def _start_unload(self, spec: LoraSpec) -> None:
        del self._loaded[spec.name]
        self._set(spec.name, UNLOADING)
        task = asyncio.create_task(self._unload(spec), name=f"unload-{spec.name}")
        self._unloading[spec.name] = task

    async def _unload(self, spec: LoraSpec) -> None:
        stream = JobStream(spec.name, self._role)
        try:
            await self._drain(stream)
            await self._streams.remove_stream(stream)
            if self._adapters is not None:
                await self._adapters.unload(spec.name)
            log.info("adapter %s unloaded (no longer registered)", spec.name)
        except (RedisError, EngineDead) as exc:
            log.warning("unloading adapter %s: %s", spec.name, exc)
        finally:
            self._unloading.pop(spec.name, None)
            self._drop(spec.name)
            self._seen = None  # registered again meanwhile? the next poll loads it

    async def _drain(self, stream: JobStream) -> None:
        """Until nothing is queued or running on ``stream`` (here or elsewhere)."""
        deadline = time.monotonic() + self._timing.drain_max_s
        while time.monotonic() < deadline:
            try:
                if not await self._redis.xlen(stream.name):
                    return
            except RedisError as exc:
                log.warning("checking %s failed: %s", stream.name, exc)
            await asyncio.sleep(self._timing.poll_s)
        log.warning(
            "adapter %s: requests still queued after %.0fs; unloading anyway",
            stream.model,
            self._timing.drain_max_s,
        )

    def _fail(self, spec: LoraSpec, reason: str) -> None:
        self._failed[spec.name] = (spec, time.monotonic())
        self._set(spec.name, failed(reason))

    def _set(self, name: str, state: str) -> None:
        self._report = {**self._report, name: state}

    def _drop(self, name: str) -> None:
        self._report = {k: v for k, v in self._report.items() if k != name}
