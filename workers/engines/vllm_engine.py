"""vLLM adapter: the only module that imports vllm.

Wraps ``AsyncLLM`` (continuous batching across every concurrent ``generate``)
and translates vLLM's exceptions into :mod:`shared.errors`, in one place
(:func:`vllm_errors`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec

from shared.cpu_cores import available_cores, cores_spec, engine_core_slices, parse_cores
from shared.errors import EngineDead, EngineError, InvalidRequest
from shared.protocol import SamplingOptions, TokenLogprob, TopLogprob
from shared.settings import Role, Settings
from workers.engines import vllm_lora
from workers.engines.base import (
    EngineInfo,
    Handoff,
    PromptImages,
    PromptTokenStats,
    StepOutput,
)
from workers.engines.vision_encoder import to_vllm_input, vision_family
from workers.engines.vllm_admin import VllmAdmin

log = logging.getLogger(__name__)


class VllmEngine:
    def __init__(self, settings: Settings, model_path: str, served_name: str) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(settings.kv_cache_gib))))
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kv_transfer = _kv_transfer_config(settings)
        _place_engine(settings)  # prefill/decode too: see _place_engine
        pooling = settings.role is Role.EMBED
        args = AsyncEngineArgs(
            model=model_path,
            runner="pooling" if pooling else "auto",
            served_model_name=served_name,
            dtype=settings.dtype,  # type: ignore[arg-type]
            max_model_len=settings.max_model_len,  # type: ignore[arg-type]
            enforce_eager=True,
            max_num_seqs=settings.worker_max_slots,
            enable_prefix_caching=not pooling,  # encoder-only models keep no KV cache
            kv_transfer_config=kv_transfer,
            structured_outputs_config=StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=not settings.json_any_whitespace
            ),
            # Per-step stats cost CPU beside the engine on every token; only prefill/decode
            # workers use them (prompt tokens computed vs transferred, NIXL transfer times).
            disable_log_stats=kv_transfer is None,
            **_vision_args(model_path, settings),
            **vllm_lora.engine_args(settings, model_path),
        )
        self.prompt_stats = PromptTokenStats()
        self._llm = AsyncLLM.from_engine_args(
            args,
            stat_loggers=None if kv_transfer is None else [_prompt_stats_logger(self.prompt_stats)],
        )
        if kv_transfer is not None and settings.pin_kv_engines:
            pin_process_tree(engine_cores(settings))
        config = self._llm.model_config
        self._vision_family = vision_family(model_path)
        self.info = EngineInfo(model=served_name, max_model_len=int(config.max_model_len))
        self.adapters, self.adapters_off = vllm_lora.attach(self._llm, settings, model_path)
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
        lora = vllm_lora.lora_request(self.adapters, adapter)
        with vllm_errors("generation"):
            stream = self._llm.generate(
                self._prompt(prompt_token_ids, images), params, job_id, lora_request=lora
            )
            async for output in stream:
                yield step_output(output, prompt_token_ids, sampling.logprobs)

    def _prompt(self, prompt_token_ids: list[int], images: PromptImages | None) -> Any:
        return tokens_prompt(prompt_token_ids, images, self._vision_family)

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
            stream = self._llm.generate(self._prompt(prompt_token_ids, images), params, job_id)
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

    def shutdown(self) -> None:
        self._llm.shutdown()


def _prompt_stats_logger(stats: PromptTokenStats) -> Any:
    """A vLLM stat logger that counts where prompt tokens came from."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PromptStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any
        ) -> None:
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt is not None and prompt.total:
                stats.computed += int(prompt.computed)
                stats.from_local_cache += int(prompt.local_cache_hit)
                stats.transferred += int(prompt.external_kv_transfer)
            transfers = getattr(scheduler_stats, "kv_connector_stats", None) or {}
            durations = transfers.get("transfer_duration") if isinstance(transfers, dict) else None
            if durations:
                stats.kv_transfers += len(durations)
                stats.kv_transfer_s += float(sum(durations))

        def log_engine_initialized(self) -> None:
            pass

    return PromptStatsLogger


def _vision_args(model_path: str, settings: Settings) -> dict[str, Any]:
    """Vision-language models also take image embeddings made by an encode worker."""
    if vision_family(model_path) is None:
        return {}
    return {
        "enable_mm_embeds": True,
        "limit_mm_per_prompt": {"image": settings.max_images_per_request},
    }


def _kv_transfer_config(settings: Settings) -> Any:
    """Prefill and decode engines share KV through a connector (NIXL over UCX on CPU)."""
    if settings.role not in (Role.PREFILL, Role.DECODE):
        return None
    from vllm.config import KVTransferConfig

    _set_nixl_environment(settings)
    producer = settings.role is Role.PREFILL
    return KVTransferConfig(
        kv_connector=settings.kv_connector,
        kv_connector_module_path=_nixl_module_path(settings),
        kv_role="kv_producer" if producer else "kv_consumer",
        kv_buffer_device="cpu",
        kv_connector_extra_config={"backends": ["UCX"]},
        # decode recomputes the prompt when the prefill that holds its KV is gone
        kv_load_failure_policy="fail" if producer else "recompute",
    )


def _nixl_module_path(settings: Settings) -> str | None:
    """On CPU, vLLM's own NIXL connectors come from :mod:`workers.engines.nixl_connector`:
    the same classes, but NIXL's UCX progress thread (which busy-polls a whole core per
    engine, idle or not) is off and the engine step drives UCX progress instead."""
    from vllm.platforms import current_platform

    names = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
    if current_platform.is_cpu() and settings.kv_connector in names:
        return "workers.engines.nixl_connector"
    return None


def _set_nixl_environment(settings: Settings) -> None:
    port = settings.kv_side_channel_port or _free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores_spec(engine_cores(settings))


def engine_cores(settings: Settings) -> list[int]:
    """The cores an engine's model threads keep to.

    Prefill takes the lower half, decode the upper: NIXL moves the model thread onto
    the last core (and its UCX progress thread spun then, see nixl_connector); measured
    here, an unpinned pair made each engine step ~100x slower and the first decode wait
    ~30 s for the prefill's KV lease to expire. Any other engine takes every core but
    the first, which stays free for the event loops beside it (this worker's, the
    gateway's, Redis): a model thread that shares its core with them waits for them
    every step.
    """
    if settings.cpu_omp_threads_bind:
        return parse_cores(settings.cpu_omp_threads_bind)
    cores = available_cores()
    if settings.role not in (Role.PREFILL, Role.DECODE):
        return engine_core_slices(cores, 1)[0]
    half = max(1, len(cores) // 2)
    chosen = cores[:half] if settings.role is Role.PREFILL else cores[half:] or cores[-1:]
    return chosen


def _place_engine(settings: Settings) -> None:
    """On CPU: the model runs on :func:`engine_cores`, inside vLLM's engine-core process
    unless ``cpu_engine_in_process`` is off.

    vLLM's CPU platform otherwise always adds a separate model-worker process beside the
    engine core, and every step crosses between the two; that process also busy-polls
    its queue for 1 s after each step (vLLM's shm broadcast), so an idle prefill/decode
    pair burned ~0.2 cores on its 10-s canaries alone. In-process, vLLM does not bind
    OpenMP threads itself, so the standard OpenMP variables do it (the engine core is
    spawned after this, and reads them when it starts).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cores = engine_cores(settings)
    if not settings.cpu_engine_in_process:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores_spec(cores)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    os.environ["OMP_PLACES"] = ",".join(f"{{{core}}}" for core in cores)
    os.environ["OMP_PROC_BIND"] = "close"


def pin_process_tree(cores: list[int]) -> None:
    """Pin every thread of this process and its children (the engine core) to ``cores``."""
    import psutil

    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            for thread in process.threads():
                os.sched_setaffinity(thread.id, set(cores))
        except (psutil.Error, OSError) as exc:
            log.warning("could not pin %s to cores %s: %s", process.pid, cores, exc)


def _free_port() -> int:
    """A free port for NIXL's side channel, from below the kernel's ephemeral range.

    The engine binds it seconds later; a port from the ephemeral range could meanwhile
    become the local end of some outgoing connection (seen here: the replacement of a
    killed prefill worker hung at start-up on "Address already in use")."""
    low = _ephemeral_low()
    candidates = list(range(max(10_000, low - 12_000), low))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # nothing free below the range: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@contextlib.contextmanager
def vllm_errors(what: str, *, param: str | None = None, invalid_prefix: str = "") -> Iterator[None]:
    """The one mapping from vLLM's exceptions to Conveyor's.

    vLLM splits its own errors by cause: ``EngineDeadError`` (the engine core is gone:
    ``EngineDead``, the worker hands its jobs back and exits), ``VLLMClientError`` (the
    request is at fault, e.g. ``VLLMValidationError``: ``InvalidRequest``, a 400 naming
    ``param``) and the rest, ``VLLMServerError`` (e.g. ``EngineGenerateError``) and the
    admission refusals (``GracefulHTTPError``): ``EngineError``, a 500 for this request
    only. Anything that is not vLLM's, a bare ``ValueError`` included, is a bug rather
    than the client's fault: it propagates, and the runtime answers 500.
    ``what`` names the operation in a 500's message; ``invalid_prefix`` starts a 400's.
    """
    from vllm.exceptions import VLLMClientError, VLLMError
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as exc:
        raise EngineDead(f"the vLLM engine died: {exc}") from exc
    except VLLMClientError as exc:
        raise InvalidRequest(f"{invalid_prefix}{exc}", param=param) from exc
    except VLLMError as exc:
        raise EngineError(f"{what} failed: {exc}") from exc


# ------------------------------------------------- request and output translation
# Pure functions (vLLM's classes in, ours out, or the reverse), tested directly in
# tests/unit/test_vllm_engine.py.


def sampling_params(options: SamplingOptions, *, kv_transfer_params: Handoff | None = None) -> Any:
    """vLLM's SamplingParams for one sequence (DELTA outputs), with the KV connector's
    ``kv_transfer_params`` when given; values vLLM refuses are the request's fault (a
    400), not a crash."""
    with vllm_errors("sampling", invalid_prefix="invalid sampling parameters: "):
        params = _build_sampling_params(options)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    return params


def tokens_prompt(
    prompt_token_ids: list[int], images: PromptImages | None, family: str | None
) -> Any:
    """vLLM's TokensPrompt: token ids holding each image's single, unexpanded placeholder,
    plus the images (raw, or an encode worker's embeddings in the model ``family``'s
    shape): vLLM expands the placeholders itself (expanded ids would be expanded again)."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
    if images is None:
        return prompt
    if family is None:
        raise InvalidRequest("this model does not take images")
    data: Any = list(images.raw)
    if images.embeddings:
        data = to_vllm_input(list(images.embeddings), family)
    prompt["multi_modal_data"] = {"image": data}
    return prompt


def step_output(output: Any, prompt_token_ids: list[int], logprobs: int | None) -> StepOutput:
    """One DELTA ``RequestOutput`` of a one-sequence request as a StepOutput; ``logprobs``
    is the request's top-k (None: no logprobs wanted)."""
    completion = output.outputs[0]
    return StepOutput(
        token_ids=list(completion.token_ids),
        text=completion.text,
        logprobs=_logprobs(completion.logprobs, completion.token_ids, logprobs),
        finish_reason=completion.finish_reason,
        prompt_tokens=len(output.prompt_token_ids or prompt_token_ids),
    )


def _build_sampling_params(options: SamplingOptions) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if options.json_schema is not None:
        structured = StructuredOutputsParams(json=json.loads(options.json_schema))
    elif options.json_object:
        structured = StructuredOutputsParams(json_object=True)
    return SamplingParams(
        n=1,
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        seed=options.seed,
        stop=list(options.stop) or None,
        stop_token_ids=list(options.stop_token_ids) or None,
        ignore_eos=options.ignore_eos,
        min_tokens=options.min_tokens,
        logprobs=options.logprobs,
        skip_special_tokens=options.skip_special_tokens,
        logit_bias=options.logit_bias,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
    )


def _finite(logprob: float) -> float:
    """-inf (a token the sampler ruled out) is not JSON: clamp it as vLLM's server does."""
    return max(float(logprob), -9999.0)


def _logprobs(raw: Any, token_ids: Any, k: int | None) -> list[TokenLogprob] | None:
    if raw is None or k is None:
        return None
    result: list[TokenLogprob] = []
    for token_id, alternatives in zip(token_ids, raw, strict=False):
        sampled = alternatives[token_id]
        top = sorted(
            (
                (lp.rank, TopLogprob(tid, lp.decoded_token or "", _finite(lp.logprob)))
                for tid, lp in alternatives.items()
                if lp.rank is not None and lp.rank <= k
            ),
            key=lambda pair: pair[0],
        )
        result.append(
            TokenLogprob(
                token_id=int(token_id),
                token=sampled.decoded_token or "",
                logprob=_finite(sampled.logprob),
                top=[item for _, item in top],
            )
        )
    return result
