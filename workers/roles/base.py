"""What the worker runtime needs of a role, whatever engine the role drives.

A role module (:mod:`workers.roles.generate`, ``prefill``, ``embed``, ``encode``)
types its engine by the capability it uses and hands the runtime a
:class:`RoleParts`: how to run one leased job, how the idle canary asks the
engine, and the role's registry extras. The runtime never looks at the engine's
type or the role's name to decide what to do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from shared.errors import ConveyorError
from shared.protocol import SamplingOptions
from shared.settings import Settings
from workers.engines.base import EngineAdmin, EngineBase, EngineLoras
from workers.journal.run_journal import RunJournal, RunLease

PROBE_PROMPT = [0]
"""What a role's probe (the idle canary) sends: one token id."""
PROBE_SAMPLING = SamplingOptions(max_tokens=1, temperature=0.0)
"""One greedy token."""


class JobRun(Protocol):
    """One leased job on its way through the engine."""

    @property
    def lease(self) -> RunLease: ...

    async def run(self) -> None:
        """Run the job to its end: final event (or error event) journaled and acked, or
        handed on to the next stage. Raises ``EngineDead`` when the engine died."""
        ...

    def fail(self, error: ConveyorError) -> None:
        """End the job with an error event the client sees, and ack it."""
        ...


NewRun = Callable[[RunLease, RunJournal], JobRun]
Probe = Callable[[str], Awaitable[None]]
"""The canary's request to the engine (its argument: a request id)."""


NO_ADAPTERS = "this worker's engine serves no LoRA adapters"


def no_stats() -> dict[str, int] | None:
    return None


@dataclass(frozen=True, slots=True)
class RoleParts:
    engine: EngineBase
    """Health, load and identity: what every role's engine offers."""
    new_run: NewRun
    probe: Probe
    cache_stats: Callable[[], dict[str, int] | None] = no_stats
    """The registry entry's ``embedding_cache`` (encode workers)."""
    adapters: EngineLoras | None = None
    """LoRA adapters (:mod:`workers.commands.lora_sync` reconciles them to the desired state)."""
    adapters_off: str = NO_ADAPTERS
    """Why ``adapters`` is None: reported for every desired adapter."""
    admin: EngineAdmin | None = None
    """Clear KV, sleep, wake (worker admin commands: :mod:`workers.commands.admin`)."""


@dataclass(frozen=True, slots=True)
class LoadedRole:
    """A role whose engine is loaded; ``connect`` wires it to Redis."""

    engine: EngineBase
    connect: Callable[[aioredis.Redis], RoleParts]


LoadRole = Callable[[Settings, str, str], LoadedRole]
"""(settings, model folder, served name) -> the loaded role."""
