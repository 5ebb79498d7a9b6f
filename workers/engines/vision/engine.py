"""The encode role's engine: a vision encoder (transformers, CPU) and where its output goes.

:class:`ImageEncoding` turns an image (named by content hash) into embedding bytes
in the embedding transport: the embedding cache, else decode the gateway-stored
bytes and run the model's vision encoder (one image at a time, in a thread;
concurrent requests for the same image share one encoding). :class:`VisionEngine`
wraps it as an :class:`~workers.engines.base.EncodeEngine`: health, load and the
registry entry work as for any engine, so an encode worker is supervised, drained
and reclaimed like the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses

import redis.asyncio as aioredis

from shared.protocol import ImageRef
from shared.queue.media_store import DecodedImages, EmbeddingStore, ImageStore, embedding_store
from shared.settings import Settings
from workers.engines.base import EngineInfo, PromptTokenStats
from workers.engines.vision.embedding_cache import EmbeddingCache
from workers.engines.vision.encoder import VisionEncoder

DECODED_IMAGES_BYTES = 64 * 1024 * 1024


class ImageEncoding:
    """Content hash -> embedding bytes in the transport, through the cache."""

    def __init__(
        self,
        encoder: VisionEncoder,
        images: ImageStore,
        embeddings: EmbeddingStore,
        cache: EmbeddingCache,
    ) -> None:
        self._encoder = encoder
        self._embeddings = embeddings
        self.cache = cache
        self._decoded = DecodedImages(images, DECODED_IMAGES_BYTES)
        self._inflight: dict[str, asyncio.Task[bytes]] = {}
        self._one_at_a_time = asyncio.Lock()

    async def publish(self, model: str, ref: ImageRef, ttl_s: int) -> None:
        blob = self.cache.get(ref.digest)
        if blob is None:
            blob = await self._encode_once(ref)
        await self._embeddings.put(model, ref.digest, blob, ttl_s)

    async def _encode_once(self, ref: ImageRef) -> bytes:
        task = self._inflight.get(ref.digest)
        if task is None:
            task = asyncio.create_task(self._encode(ref))
            self._inflight[ref.digest] = task
            task.add_done_callback(lambda _: self._inflight.pop(ref.digest, None))
        return await asyncio.shield(task)

    async def _encode(self, ref: ImageRef) -> bytes:
        image = await self._decoded.get(ref.digest)
        async with self._one_at_a_time:  # torch already uses every core for one image
            embedding = await asyncio.to_thread(self._encoder.encode, image)
        blob = embedding.to_bytes()
        self.cache.put(ref.digest, blob)
        return blob

    def running(self) -> int:
        return len(self._inflight)

    async def probe(self) -> None:
        """The canary: encode a tiny image (bypassing the cache)."""
        from PIL import Image

        async with self._one_at_a_time:
            await asyncio.to_thread(self._encoder.encode, Image.new("RGB", (32, 32)))

    def cache_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self.cache.stats)


class VisionEngine:
    def __init__(self, encoder: VisionEncoder, settings: Settings, served_name: str) -> None:
        self._encoder = encoder
        self._settings = settings
        self._encoding: ImageEncoding | None = None
        self.info = EngineInfo(model=served_name, max_model_len=0)
        self.prompt_stats = PromptTokenStats()

    @classmethod
    def load(cls, settings: Settings, model_path: str, served_name: str) -> VisionEngine:
        return cls(VisionEncoder.load(model_path), settings, served_name)

    def attach(self, redis: aioredis.Redis) -> None:
        """Connect to where images come from and embeddings go."""
        cache = EmbeddingCache(int(self._settings.embedding_cache_mib * 1024 * 1024))
        self._encoding = ImageEncoding(
            self._encoder,
            ImageStore(redis),
            embedding_store(self._settings.embedding_transport, redis),
            cache,
        )

    @property
    def encoding(self) -> ImageEncoding:
        if self._encoding is None:
            raise RuntimeError("VisionEngine.attach() was not called")
        return self._encoding

    async def check_health(self) -> None:
        return None  # in-process: if the encoder is broken, the canary says so

    def running(self) -> int:
        return 0 if self._encoding is None else self._encoding.running()

    def shutdown(self) -> None:
        return None
