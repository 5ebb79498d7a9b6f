"""LoRA adapters: the desired state both sides share, and how workers report on it.

SQL is the truth (the gateway's registry); Redis carries it to workers, who never open
a database. Per base model (the served name of the model the adapters were made for):

* ``names.adapters_desired(base)``: a hash, adapter name -> :class:`LoraSpec`
  (versioned MessagePack), the adapters every worker of ``base`` must load;
* ``names.adapters_generation(base)``: a counter bumped in the same ``MULTI`` as every
  write of the hash (:func:`publish_desired`). Workers poll it (every
  ``POLL_S``) and reconcile when it moves (:mod:`workers.commands.lora_sync`). A missing counter
  means *unknown* (never published, or Redis lost it): workers then keep what they have
  rather than unload everything; the gateway republishes from SQL.

Each worker reports, in its registry entry (:class:`shared.queue.liveness.WorkerRegistration`):
``adapters`` (name -> :data:`LOADED` / :data:`LOADING` / :data:`UNLOADING` /
``"failed: <reason>"``) and ``adapters_generation`` (the generation it has applied).

Routing (by pull): an adapter is served as its own model name, like vLLM's server. A
request for adapter ``name`` is a :class:`~shared.protocol.GenerateJob` with
``model=name`` and ``adapter=name``, submitted to :func:`adapter_stream`; only workers
that have the adapter loaded read that stream. :func:`serving_workers` says from the
worker directory where it is loaded; :func:`rollout` / :func:`wait_for_rollout` tell an
admin call whether a load landed.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role

__all__ = [
    "LOADED",
    "LOADING",
    "UNLOADING",
    "DesiredLoras",
    "LoraSpec",
    "Rollout",
    "adapter_stream",
    "failed",
    "failure_reason",
    "publish_desired",
    "read_desired",
    "rollout",
    "serving_workers",
    "validate_adapter_name",
    "wait_for_rollout",
]

SPEC_VERSION: Final = 1
_VERSION_PREFIX: Final = b"%d:" % SPEC_VERSION

POLL_S: Final = 0.25
"""How often a worker reads the generation counter: a change lands within ~0.5 s."""

LOADED: Final = "loaded"
LOADING: Final = "loading"
UNLOADING: Final = "unloading"
"""Removed from the desired state: the worker finishes the adapter's queued and running
requests, then unloads it (it still reads the adapter's stream meanwhile)."""
_FAILED: Final = "failed: "

SERVING_ROLE: Final = Role.AGGREGATED
"""The role whose workers serve adapters (prefill/decode workers report them failed)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-/:]{0,127}")


class LoraSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One registered adapter. A map with defaults omitted: a new field takes a default,
    so specs written before it still decode (no version bump)."""

    name: str
    """The model name clients send for it (also its job stream's name)."""
    path: str
    """Absolute path of a PEFT adapter folder every worker of ``base_model`` can read."""
    base_model: str
    """The served name of the model it was made for: its workers load it."""


@dataclass(frozen=True, slots=True)
class DesiredLoras:
    generation: int
    specs: Mapping[str, LoraSpec]
    undecodable: tuple[str, ...] = ()
    """Hash fields whose value this version cannot read (a newer writer, or garbage)."""


def validate_adapter_name(name: str) -> str:
    """``name`` if it can be a model and stream name: 1-128 of ``A-Za-z0-9._-/:``,
    starting with a letter or digit. Raises ``ValueError``."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid adapter name {name!r}: use 1-128 letters, digits and . _ - / :, "
            "starting with a letter or digit"
        )
    return name


def adapter_stream(name: str) -> str:
    """The job stream of adapter ``name``'s requests."""
    return names.job_stream(name, SERVING_ROLE)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoraSpec)


def encode_spec(spec: LoraSpec) -> bytes:
    return _VERSION_PREFIX + _encoder.encode(spec)


def decode_spec(data: bytes) -> LoraSpec:
    """Raises ``ValueError`` for another version or a payload that is not a spec."""
    if not data.startswith(_VERSION_PREFIX):
        raise ValueError(f"unsupported adapter spec version {data.partition(b':')[0]!r}")
    try:
        return _decoder.decode(data[len(_VERSION_PREFIX) :])
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from exc


async def publish_desired(redis: aioredis.Redis, base_model: str, specs: Iterable[LoraSpec]) -> int:
    """Replace the desired adapters of ``base_model`` (all of them, atomically) and bump
    the generation; returns the new generation. Raises ``ValueError`` for a spec of
    another base model, a bad name, or a name given twice."""
    fields: dict[str, bytes] = {}
    for spec in specs:
        validate_adapter_name(spec.name)
        if spec.base_model != base_model:
            raise ValueError(
                f"adapter {spec.name!r} is for {spec.base_model!r}, not {base_model!r}"
            )
        if spec.name in fields:
            raise ValueError(f"adapter {spec.name!r} given twice")
        fields[spec.name] = encode_spec(spec)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(names.adapters_desired(base_model))
        if fields:
            pipe.hset(names.adapters_desired(base_model), mapping=fields)  # type: ignore[arg-type]
        pipe.incr(names.adapters_generation(base_model))
        replies = await pipe.execute()
    return int(replies[-1])


async def desired_generation(redis: aioredis.Redis, base_model: str) -> int | None:
    """The current generation (one GET: what workers poll); None when unknown."""
    value: Any = await redis.get(names.adapters_generation(base_model))
    return None if value is None else int(value)


async def read_desired(redis: aioredis.Redis, base_model: str) -> DesiredLoras | None:
    """The desired adapters of ``base_model`` with their generation, read atomically;
    None when the desired state is unknown (nothing published, or lost)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.get(names.adapters_generation(base_model))
        pipe.hgetall(names.adapters_desired(base_model))
        generation, raw = await pipe.execute()
    if generation is None:
        return None
    specs: dict[str, LoraSpec] = {}
    bad: list[str] = []
    for field, value in (raw or {}).items():
        name = field.decode(errors="replace") if isinstance(field, bytes) else str(field)
        try:
            spec = decode_spec(value)
        except ValueError:
            bad.append(name)
            continue
        if spec.name == name and spec.base_model == base_model:
            specs[name] = spec
        else:
            bad.append(name)
    return DesiredLoras(int(generation), specs, tuple(sorted(bad)))


# ------------------------------------------------------------------ worker reports


def failed(reason: str) -> str:
    """The report of an adapter that could not be loaded."""
    return _FAILED + (reason.strip().replace("\n", " ") or "unknown error")


def failure_reason(state: str) -> str | None:
    """The reason of a ``failed: <reason>`` report, else None."""
    return state[len(_FAILED) :] if state.startswith(_FAILED) else None


def serving_workers(
    workers: Iterable[WorkerRegistration], adapter: str
) -> list[WorkerRegistration]:
    """Workers that can take ``adapter``'s requests now: ready, not draining, loaded."""
    return [w for w in workers if w.ready and not w.draining and w.adapters.get(adapter) == LOADED]


@dataclass(frozen=True, slots=True)
class Rollout:
    """Where one adapter stands on the live workers of its base model."""

    loaded: tuple[str, ...]
    """Worker ids reporting it loaded."""
    failed: Mapping[str, str]
    """Worker id -> reason."""
    pending: tuple[str, ...]
    """Workers that have not applied the generation yet, or are still loading it."""

    @property
    def settled(self) -> bool:
        """Every worker has answered (or one has it loaded: the request can run)."""
        return bool(self.loaded) or not self.pending


def rollout(
    workers: Iterable[WorkerRegistration], *, base_model: str, adapter: str, generation: int
) -> Rollout:
    """The state of ``adapter`` on the workers of ``base_model`` that serve adapters,
    counting only reports of ``generation`` or later."""
    loaded: list[str] = []
    bad: dict[str, str] = {}
    pending: list[str] = []
    for w in workers:
        if w.model != base_model or w.role is not SERVING_ROLE:
            continue
        state = w.adapters.get(adapter) if w.adapters_generation >= generation else None
        reason = failure_reason(state or "")
        if state == LOADED:
            loaded.append(w.worker_id)
        elif reason is not None:
            bad[w.worker_id] = reason
        else:
            pending.append(w.worker_id)
    return Rollout(tuple(sorted(loaded)), bad, tuple(sorted(pending)))


async def wait_for_rollout(
    redis: aioredis.Redis,
    *,
    base_model: str,
    adapter: str,
    generation: int,
    timeout_s: float,
    poll_s: float = 0.1,
) -> Rollout:
    """Poll the worker registry until :attr:`Rollout.settled` or ``timeout_s``; returns
    the last rollout seen (an empty one: no worker of ``base_model`` serves adapters)."""
    registry = WorkerRegistry(redis, ttl_s=1.0)
    deadline = time.monotonic() + timeout_s
    while True:
        state = rollout(
            await registry.live_workers(),
            base_model=base_model,
            adapter=adapter,
            generation=generation,
        )
        if state.settled or time.monotonic() >= deadline:
            return state
        await asyncio.sleep(poll_s)
