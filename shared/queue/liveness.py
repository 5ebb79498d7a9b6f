"""Who is alive: every liveness key, its writer and its readers, in one module.

Liveness is a Redis key with a TTL; its expiry means dead.

* Workers: ``conveyor:worker:{id}`` holds the worker's :class:`WorkerRegistration`
  (TTL ``heartbeat_ttl_s``). A worker beats it from a :class:`HeartbeatThread`, and
  each beat also lists the worker in ``conveyor:workers`` (``names.WORKER_SET``), so
  that gateways read every entry through :class:`WorkerRegistry` in one round trip,
  however many other keys Redis holds; other workers' janitors take over the jobs of
  a worker whose key expired; a supervisor that saw a worker process exit deletes its
  key at once (:func:`forget_dead_process`).
* Gateways: ``conveyor:gateway:{id}`` (TTL ``gateway_liveness_ttl_s``), rewritten by
  :func:`keep_gateway_alive`; workers drop or abort the jobs of a gateway that
  :class:`GatewayWatch` has seen gone for a whole grace period.

One concept (is it alive?), one module: writers and readers of a key change together.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.connections.connect import as_text
from shared.connections.url import sync_client
from shared.engine_stats import EngineStats
from shared.queue import names
from shared.roles import Role

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------- workers


class WorkerRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's registry entry: the value of its liveness key (JSON)."""

    worker_id: str
    role: Role
    model: str
    max_model_len: int
    active: int
    engine_running: int = 0
    slots: int
    draining: bool = False
    ready: bool = True
    prompt_tokens_computed: int = 0
    prompt_tokens_transferred: int = 0
    kv_transfers: int = 0
    kv_transfer_s: float = 0.0
    can_decode_alone: bool = True
    """False for SGLang decode workers: they cannot run a prompt without a prefill."""
    embedding_cache: dict[str, int] | None = None
    """Encode workers: image embedding cache hits, misses, evictions, entries, bytes."""
    paused: bool = False
    """Drained by an admin command: takes no jobs until resumed (``draining`` is set too)."""
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    """LoRA adapter name -> ``loaded`` / ``loading`` / ``unloading`` / ``failed: <reason>``
    (see shared/queue/lora_registry.py)."""
    adapters_generation: int = 0
    """The generation of the desired adapters (shared/queue/lora_registry.py) this worker
    applied."""
    engine_stats: EngineStats | None = None
    """The engine's scheduler state and counters (shared/engine_stats.py); None for
    engines that report none."""
    waiting: int = 0
    """Jobs held that have not started: the engine's queue, and those read but not in the
    engine yet (placement's load)."""
    queued_prefill_tokens: int = 0
    """Prompt tokens of the jobs held whose prompt is not computed yet."""
    reads_placed: bool = False
    """The worker reads its own job stream (CONVEYOR_PLACEMENT on): jobs may be placed on it."""
    steals: int = 0
    """Jobs it took from other workers' own streams since it started (placement reason
    ``steal``)."""
    reclaims: int = 0
    """Jobs it took over from dead (or stale) owners and ran again, since it started."""
    reported_ms: int = 0
    """When this entry was written (wall clock, ms): a newer one is a newer report."""


_decoder = msgspec.json.Decoder(WorkerRegistration)

SET_GRACE_MS = 60_000
"""A worker stays listed in the set this long after its key expired (then a reader drops
it): far longer than any clock step, and the key is what says it lives."""

BEAT = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], ms + tonumber(ARGV[2]), ARGV[3])
"""

LIVE = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms - tonumber(ARGV[1]))
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local values = {}
for first = 1, #ids, 500 do
  local keys = {}
  for i = first, math.min(first + 499, #ids) do
    table.insert(keys, ARGV[2] .. ids[i])
  end
  for _, value in ipairs(redis.call('MGET', unpack(keys))) do
    if value then table.insert(values, value) end
  end
end
return values
"""


def _decoded(values: list[bytes | str | None]) -> list[WorkerRegistration]:
    workers = []
    for value in values:
        if value is None:
            continue
        try:
            workers.append(_decoder.decode(value))
        except msgspec.DecodeError:
            continue
    return workers


def beat_args(worker_id: str, payload: bytes, ttl_ms: int) -> tuple[list[str], list[Any]]:
    """The keys and arguments of one :data:`BEAT`."""
    return [names.worker_heartbeat(worker_id), names.WORKER_SET], [payload, ttl_ms, worker_id]


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis, *, ttl_s: float) -> None:
        self._redis = redis
        self.ttl_s = ttl_s
        self._beat = redis.register_script(BEAT)
        self._live = redis.register_script(LIVE)

    async def beat(self, registration: WorkerRegistration) -> None:
        keys, args = beat_args(
            registration.worker_id, self.encode(registration), int(self.ttl_s * 1000)
        )
        await self._beat(keys=keys, args=args)

    @staticmethod
    def encode(registration: WorkerRegistration) -> bytes:
        return msgspec.json.encode(registration)

    async def remove(self, worker_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(names.worker_heartbeat(worker_id))
            pipe.zrem(names.WORKER_SET, worker_id)
            await pipe.execute()

    async def live_workers(self) -> list[WorkerRegistration]:
        """Every worker whose liveness key is there, in one round trip (the set lists
        them; the keys of those gone longer than ``SET_GRACE_MS`` leave it)."""
        values = await self._live(
            keys=[names.WORKER_SET], args=[SET_GRACE_MS, names.worker_heartbeat("")]
        )
        return _decoded(values)

    async def entries(self, worker_ids: list[str]) -> list[WorkerRegistration]:
        """The registry entries of ``worker_ids`` that are still there (one MGET)."""
        if not worker_ids:
            return []
        values = await self._redis.mget([names.worker_heartbeat(w) for w in worker_ids])
        return _decoded(values)

    async def dead(self, worker_ids: Iterable[str]) -> set[str]:
        """Those of ``worker_ids`` whose liveness key has expired (one round trip)."""
        ordered = sorted(set(worker_ids))
        if not ordered:
            return set()
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in ordered:
                pipe.exists(names.worker_heartbeat(worker_id))
            alive = await pipe.execute()
        return {worker_id for worker_id, live in zip(ordered, alive, strict=True) if not live}


def forget_dead_process(redis_url: str, pid: int, host: str | None = None) -> list[str]:
    """Delete the registry keys of a worker process known to be dead; returns their ids.

    For a supervisor that saw its child exit: the janitors of the other workers then
    reclaim its jobs at once instead of waiting for the heartbeat TTL to run out.
    Worker ids read ``{role}-{host}-{pid}-{suffix}``.
    """
    import socket

    marker = f"-{host or socket.gethostname()}-{pid}-"
    client = sync_client(redis_url, timeout_s=2.0, connect_timeout_s=2.0)
    try:
        listed: Any = client.zrange(names.WORKER_SET, 0, -1)
        dead = [as_text(w) for w in listed if marker in as_text(w)]
        if dead:
            with client.pipeline(transaction=True) as pipe:
                pipe.delete(*(names.worker_heartbeat(w) for w in dead))
                pipe.zrem(names.WORKER_SET, *dead)
                pipe.execute()
        return dead
    finally:
        client.close()


# ------------------------------------------------------------------ heartbeat thread

BEAT_TICK_S = 0.25
REPORT_GAP_S = 0.075
"""A change of load is reported this soon, and a heartbeat written no more often."""
SLOW_BEAT_S = 0.5
"""A SET taking this long means Redis (not this process's event loop) stalled."""


class HeartbeatThread:
    """A worker's heartbeat, beaten from its own thread with its own Redis connection.

    Beating from the event loop made a busy loop (a 2-core box with vLLM engines, a
    long stretch of token output) look dead, so the TTL had to be long and a killed or
    frozen worker was found late. From a thread the beat keeps going through loop
    stalls, so the TTL can be short; the thread still stops beating once the loop has
    not ticked for ``loop_stall_limit_s`` (a hung loop is a dead worker). A SIGSTOP or
    SIGKILL stops the thread with the process.
    """

    def __init__(
        self,
        redis_url: str,
        worker_id: str,
        ttl_s: float,
        payload: Callable[[], bytes],
        *,
        loop_stall_limit_s: float = 10.0,
    ) -> None:
        timeout_s = max(ttl_s, 1.0)
        self._client = sync_client(redis_url, timeout_s=timeout_s, connect_timeout_s=timeout_s)
        self._beat_script = self._client.register_script(BEAT)
        self._worker_id = worker_id
        self._ttl_ms = int(ttl_s * 1000)
        self._interval_s = ttl_s / 4
        self._payload = payload
        self._stall_limit_s = loop_stall_limit_s
        self._last_tick = time.monotonic()
        self._beat_started = 0.0
        self._beat_busy = False
        self._slow_beat_at = -1e9
        self._stop = threading.Event()
        self._nudged = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        self.beats = 0
        """Beats that reached Redis (tests wait on it)."""

    async def run(self) -> None:
        """Tick from the event loop (proof it is alive) while the thread beats."""
        self._thread.start()
        try:
            while True:
                self._last_tick = time.monotonic()
                await asyncio.sleep(BEAT_TICK_S)
        finally:
            # Joined here, blocking: a beat landing after the worker left the registry
            # would bring it back to life for a TTL.
            self._stop.set()
            self._nudged.set()
            self._thread.join(5.0)
            self._client.close()

    def _beat_forever(self) -> None:
        while not self._stop.is_set():
            stalled_s = time.monotonic() - self._last_tick
            if stalled_s <= self._stall_limit_s:
                self._beat()
            else:
                log.error("event loop stalled for %.1fs: no heartbeat until it answers", stalled_s)
            beaten = time.monotonic()
            self._nudged.wait(self._interval_s)
            self._nudged.clear()
            # a change reported early, but never more often than this
            self._stop.wait(max(0.0, REPORT_GAP_S - (time.monotonic() - beaten)))

    def nudge(self) -> None:
        """The worker's load changed: beat soon (at most every ``REPORT_GAP_S``)."""
        self._nudged.set()

    def _beat(self) -> None:
        self._beat_started = time.monotonic()
        self._beat_busy = True
        try:
            keys, args = beat_args(self._worker_id, self._payload(), self._ttl_ms)
            self._beat_script(keys=keys, args=args)
            self.beats += 1
        except RedisError as exc:
            self._slow_beat_at = time.monotonic()
            log.warning("heartbeat failed: %s", exc)
        except Exception:  # a payload that cannot be built must not kill the heartbeat
            log.exception("heartbeat payload failed")
        finally:
            self._beat_busy = False
        if time.monotonic() - self._beat_started > SLOW_BEAT_S:
            self._slow_beat_at = time.monotonic()

    def beating(self) -> bool:
        """Whether the thread runs (it is joined before :meth:`run` returns)."""
        return self._thread.is_alive()

    def redis_stalled(self, within_s: float) -> bool:
        """Whether Redis stalled lately: a beat hangs now, or one was slow or failed in the
        last ``within_s``. Then every worker's heartbeat may have lapsed, live ones too."""
        now = time.monotonic()
        if self._beat_busy and now - self._beat_started > SLOW_BEAT_S:
            return True
        return now - self._slow_beat_at < within_s


# ------------------------------------------------------------------------ gateways

GATEWAY_BEAT_MAX_S = 1.0
"""A gateway rewrites its key at least this often (and at least three times per TTL)."""


async def keep_gateway_alive(redis: aioredis.Redis, gateway_id: str, ttl_s: float) -> None:
    """Rewrite the gateway's liveness key (it also says its reply stream is read) forever."""
    while True:
        try:
            await redis.set(names.gateway_heartbeat(gateway_id), b"1", px=int(ttl_s * 1000))
        except RedisError as exc:
            log.warning("gateway liveness update failed: %s", exc)
        await asyncio.sleep(min(GATEWAY_BEAT_MAX_S, ttl_s / 3))


# ---------------------------------------------------------------- resumable requests

_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


async def hold_request(redis: aioredis.Redis, request_id: str, holder: str, ttl_s: float) -> bool:
    """Keep a resumable request's lease (its pseudo-gateway's liveness key) for ``ttl_s``
    as ``holder``; False: another holder has it. Workers abort the request once the lease
    has been missing for their grace period."""
    key = names.gateway_heartbeat(names.request_holder(request_id))
    held = await redis.eval(_HOLD, 1, key, holder, int(ttl_s * 1000))
    return bool(held)


async def attach_request(redis: aioredis.Redis, request_id: str, ttl_s: float) -> None:
    """A reader is attached to a resumable stream: its lease lives ``ttl_s`` more."""
    key = names.gateway_heartbeat(names.request_holder(request_id))
    await redis.set(key, b"attached", px=int(ttl_s * 1000))


async def take_request(redis: aioredis.Redis, request_id: str, holder: str, ttl_s: float) -> bool:
    """Take a resumable request whose lease lapsed (its holder died); False: it is held."""
    key = names.gateway_heartbeat(names.request_holder(request_id))
    return bool(await redis.set(key, holder.encode(), nx=True, px=int(ttl_s * 1000)))


async def release_request(redis: aioredis.Redis, request_id: str) -> None:
    """The request ended: its lease goes (its usage is then settled from what was sent)."""
    await redis.delete(names.gateway_heartbeat(names.request_holder(request_id)))


FORGET_AFTER_S = 3600.0


class GatewayWatch:
    """Which gateways are gone, so a worker can drop or abort their jobs.

    A missing key alone is not proof the gateway died: a gateway whose event loop
    stalled for a moment, or a Redis that restarted, leaves it missing while the
    gateway still waits for tokens, and dropping that gateway's jobs would hang its
    clients. So a gateway counts as gone only after this worker has seen its key
    missing, on every check, for a whole grace period (the gateway's TTL: a live
    gateway rewrites its key several times within it).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._grace_s = grace_s
        self._clock = clock
        self._missing_since: dict[str, float] = {}

    async def gone(self, gateways: Iterable[str]) -> set[str]:
        ordered = sorted(set(gateways))
        if not ordered:
            return set()
        async with self._redis.pipeline(transaction=False) as pipe:
            for gateway in ordered:
                pipe.exists(names.gateway_heartbeat(gateway))
            alive = await pipe.execute()
        return self.observe(dict(zip(ordered, map(bool, alive), strict=True)))

    def observe(self, alive: Mapping[str, bool]) -> set[str]:
        """Record one check of each gateway's key; return the gateways gone for good."""
        now = self._clock()
        gone = set()
        for gateway, is_alive in alive.items():
            if is_alive:
                self._missing_since.pop(gateway, None)
                continue
            since = self._missing_since.setdefault(gateway, now)
            if now - since >= self._grace_s:
                gone.add(gateway)
        self._forget_long_dead(now)
        return gone

    def _forget_long_dead(self, now: float) -> None:
        stale = [g for g, since in self._missing_since.items() if now - since > FORGET_AFTER_S]
        for gateway in stale:
            del self._missing_since[gateway]
