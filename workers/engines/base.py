"""The interfaces inference engines implement, one per capability.

Every engine is an :class:`EngineBase` (identity, health, load). What else it
offers is a capability of its own: :class:`GenerateEngine` (stream a sequence's
tokens), :class:`PrefillEngine` (compute a prompt's KV cache for a remote
decode), :class:`EmbedEngine` (pooling) and :class:`EncodeEngine` (a vision
encoder). A worker role asks for the capability it needs (see
:mod:`workers.roles.table`), so no engine stubs a method just to raise.

Engines translate foreign exceptions at this boundary into
:mod:`shared.errors` (``EngineDead`` when the engine cannot serve any more,
``EngineError`` / ``InvalidRequest`` when one request failed).

Disaggregated serving adds a *handoff*: a JSON-safe dict that tells a decode
engine where the prompt's KV cache is. vLLM produces it by prefilling
(``kv_transfer_params``); SGLang decides it before prefill starts (bootstrap
host, port and room), so its decode side can start at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shared.engine_stats import StatsRecorder
from shared.protocol import ImageRef, PromptLogprobs, SamplingOptions, TokenLogprob
from shared.queue.kv_events import KvEvent

Handoff = dict[str, Any]
"""Engine-specific, JSON-safe data a decode engine needs to fetch a prefilled KV cache."""


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images, in placeholder order: decoded RGB images (the language engine
    runs the vision encoder itself) or embeddings an encode worker made."""

    raw: tuple[Any, ...] = ()
    """PIL images."""
    embeddings: tuple[Any, ...] = ()
    """:class:`workers.engines.vision.encoder.ImageEmbedding` values."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one engine step produced for one sequence (deltas, not cumulative)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens the engine served from its prefix cache (None: not reported)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's logprobs (asked for with ``prompt_logprobs``), on the first step."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    max_model_len: int
    handoff_before_prefill: bool = False
    """True when the handoff is known before prefill runs (SGLang's bootstrap room):
    the decode job is then queued first and both stages run at once."""
    can_decode_alone: bool = True
    """Whether a decode-role engine can also serve a prompt with no handoff."""


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


class EngineBase(Protocol):
    """What every engine offers, whatever it computes."""

    info: EngineInfo
    prompt_stats: PromptTokenStats

    async def check_health(self) -> None:
        """Raise ``EngineDead`` when the engine can no longer serve."""
        ...

    def running(self) -> int:
        """Sequences the engine holds right now (for leak checks and load)."""
        ...

    def shutdown(self) -> None: ...


class GenerateEngine(EngineBase, Protocol):
    """Streams tokens: the aggregated and decode roles (and every language canary)."""

    def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Stream the sequence's outputs; the last one has a ``finish_reason``.

        With ``handoff`` (decode role) the prompt's KV cache is fetched from the
        prefill engine instead of computed. With ``adapter`` the sequence runs with that
        loaded LoRA adapter (:class:`EngineLoras`; not loaded: ``ModelNotFound``). A
        sequence aborted with :meth:`abort` (or whose consuming task is cancelled) ends
        with ``finish_reason="abort"``.
        """
        ...

    async def abort(self, job_id: str) -> None: ...


class PrefillEngine(GenerateEngine, Protocol):
    """Computes a prompt's KV cache for a decode engine elsewhere: the prefill role."""

    def plan_handoff(self, job_id: str) -> Handoff | None:
        """The handoff, if the engine decides it before prefilling (else None)."""
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
        """Compute the prompt's KV cache and return the handoff for decode."""
        ...


class EmbedEngine(EngineBase, Protocol):
    """A pooling model: the embed role."""

    async def embed(
        self, job_id: str, prompt_token_ids: list[int], *, dimensions: int | None = None
    ) -> list[float]:
        """The pooled (and, per the model's pooler, normalized) embedding."""
        ...


class ImageEncoder(Protocol):
    """Content hash -> embedding in the embedding transport (see vision_engine.py)."""

    async def publish(self, model: str, ref: ImageRef, ttl_s: int) -> None: ...

    async def probe(self) -> None:
        """Encode a tiny image, bypassing every cache (the canary)."""
        ...

    def cache_stats(self) -> dict[str, int]: ...


class EncodeEngine(EngineBase, Protocol):
    """A vision encoder: the encode role."""

    @property
    def encoding(self) -> ImageEncoder: ...


# ---------------------------------------------------------------- LoRA adapters, admin


class LoraLoadError(Exception):
    """An adapter could not be loaded; the message is the reason the worker reports.
    The engine is unharmed (a load that would harm it is refused before it is tried)."""


class NotSupported(Exception):
    """The engine cannot do this at all; the message says why (an admin route's 501)."""


class EngineLoras(Protocol):
    """LoRA adapters in an engine: load by name, run sequences with them, unload.

    Only a loaded adapter's name may reach :meth:`GenerateEngine.generate`: a path is
    checked and loaded by :meth:`load`, never first seen by a request.
    """

    @property
    def max_active(self) -> int:
        """Distinct adapters that may have sequences in the engine at once."""
        ...

    def loaded(self) -> list[str]: ...

    async def load(self, name: str, path: str) -> None:
        """Check and load the PEFT adapter at ``path`` as ``name``; raises
        :class:`LoraLoadError` with the reason. Loading a loaded name again reloads it."""
        ...

    async def unload(self, name: str) -> None:
        """Refuse new sequences of ``name``, wait for its running ones, then unload it."""
        ...

    def running(self, name: str | None) -> AbstractAsyncContextManager[None]:
        """Hold while one sequence of adapter ``name`` (None: the base model) is in the
        engine: waits while :attr:`max_active` other adapters are running; raises
        ``ModelNotFound`` for an adapter that is not loaded (or is being unloaded)."""
        ...


class EngineAdmin(Protocol):
    """What an operator may ask of an engine (worker admin commands)."""

    async def clear_kv(self) -> bool:
        """Drop the prefix (KV) cache; False while the engine refuses (requests run)."""
        ...

    async def sleep(self) -> None:
        """Release the engine's memory; raises :class:`NotSupported` with the reason."""
        ...

    async def wake(self) -> None:
        """Undo :meth:`sleep`; raises :class:`NotSupported` with the reason."""
        ...


@runtime_checkable
class ServesLoras(Protocol):
    """An engine that may serve LoRA adapters (``adapters`` is None when it is off)."""

    @property
    def adapters(self) -> EngineLoras | None: ...

    @property
    def adapters_off(self) -> str:
        """Why ``adapters`` is None (what the worker reports for every adapter)."""
        ...


@runtime_checkable
class ReportsStats(Protocol):
    """An engine that keeps vLLM's scheduler figures (shared/engine_stats.py) for the
    heartbeat to publish."""

    @property
    def engine_stats(self) -> StatsRecorder: ...


@runtime_checkable
class Administered(Protocol):
    @property
    def admin(self) -> EngineAdmin: ...


@dataclass(frozen=True, slots=True)
class KvEventFeed:
    """An engine's KV cache events, as the worker forwards them to Redis."""

    block_size: int
    """Tokens per KV block."""
    batches: Callable[[], AsyncIterator[list[KvEvent]]]
    """The events of each engine step from now on (one list per step with events)."""


@runtime_checkable
class PublishesKvEvents(Protocol):
    """An engine that can report its KV cache events (cache-aware placement)."""

    def kv_event_feed(self) -> KvEventFeed | None:
        """Its events, or None when they are off."""
        ...
