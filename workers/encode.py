"""The encode role: turn a job's images into embeddings, then pass the job on.

For each image (named by content hash): the embedding cache, else decode the
gateway-stored bytes and run the model's vision encoder (one image at a time, in
a thread; concurrent requests for the same image share one encoding). The
embedding goes to the embedding transport, and the job, marked
``images_encoded``, is queued for its language stage (aggregated or prefill)
and acked here in one fenced step.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from shared import keys
from shared.errors import ConveyorError, EngineDead
from shared.media_store import DecodedImages, EmbeddingStore, ImageStore
from shared.protocol import GenerateJob, ImageRef
from workers.embedding_cache import EmbeddingCache
from workers.journal import RunJournal, RunLease
from workers.sequence import generate_job
from workers.vision_encoder import VisionEncoder

log = logging.getLogger(__name__)

EMBEDDING_MARGIN_S = 120
"""Embeddings outlive their job's deadline by this much (migration re-reads them)."""


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
        self._decoded = DecodedImages(images, 64 * 1024 * 1024)
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


class EncodeRun:
    def __init__(self, lease: RunLease, encoding: ImageEncoding, journal: RunJournal) -> None:
        self.lease = lease
        self.job: GenerateJob = generate_job(lease)
        self._encoding = encoding
        self._journal = journal

    def next_stream(self) -> str:
        return keys.job_stream(self.job.model, self.job.after_encode or "aggregated")

    async def run(self) -> None:
        job = self.job
        started = time.monotonic()
        ttl_s = max(1, int(job.deadline_unix - time.time())) + EMBEDDING_MARGIN_S
        try:
            for ref in dict.fromkeys(job.images):  # an image sent twice is encoded once
                await self._encoding.publish(job.model, ref, ttl_s)
        except EngineDead:
            raise
        except ConveyorError as exc:
            log.warning("encoding the images of %s failed: %s", job.job_id, exc)
            self.fail(exc)
            return
        forwarded = msgspec.structs.replace(job, images_encoded=True, after_encode=None)
        if await self._journal.forward(self.lease, self.next_stream(), forwarded, ack=True):
            log.info("job %s: %d image(s) encoded in %.3fs, handed to %s", job.job_id,
                     len(job.images), time.monotonic() - started, job.after_encode)

    def fail(self, exc: ConveyorError) -> None:
        self._journal.fail(self.lease, exc)
