"""A language worker's view of a job's images: decoded images, or an encode worker's embeddings.

Raw images come from the gateway's :class:`ImageStore` (bytes named by content
hash) and are decoded once into a small LRU; embeddings come from the
configured embedding transport. Either way the engine gets them in the order of
the prompt's image placeholders.
"""

from __future__ import annotations

import asyncio

from shared.images import DecodedImageCache, decode_rgb
from shared.media_store import EmbeddingStore, ImageStore
from shared.protocol import GenerateJob, ImageRef
from workers.engines.base import PromptImages
from workers.vision_encoder import ImageEmbedding

DECODED_CACHE_BYTES = 256 * 1024 * 1024


class PromptImageLoader:
    def __init__(self, images: ImageStore, embeddings: EmbeddingStore) -> None:
        self._images = images
        self._embeddings = embeddings
        self._decoded = DecodedImageCache(DECODED_CACHE_BYTES)

    async def load(self, job: GenerateJob) -> PromptImages | None:
        if not job.images:
            return None
        if job.images_encoded:
            blobs = await asyncio.gather(
                *(self._embeddings.get(job.model, ref.digest) for ref in job.images)
            )
            return PromptImages(embeddings=tuple(ImageEmbedding.from_bytes(b) for b in blobs))
        return PromptImages(raw=tuple(await asyncio.gather(*map(self._decode, job.images))))

    async def _decode(self, ref: ImageRef) -> object:
        image = self._decoded.get(ref.digest)
        if image is None:
            image = await asyncio.to_thread(decode_rgb, await self._images.get(ref.digest))
            self._decoded.put(ref.digest, image)
        return image
