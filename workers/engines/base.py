"""The interface every inference engine adapter implements.

Adapters translate foreign exceptions at this boundary into
:mod:`shared.errors` (``EngineDead`` when the engine cannot serve any more,
``EngineError`` / ``InvalidRequest`` when one request failed).

Disaggregated serving adds a *handoff*: a JSON-safe dict that tells a decode
engine where the prompt's KV cache is. vLLM produces it by prefilling
(``kv_transfer_params``); SGLang decides it before prefill starts (bootstrap
host, port and room), so its decode side can start at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from shared.protocol import SamplingOptions, TokenLogprob

Handoff = dict[str, Any]
"""Engine-specific, JSON-safe data a decode engine needs to fetch a prefilled KV cache."""


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images, in placeholder order: decoded RGB images (the language engine
    runs the vision encoder itself) or embeddings an encode worker made."""

    raw: tuple[Any, ...] = ()
    """PIL images."""
    embeddings: tuple[Any, ...] = ()
    """:class:`workers.vision_encoder.ImageEmbedding` values."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one sequence (deltas, not cumulative)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    max_model_len: int
    handoff_before_prefill: bool = False
    can_decode_alone: bool = True
    """Whether a decode-role engine can also serve a prompt with no handoff."""
    """True when the handoff is known before prefill runs (SGLang's bootstrap room):
    the decode job is then queued first and both stages run at once."""


@dataclass(slots=True)
class PromptTokenStats:
    """Where the engine's prompt tokens came from, since it started."""

    computed: int = 0
    from_local_cache: int = 0
    transferred: int = 0
    """Received from another engine through a KV connector (disaggregated decode)."""
    kv_transfers: int = 0
    kv_transfer_s: float = 0.0
    """Time the KV connector spent in those transfers (NIXL's own telemetry)."""


class Engine(Protocol):
    info: EngineInfo
    prompt_stats: PromptTokenStats

    def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream the sequence's outputs; the last one has a ``finish_reason``.

        With ``handoff`` (decode role) the prompt's KV cache is fetched from the
        prefill engine instead of computed. A sequence aborted with :meth:`abort`
        (or whose consuming task is cancelled) ends with ``finish_reason="abort"``.
        """
        ...

    def plan_handoff(self, job_id: str) -> Handoff | None:
        """Prefill role: the handoff, if the engine decides it before prefilling."""
        ...

    async def prefill(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> Handoff:
        """Prefill role: compute the prompt's KV cache and return the handoff for decode."""
        ...

    async def embed(
        self, job_id: str, prompt_token_ids: list[int], *, dimensions: int | None = None
    ) -> list[float]:
        """Embed role: the pooled (and, per the model's pooler, normalized) embedding."""
        ...

    async def abort(self, job_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise ``EngineDead`` when the engine can no longer serve."""
        ...

    def running(self) -> int:
        """Sequences the engine holds right now (for leak checks and load)."""
        ...

    def shutdown(self) -> None: ...
