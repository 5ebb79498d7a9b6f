"""The aggregated and decode roles: run one job on the engine and journal its events.

A job that an earlier run already started (the worker died, was fenced out or
handed it back) continues from the tokens that run emitted: they are appended
to the prompt and taken off ``max_tokens``, and seq numbering carries on, so
the client sees every token exactly once (Dynamo's migration semantics).

Guided decoding (a JSON schema: forced tool calls, ``response_format``) cannot
continue that way: the grammar would start again after the appended tokens. A
deterministic guided job (temperature 0, or a seed) is *replayed* instead: the
original prompt runs again, the emitted tokens are regenerated, checked equal to
what the client already has and not sent again, and the stream goes on after them.
Intake refuses to migrate a guided job that is not deterministic.
Prompt logprobs travel on a run's first event, with its first tokens: a run that
continues after emitted tokens does not ask for them again (its prompt is longer); one
that starts over sends the same ones again, and the gateway keeps the last copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import msgspec
import redis.asyncio as aioredis

from shared.errors import (
    ConveyorError,
    DeadlineExceeded,
    EngineDead,
    InvalidRequest,
    MigrationRefused,
    ModelNotFound,
)
from shared.protocol import (
    FinishEvent,
    GenerateJob,
    SamplingOptions,
    TokenEvent,
    is_deterministic,
    is_guided,
)
from shared.settings import Settings
from workers.engines.base import (
    Administered,
    EngineLoras,
    GenerateEngine,
    Handoff,
    PromptImages,
    ServesLoras,
    StepOutput,
)
from workers.engines.language import load_language_engine
from workers.journal.run_journal import RunJournal, RunLease
from workers.roles.base import (
    NO_ADAPTERS,
    PROBE_PROMPT,
    PROBE_SAMPLING,
    LoadedRole,
    Probe,
    RoleParts,
)
from workers.roles.prompt_images import PromptImageLoader

log = logging.getLogger(__name__)


def generate_job(lease: RunLease) -> GenerateJob:
    job = lease.delivery.job
    if not isinstance(job, GenerateJob):
        raise TypeError(f"{job.job_id} is not a generation job")
    return job


async def load_images(loader: PromptImageLoader | None, job: GenerateJob) -> PromptImages | None:
    if not job.images:
        return None
    if loader is None:
        raise InvalidRequest("this worker cannot take images")
    return await loader.load(job)


def resume_point(job: GenerateJob, emitted: list[int]) -> tuple[list[int], SamplingOptions]:
    """Prompt and sampling that continue ``job`` after ``emitted`` tokens (a replayed job
    starts from its own prompt: see the module docstring)."""
    if not emitted or replays(job.sampling):
        return job.prompt_token_ids, job.sampling
    sampling = msgspec.structs.replace(
        job.sampling,
        prompt_logprobs=None,  # sent with the first tokens, which the client already has
        max_tokens=job.sampling.max_tokens - len(emitted),
        min_tokens=max(0, job.sampling.min_tokens - len(emitted)),
    )
    return job.prompt_token_ids + emitted, sampling


def replays(sampling: SamplingOptions) -> bool:
    """Guided decoding resumes by replaying its output; it can only when that is
    deterministic."""
    return is_guided(sampling) and is_deterministic(sampling)


class Replay:
    """The tokens a replayed run regenerates before it has anything new to send.

    An engine may put several tokens in one step (vLLM merges the outputs a busy consumer
    has not taken yet), so a step can straddle the end of what was sent. Its text is cut
    by characters: text is a function of the tokens, not of how steps group them, so the
    first ``emitted_chars`` characters the replay produces are the ones the client has.
    """

    def __init__(self, emitted: list[int], emitted_chars: int) -> None:
        self._left = list(emitted)
        self._chars_left = emitted_chars

    @property
    def done(self) -> bool:
        return not self._left

    def skip(self, step: StepOutput) -> StepOutput:
        """``step`` without the tokens (and text) the client already has; raises
        :class:`MigrationRefused` when they differ from what was sent."""
        head = step.token_ids[: len(self._left)]
        if head != self._left[: len(head)]:
            raise MigrationRefused(
                "its worker stopped mid-stream and the replayed output differed from what "
                "was already sent; retry the request"
            )
        del self._left[: len(head)]
        if step.finish_reason is not None and self._left:
            raise MigrationRefused(
                "its worker stopped mid-stream and the replayed output ended before what "
                "was already sent; retry the request"
            )
        sent_chars = min(len(step.text), self._chars_left)
        self._chars_left -= sent_chars
        logprobs = step.logprobs
        return dataclasses.replace(
            step,
            token_ids=step.token_ids[len(head) :],
            text=step.text[sent_chars:],
            logprobs=None if logprobs is None else logprobs[len(head) :] or None,
            prompt_logprobs=None,  # the client had them with the first tokens
        )


class SequenceRun:
    """Drives ``engine.generate`` for one leased job; numbers its events by ``seq``."""

    def __init__(
        self,
        lease: RunLease,
        engine: GenerateEngine,
        journal: RunJournal,
        images: PromptImageLoader | None = None,
        adapters: EngineLoras | None = None,
    ) -> None:
        self.lease = lease
        self.job: GenerateJob = generate_job(lease)
        self._engine = engine
        self._journal = journal
        self._images = images
        self._adapters = adapters
        self._completion_tokens = len(lease.emitted)
        replaying = replays(self.job.sampling)
        lease.counts_chars = replaying
        self._replay = Replay(lease.emitted if replaying else [], lease.emitted_chars)

    async def run(self) -> None:
        job = self.job
        started = time.monotonic()
        begun_unix = time.time()
        try:
            async with asyncio.timeout(max(0.0, job.deadline_unix - time.time())):
                finish_reason, prompt_tokens, cached_tokens = await self._generate()
        except EngineDead:
            raise  # the runtime hands the job back; another worker continues it
        except TimeoutError:
            self.fail(DeadlineExceeded("the request's deadline passed while generating"))
            return
        except ConveyorError as exc:
            log.warning("job %s failed: %s", job.job_id, exc)
            self.fail(exc)
            return
        if finish_reason == "abort":
            log.info("job %s aborted after %d tokens", job.job_id, self._completion_tokens)
            self._journal.finish(self.lease)
            return
        self._journal.finish(
            self.lease,
            FinishEvent(
                job.request_id,
                job.index,
                self.lease.take_seq(),
                self.lease.attempt,
                finish_reason,
                prompt_tokens,
                self._completion_tokens,
                cached_tokens,
                job.started_unix if job.started_unix is not None else begun_unix,
            ),
        )
        log.info(
            "job %s finished (%s) %d tokens in %.3fs (attempt %d)",
            job.job_id,
            finish_reason,
            self._completion_tokens,
            time.monotonic() - started,
            self.lease.attempt,
        )

    def fail(self, error: ConveyorError) -> None:
        """End the job with an error event the client sees, and ack it."""
        self._journal.fail(self.lease, error)

    async def _generate(self) -> tuple[str, int, int | None]:
        """Finish reason, prompt tokens and cached prompt tokens (None: not reported)."""
        job = self.job
        prompt, sampling = resume_point(job, self.lease.emitted)
        if sampling.max_tokens <= 0:
            return "length", len(job.prompt_token_ids), None
        # A fresh decode fetches the prefilled KV; a resumed one recomputes its prompt.
        handoff = job.handoff if not self.lease.emitted else None
        if handoff is not None and sampling.prompt_logprobs is not None:
            raise InvalidRequest(
                "prompt_logprobs (and echo with logprobs) are not available on a "
                "disaggregated path: the prompt ran on the prefill worker",
                param="prompt_logprobs",
            )
        images = await load_images(self._images, job)
        async with self._adapter_slot():
            return await self._stream(prompt, sampling, handoff, images)

    def _adapter_slot(self) -> contextlib.AbstractAsyncContextManager[None]:
        """An adapter's sequence holds one of the engine's adapter slots while it runs."""
        if self.job.adapter is None:
            return contextlib.nullcontext()
        if self._adapters is None:
            raise ModelNotFound(
                f"this worker serves no LoRA adapters (asked for {self.job.adapter!r})"
            )
        return self._adapters.running(self.job.adapter)

    async def _stream(
        self,
        prompt: list[int],
        sampling: SamplingOptions,
        handoff: Handoff | None,
        images: PromptImages | None,
    ) -> tuple[str, int, int | None]:
        job = self.job
        stream = self._engine.generate(
            job.job_id, prompt, sampling, handoff=handoff, images=images, adapter=job.adapter
        )
        async for output in stream:
            step = output if self._replay.done else self._replay.skip(output)
            if step.token_ids or step.text or step.prompt_logprobs:
                self._completion_tokens += len(step.token_ids)
                event = TokenEvent(
                    job.request_id,
                    job.index,
                    self.lease.take_seq(),
                    self.lease.attempt,
                    step.token_ids,
                    step.text,
                    step.logprobs,
                    step.prompt_logprobs,
                )
                self._journal.publish(self.lease, event, step.token_ids)
            if step.finish_reason is not None:
                prompt_tokens = self._prompt_tokens(step)
                cached = (
                    None if step.cached_tokens is None else min(step.cached_tokens, prompt_tokens)
                )
                return step.finish_reason, prompt_tokens, cached
        return "abort", len(job.prompt_token_ids), None

    def _prompt_tokens(self, step: StepOutput) -> int:
        """Usage counts the prompt the engine ran: with images, their expanded tokens too
        (less the emitted tokens a resumed run appended)."""
        return max(len(self.job.prompt_token_ids), step.prompt_tokens - len(self.lease.emitted))


def probe(engine: GenerateEngine) -> Probe:
    """The canary: one greedy token."""

    async def ask(request_id: str) -> None:
        async for _ in engine.generate(request_id, PROBE_PROMPT, PROBE_SAMPLING):
            pass

    return ask


def parts(engine: GenerateEngine, images: PromptImageLoader | None) -> RoleParts:
    adapters, adapters_off = None, NO_ADAPTERS
    if isinstance(engine, ServesLoras):
        adapters, adapters_off = engine.adapters, engine.adapters_off
    return RoleParts(
        engine=engine,
        new_run=lambda lease, journal: SequenceRun(lease, engine, journal, images, adapters),
        probe=probe(engine),
        adapters=adapters,
        adapters_off=adapters_off,
        admin=engine.admin if isinstance(engine, Administered) else None,
    )


def load(settings: Settings, model_path: str, served_name: str) -> LoadedRole:
    engine = load_language_engine(settings, model_path, served_name)

    def connect(redis: aioredis.Redis) -> RoleParts:
        return parts(engine, PromptImageLoader.connect(settings, redis))

    return LoadedRole(engine, connect)
