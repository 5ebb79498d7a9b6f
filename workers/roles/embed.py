"""The embed role: one input in, one embedding out (``/v1/embeddings``).

The vector travels as float32 bytes in one :class:`EmbeddingEvent`, the job's
final event, written and acked in one fenced journal call. An embedding has no
partial output, so a job whose worker dies is simply run again elsewhere.
"""

from __future__ import annotations

import logging
import struct
import time

import redis.asyncio as aioredis

from shared.errors import ConveyorError, EngineDead
from shared.protocol import EmbeddingEvent, EmbedJob
from shared.settings import Settings
from workers.engines.base import EmbedEngine
from workers.engines.language import load_embedding_engine
from workers.journal.run_journal import RunJournal, RunLease
from workers.roles.base import PROBE_PROMPT, LoadedRole, Probe, RoleParts

log = logging.getLogger(__name__)


def pack_vector(vector: list[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


class EmbedRun:
    def __init__(self, lease: RunLease, engine: EmbedEngine, journal: RunJournal) -> None:
        job = lease.delivery.job
        if not isinstance(job, EmbedJob):
            raise TypeError(f"{job.job_id} is not an embedding job")
        self.lease = lease
        self.job: EmbedJob = job
        self._engine = engine
        self._journal = journal

    async def run(self) -> None:
        job = self.job
        started = time.monotonic()
        try:
            vector = await self._engine.embed(
                job.job_id, job.prompt_token_ids, dimensions=job.dimensions
            )
        except EngineDead:
            raise
        except ConveyorError as exc:
            log.warning("embedding %s failed: %s", job.job_id, exc)
            self.fail(exc)
            return
        event = EmbeddingEvent(
            job.request_id,
            job.index,
            self.lease.take_seq(),
            self.lease.attempt,
            pack_vector(vector),
            len(job.prompt_token_ids),
        )
        self._journal.finish(self.lease, event)
        log.info(
            "job %s embedded (%d tokens, %d dims) in %.3fs",
            job.job_id,
            len(job.prompt_token_ids),
            len(vector),
            time.monotonic() - started,
        )

    def fail(self, error: ConveyorError) -> None:
        self._journal.fail(self.lease, error)


def probe(engine: EmbedEngine) -> Probe:
    """The canary: embed one token (a pooling engine cannot generate)."""

    async def ask(request_id: str) -> None:
        await engine.embed(request_id, PROBE_PROMPT)

    return ask


def parts(engine: EmbedEngine) -> RoleParts:
    return RoleParts(
        engine=engine,
        new_run=lambda lease, journal: EmbedRun(lease, engine, journal),
        probe=probe(engine),
    )


def load(settings: Settings, model_path: str, served_name: str) -> LoadedRole:
    engine = load_embedding_engine(settings, model_path, served_name)

    def connect(redis: aioredis.Redis) -> RoleParts:
        return parts(engine)

    return LoadedRole(engine, connect)
