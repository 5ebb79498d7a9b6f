"""Worker registry: one heartbeat key per worker with a TTL; expiry means dead."""

from __future__ import annotations

import msgspec
import redis.asyncio as aioredis

from shared import keys


class WorkerRegistration(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    role: str
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


_decoder = msgspec.json.Decoder(WorkerRegistration)


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis, *, ttl_s: float) -> None:
        self._redis = redis
        self.ttl_s = ttl_s

    async def beat(self, registration: WorkerRegistration) -> None:
        await self._redis.set(
            keys.worker_heartbeat(registration.worker_id),
            self.encode(registration),
            px=int(self.ttl_s * 1000),
        )

    @staticmethod
    def encode(registration: WorkerRegistration) -> bytes:
        return msgspec.json.encode(registration)

    async def remove(self, worker_id: str) -> None:
        await self._redis.delete(keys.worker_heartbeat(worker_id))

    async def live_workers(self) -> list[WorkerRegistration]:
        names = [key async for key in self._redis.scan_iter(keys.WORKER_HEARTBEAT_PATTERN, 500)]
        if not names:
            return []
        values = await self._redis.mget(names)
        workers = []
        for value in values:
            if value is None:
                continue
            try:
                workers.append(_decoder.decode(value))
            except msgspec.DecodeError:
                continue
        return workers


def forget_dead_process(redis_url: str, pid: int, host: str | None = None) -> list[str]:
    """Delete the registry keys of a worker process known to be dead; returns their ids.

    For a supervisor that saw its child exit: the janitors of the other workers then
    reclaim its jobs at once instead of waiting for the heartbeat TTL to run out.
    Worker ids read ``{role}-{host}-{pid}-{suffix}``.
    """
    import socket

    import redis

    marker = f"-{host or socket.gethostname()}-{pid}-"
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        dead = [key for key in client.scan_iter(keys.WORKER_HEARTBEAT_PATTERN, 500)
                if marker in key.decode()]
        if dead:
            client.delete(*dead)
        return [key.decode().removeprefix(keys.worker_heartbeat("")) for key in dead]
    finally:
        client.close()
