"""The prefill role: build the prompt's KV cache and hand the job on to a decode worker.

vLLM: prefill first (max_tokens=1, do_remote_decode), then queue the decode job
carrying the returned ``kv_transfer_params`` and ack this one, in one fenced
step. SGLang: the handoff (bootstrap room) is known up front, so the decode job
is queued first and starts at once, then prefill runs into that room.
The prefill's own sampled token is never shown to the client: decode produces
every token.
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
from workers.engines.base import PrefillEngine
from workers.engines.language import load_language_engine
from workers.journal.run_journal import RunJournal, RunLease
from workers.roles import generate
from workers.roles.base import LoadedRole, RoleParts
from workers.roles.generate import generate_job, load_images
from workers.roles.prompt_images import PromptImageLoader

log = logging.getLogger(__name__)


class PrefillRun:
    def __init__(
        self,
        lease: RunLease,
        engine: PrefillEngine,
        journal: RunJournal,
        images: PromptImageLoader | None = None,
    ) -> None:
        self.lease = lease
        self.job: GenerateJob = generate_job(lease)
        self._engine = engine
        self._journal = journal
        self._images = images

    def decode_stream(self) -> str:
        return names.job_stream(self.job.model, Role.DECODE)

    async def run(self) -> None:
        job = self.job
        started = time.monotonic()
        job = started_now(job, time.time())
        handoff = self._engine.plan_handoff(job.job_id)
        if handoff is not None:
            forwarded = msgspec.structs.replace(job, handoff=handoff)
            if not await self._journal.forward(
                self.lease, self.decode_stream(), forwarded, ack=False
            ):
                return
        try:
            images = await load_images(self._images, job)
            result = await self._engine.prefill(
                job.job_id, job.prompt_token_ids, job.sampling, handoff=handoff, images=images
            )
        except EngineDead:
            raise
        except ConveyorError as exc:
            log.warning("prefill of %s failed: %s", job.job_id, exc)
            self.fail(exc)
            return
        if handoff is None:
            forwarded = msgspec.structs.replace(job, handoff=result)
            await self._journal.forward(self.lease, self.decode_stream(), forwarded, ack=True)
        else:
            await self._journal.forward(self.lease, "", job, ack=True)
        log.info(
            "job %s prefilled (%d prompt tokens) in %.3fs, handed to decode",
            job.job_id,
            len(job.prompt_token_ids),
            time.monotonic() - started,
        )

    def fail(self, error: ConveyorError) -> None:
        self._journal.fail(self.lease, error)


def parts(engine: PrefillEngine, images: PromptImageLoader | None) -> RoleParts:
    return RoleParts(
        engine=engine,
        new_run=lambda lease, journal: PrefillRun(lease, engine, journal, images),
        probe=generate.probe(engine),  # a prefill engine still answers a 1-token request
    )


def load(settings: Settings, model_path: str, served_name: str) -> LoadedRole:
    engine = load_language_engine(settings, model_path, served_name)

    def connect(redis: aioredis.Redis) -> RoleParts:
        return parts(engine, PromptImageLoader.connect(settings, redis))

    return LoadedRole(engine, connect)
