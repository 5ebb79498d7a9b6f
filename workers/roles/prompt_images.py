"""A language worker's view of a job's images: decoded images, or an encode worker's embeddings.

Raw images come from the gateway's :class:`ImageStore` (bytes named by content
hash) and are decoded once into a small LRU; embeddings come from the
configured embedding transport. Either way the engine gets them in the order of
the prompt's image placeholders.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from shared.protocol import GenerateJob
from shared.queue.media_store import DecodedImages, EmbeddingStore, ImageStore, embedding_store
from shared.settings import ImageSettings
from workers.engines.base import PromptImages
from workers.engines.vision.encoder import ImageEmbedding

DECODED_CACHE_BYTES = 256 * 1024 * 1024


class PromptImageLoader:
    def __init__(self, images: ImageStore, embeddings: EmbeddingStore) -> None:
        self._embeddings = embeddings
        self._decoded = DecodedImages(images, DECODED_CACHE_BYTES)

    @classmethod
    def connect(cls, settings: ImageSettings, redis: aioredis.Redis) -> PromptImageLoader:
        """Images from the gateway's store, embeddings from the configured transport."""
        return cls(ImageStore(redis), embedding_store(settings.embedding_transport, redis))

    async def load(self, job: GenerateJob) -> PromptImages | None:
        if not job.images:
            return None
        if job.images_encoded:
            blobs = await asyncio.gather(
                *(self._embeddings.get(job.model, ref.digest) for ref in job.images)
            )
            return PromptImages(embeddings=tuple(ImageEmbedding.from_bytes(b) for b in blobs))
        decoded = await asyncio.gather(*(self._decoded.get(ref.digest) for ref in job.images))
        return PromptImages(raw=tuple(decoded))
