"""The encode role's engine: a vision encoder (transformers, CPU) behind the Engine interface.

It does not generate: the runtime gives its jobs to :class:`workers.encode.EncodeRun`,
which calls :attr:`encoding`. Health, load and the registry entry work as for
any engine, so an encode worker is supervised, drained and reclaimed like the rest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from shared.errors import EngineError
from shared.media_store import ImageStore, embedding_store
from shared.protocol import SamplingOptions
from shared.settings import Settings
from workers.embedding_cache import EmbeddingCache
from workers.encode import ImageEncoding
from workers.engines.base import EngineInfo, Handoff, PromptImages, PromptTokenStats, StepOutput
from workers.vision_encoder import VisionEncoder


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

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> AsyncIterator[StepOutput]:
        raise EngineError("an encode worker does not generate")
        yield  # pragma: no cover  (makes this an async generator)

    def plan_handoff(self, job_id: str) -> Handoff | None:
        return None

    async def prefill(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> Handoff:
        raise EngineError("an encode worker does not prefill")

    async def embed(
        self, job_id: str, prompt_token_ids: list[int], *, dimensions: int | None = None
    ) -> list[float]:
        raise EngineError("an encode worker does not embed text")

    async def abort(self, job_id: str) -> None:
        return None

    async def check_health(self) -> None:
        return None  # in-process: if the encoder is broken, the canary says so

    def running(self) -> int:
        return 0 if self._encoding is None else self._encoding.running()

    def shutdown(self) -> None:
        return None
