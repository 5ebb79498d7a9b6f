"""vLLM engine: the only module that imports vllm.

Wraps ``AsyncLLM`` (continuous batching across every concurrent ``generate``)
and translates vLLM's exceptions into :mod:`shared.errors`, in one place
(:func:`~workers.engines.vllm.translate.vllm_errors`); where its engine runs is
:mod:`workers.engines.vllm.placement`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from shared.engine_stats import StatsRecorder
from shared.errors import EngineError
from shared.protocol import SamplingOptions
from shared.settings import Role, Settings
from workers.engines.base import (
    EngineInfo,
    Handoff,
    KvEventFeed,
    PromptImages,
    PromptTokenStats,
    StepOutput,
)
from workers.engines.vision.encoder import vision_family
from workers.engines.vllm import lora
from workers.engines.vllm.admin import VllmAdmin
from workers.engines.vllm.engine_args import operator_engine_args, with_defaults
from workers.engines.vllm.kv_events import kv_events_config, private_endpoint, subscribe
from workers.engines.vllm.placement import (
    engine_cores,
    kv_transfer_config,
    pin_process_tree,
    place_engine,
)
from workers.engines.vllm.stat_logger import prompt_stats_logger, stats_logger
from workers.engines.vllm.translate import sampling_params, step_output, tokens_prompt, vllm_errors

log = logging.getLogger(__name__)

ENGINE_TEARDOWN_S = 1.0
"""How long vLLM's engine core process gets to tear down before vLLM kills it. Its
teardown is three full garbage collections of a large heap (5-10 s on a small CPU box),
and it only frees memory that the process's exit frees anyway."""


class VllmEngine:
    def __init__(self, settings: Settings, model_path: str, served_name: str) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(settings.kv_cache_gib))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        operator = operator_engine_args(settings.engine_arg_values())  # first: fails fast
        if operator:
            log.info("vLLM engine arguments from the operator: %s", sorted(operator))
        kv_transfer = kv_transfer_config(settings)
        place_engine(settings)  # prefill/decode too: see place_engine
        self._kv_events = private_endpoint() if settings.publishes_kv_events() else None
        args = AsyncEngineArgs(
            **with_defaults(_default_args(settings, model_path, served_name), operator),
            kv_transfer_config=kv_transfer,
            kv_events_config=None if self._kv_events is None else kv_events_config(self._kv_events),
            # vLLM's default loggers stay off but for prefill/decode workers; the custom
            # stat loggers below turn its per-step stats on (unless engine_stats is off).
            disable_log_stats=kv_transfer is None,
        )
        self.prompt_stats = PromptTokenStats()
        self.engine_stats = StatsRecorder(enabled=settings.engine_stats)
        loggers = [stats_logger(self.engine_stats)] if settings.engine_stats else []
        if kv_transfer is not None:
            loggers.append(prompt_stats_logger(self.prompt_stats))
        _start_quiet_resource_tracker()
        # A custom stat logger turns vLLM's per-step stats on (not its default loggers):
        # the fleet metrics need running/waiting/KV usage from every engine.
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers or None)
        if kv_transfer is not None and settings.pin_kv_engines:
            pin_process_tree(engine_cores(settings))
        config = self._llm.model_config
        self._block_size = int(self._llm.vllm_config.cache_config.block_size)
        self._vision_family = vision_family(model_path)
        self.info = EngineInfo(model=served_name, max_model_len=int(config.max_model_len))
        self.adapters, self.adapters_off = lora.attach(self._llm, settings, model_path)
        self.admin = VllmAdmin(self._llm)

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        params = sampling_params(sampling, kv_transfer_params=handoff)
        lora_request = lora.lora_request(self.adapters, adapter)
        with vllm_errors("generation"):
            stream = self._llm.generate(
                self._prompt(prompt_token_ids, images, sampling.cache_salt),
                params,
                job_id,
                lora_request=lora_request,
            )
            async for output in stream:
                yield step_output(output, prompt_token_ids, sampling.logprobs)

    def _prompt(
        self, prompt_token_ids: list[int], images: PromptImages | None, salt: str | None = None
    ) -> Any:
        return tokens_prompt(prompt_token_ids, images, self._vision_family, salt)

    def plan_handoff(self, job_id: str) -> Handoff | None:
        return None  # vLLM's kv_transfer_params exist only once prefill has run

    async def prefill(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> Handoff:
        """Run the prompt with max_tokens=1 and keep its KV for a remote decode."""
        params = sampling_params(
            msgspec.structs.replace(sampling, max_tokens=1, min_tokens=0),
            kv_transfer_params={"do_remote_decode": True},
        )
        result: Handoff | None = None
        with vllm_errors("prefill"):
            stream = self._llm.generate(
                self._prompt(prompt_token_ids, images, sampling.cache_salt), params, job_id
            )
            async for output in stream:
                if output.kv_transfer_params is not None:
                    result = dict(output.kv_transfer_params)
        if result is None:
            raise EngineError("prefill returned no kv_transfer_params (is a KV connector set?)")
        return result

    async def embed(
        self, job_id: str, prompt_token_ids: list[int], *, dimensions: int | None = None
    ) -> list[float]:
        """The pooling runner's embedding (the model's own pooler: MiniLM means, normalizes)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        vector: list[float] | None = None
        with vllm_errors("embedding", param="dimensions"):
            params = PoolingParams(task="embed", dimensions=dimensions)
            stream = self._llm.encode(
                TokensPrompt(prompt_token_ids=prompt_token_ids), params, job_id
            )
            async for output in stream:
                if output.finished:
                    vector = [float(x) for x in output.outputs.data.tolist()]
        if vector is None:
            raise EngineError("the engine returned no embedding")
        return vector

    async def abort(self, job_id: str) -> None:
        await self._llm.abort(job_id)

    async def check_health(self) -> None:
        with vllm_errors("health check"):
            await self._llm.check_health()

    def running(self) -> int:
        return int(self._llm.get_num_unfinished_requests())

    def kv_event_feed(self) -> KvEventFeed | None:
        endpoint = self._kv_events
        if endpoint is None:
            return None
        return KvEventFeed(self._block_size, lambda: subscribe(endpoint))

    def shutdown(self) -> None:
        """Called once the worker has drained: nothing runs in the engine any more."""
        self._llm.shutdown(timeout=ENGINE_TEARDOWN_S)


def _start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker before vLLM does (for its engine core),
    without its "leaked semaphore objects" warning: the engine core, killed after
    ENGINE_TEARDOWN_S, leaves one, which the tracker then releases as it should."""
    from multiprocessing import resource_tracker

    previous = os.environ.get("PYTHONWARNINGS")
    quiet = "ignore:resource_tracker:UserWarning"
    os.environ["PYTHONWARNINGS"] = f"{previous},{quiet}" if previous else quiet
    try:
        resource_tracker.ensure_running()
    finally:
        if previous is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = previous


def _default_args(settings: Settings, model_path: str, served_name: str) -> dict[str, Any]:
    """Conveyor's AsyncEngineArgs; the operator's engine arguments replace any of them."""
    from vllm.config import StructuredOutputsConfig

    pooling = settings.role is Role.EMBED
    return {
        "model": model_path,
        "runner": "pooling" if pooling else "auto",
        "served_model_name": served_name,
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "enforce_eager": True,
        "max_num_seqs": settings.worker_max_slots,
        "enable_prefix_caching": not pooling,  # encoder-only models keep no KV cache
        "structured_outputs_config": StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=not settings.json_any_whitespace
        ),
        "use_tqdm_on_load": False,  # a progress bar on stderr, past the logging rule
        **_vision_args(model_path, settings),
        **lora.engine_args(settings, model_path),
    }


def _vision_args(model_path: str, settings: Settings) -> dict[str, Any]:
    """Vision-language models also take image embeddings made by an encode worker."""
    if vision_family(model_path) is None:
        return {}
    return {
        "enable_mm_embeds": True,
        "limit_mm_per_prompt": {"image": settings.max_images_per_request},
    }
