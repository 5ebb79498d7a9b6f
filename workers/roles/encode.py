"""The encode role: turn a job's images into embeddings, then pass the job on.

Each distinct image (named by content hash) goes through the engine's
:class:`~workers.engines.base.ImageEncoder` (cache, else the vision encoder) into
the embedding transport; then the job, marked ``images_encoded``, is queued for
its language stage (aggregated or prefill) and acked here in one fenced step.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis.asyncio as aioredis

from shared.errors import ConveyorError, EngineDead
from shared.protocol import GenerateJob, started_now
from shared.queue import names
from shared.roles import Role
from shared.settings import Settings
from workers.engines.base import EncodeEngine, ImageEncoder
from workers.engines.vision.engine import VisionEngine
from workers.journal.run_journal import RunJournal, RunLease
from workers.roles.base import LoadedRole, Probe, RoleParts
from workers.roles.generate import generate_job

log = logging.getLogger(__name__)

EMBEDDING_MARGIN_S = 120
"""Embeddings outlive their job's deadline by this much (migration re-reads them)."""


class EncodeRun:
    def __init__(self, lease: RunLease, encoding: ImageEncoder, journal: RunJournal) -> None:
        self.lease = lease
        self.job: GenerateJob = generate_job(lease)
        self._encoding = encoding
        self._journal = journal

    def next_stream(self) -> str:
        return names.job_stream(self.job.model, self.job.after_encode or Role.AGGREGATED)

    async def run(self) -> None:
        job = self.job
        started = time.monotonic()
        begun_unix = time.time()
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
        forwarded = started_now(
            msgspec.structs.replace(job, images_encoded=True, after_encode=None), begun_unix
        )
        if await self._journal.forward(self.lease, self.next_stream(), forwarded, ack=True):
            log.info(
                "job %s: %d image(s) encoded in %.3fs, handed to %s",
                job.job_id,
                len(job.images),
                time.monotonic() - started,
                job.after_encode,
            )

    def fail(self, error: ConveyorError) -> None:
        self._journal.fail(self.lease, error)


def probe(engine: EncodeEngine) -> Probe:
    """The canary: encode a tiny image (an encoder neither generates nor embeds text)."""

    async def ask(request_id: str) -> None:
        await engine.encoding.probe()

    return ask


def parts(engine: EncodeEngine) -> RoleParts:
    return RoleParts(
        engine=engine,
        new_run=lambda lease, journal: EncodeRun(lease, engine.encoding, journal),
        probe=probe(engine),
        cache_stats=lambda: engine.encoding.cache_stats(),
    )


def load(settings: Settings, model_path: str, served_name: str) -> LoadedRole:
    engine = VisionEngine.load(settings, model_path, served_name)

    def connect(redis: aioredis.Redis) -> RoleParts:
        engine.attach(redis)
        return parts(engine)

    return LoadedRole(engine, connect)
