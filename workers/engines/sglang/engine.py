"""SGLang engine: the only module that imports sglang (lazily, so importing this works without it).

Wraps the offline ``sglang.Engine`` -- the same object NVIDIA Dynamo's SGLang
workers drive -- through ``await Engine.async_generate(input_ids=..., stream=True,
rid=...)``, which returns an async iterator of dicts ``{"text", "output_ids",
"meta_info"}``. SGLang's scheduler subprocess does the continuous batching.

The rest of the SGLang boundary lives beside it: what the engine is launched with
(:mod:`~workers.engines.sglang.launch`), requests and streamed chunks
(:mod:`~workers.engines.sglang.translate`), the requests in flight and their aborts
(:mod:`~workers.engines.sglang.streams`), the P/D bootstrap handoff
(:mod:`~workers.engines.sglang.bootstrap`) and whether the engine's processes live
(:mod:`~workers.engines.sglang.liveness`). See docs/sglang.md for the SGLang and
Dynamo sources each behaviour comes from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from shared.errors import ConveyorError, EngineDead, EngineError, ModelNotFound
from shared.protocol import SamplingOptions
from shared.roles import Role
from shared.settings import WorkerSettings
from workers.engines.base import EngineInfo, Handoff, PromptImages, PromptTokenStats, StepOutput
from workers.engines.host_address import advertised_host
from workers.engines.sglang import bootstrap
from workers.engines.sglang.launch import SglangLaunchConfig, fit_server_args
from workers.engines.sglang.liveness import engine_alive
from workers.engines.sglang.streams import RequestStreams
from workers.engines.sglang.translate import (
    StreamDecoder,
    StreamFormat,
    generate_request,
    invalid_request,
    prefill_options,
    text_only,
    token_text_decoder,
)

log = logging.getLogger(__name__)


class SglangEngine:
    """A :class:`~workers.engines.base.PrefillEngine` (generate + prefill) over
    ``sglang.Engine``. It serves no embeddings: an embed worker must use vLLM."""

    info: EngineInfo

    def __init__(self, settings: WorkerSettings, model_path: str, served_name: str) -> None:
        config = SglangLaunchConfig.from_settings(settings)
        sglang = importlib.import_module("sglang")
        server_args_module = importlib.import_module("sglang.srt.server_args")
        fields = {field.name for field in dataclasses.fields(server_args_module.ServerArgs)}
        engine = sglang.Engine(
            **fit_server_args(config.engine_kwargs(model_path, served_name), fields)
        )
        context_len = getattr(engine.tokenizer_manager, "context_len", None)
        info = EngineInfo(
            model=served_name,
            max_model_len=int(context_len or settings.max_model_len or 0),
            handoff_before_prefill=True,
            can_decode_alone=config.role is not Role.DECODE,
        )
        self._attach(
            engine,
            info,
            role=config.role,
            bootstrap_host=advertised_host(config.bootstrap_host, bind_host=config.bind_host),
            bootstrap_port=_launched_bootstrap_port(engine, config.bootstrap_port),
            stream_format=StreamFormat.of(engine.server_args),
        )

    @classmethod
    def from_engine(
        cls,
        engine: Any,
        info: EngineInfo,
        *,
        role: Role = Role.AGGREGATED,
        bootstrap_host: str = "127.0.0.1",
        bootstrap_port: int | None = None,
        stream_format: StreamFormat | None = None,
    ) -> SglangEngine:
        """Wrap an existing ``sglang.Engine`` (or a test double with its API)."""
        self = cls.__new__(cls)
        if bootstrap_port is None:
            bootstrap_port = _launched_bootstrap_port(engine, bootstrap.DEFAULT_BOOTSTRAP_PORT)
        self._attach(
            engine,
            info,
            role=role,
            bootstrap_host=bootstrap_host,
            bootstrap_port=bootstrap_port,
            stream_format=stream_format or StreamFormat.of(getattr(engine, "server_args", None)),
        )
        return self

    def _attach(
        self,
        engine: Any,
        info: EngineInfo,
        *,
        role: Role,
        bootstrap_host: str,
        bootstrap_port: int,
        stream_format: StreamFormat,
    ) -> None:
        self.info = info
        self.prompt_stats = PromptTokenStats()  # SGLang's cache stats are not wired in yet
        self.role = role
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port
        self._engine = engine
        self._format = stream_format
        self._token_texts = token_text_decoder(engine)
        self._streams = RequestStreams(engine, self._translate)
        self._dead = False
        self._closed = False
        self._warned_fake_decode = False
        # TokenizerManager starts its output loop lazily on the first request and then
        # installs its own SIGTERM/SIGQUIT handlers on the event loop. Start it now, so the
        # worker's SIGTERM handler (installed after the engine is built) is the one that stays.
        start_loop = getattr(
            getattr(engine, "tokenizer_manager", None), "auto_create_handle_loop", None
        )
        if callable(start_loop):
            start_loop()

    # ----------------------------------------------------------- PrefillEngine protocol

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
        if adapter is not None:
            raise ModelNotFound(f"this engine serves no LoRA adapters (asked for {adapter!r})")
        text_only(images)
        fields = bootstrap.generate_fields(self.role, handoff, self.bootstrap_port)
        if self.role is Role.DECODE and handoff is None and not self._warned_fake_decode:
            self._warned_fake_decode = True
            log.warning(
                "decode engine ran a job without a handoff: SGLang fake KV transfer, output "
                "is only good as a liveness probe (every real job must come through prefill)"
            )
        # aclosing: an early aclose() of this generator must reach the stream's cleanup now
        async with contextlib.aclosing(
            self._stream(job_id, prompt_token_ids, sampling, fields)
        ) as steps:
            async for step in steps:
                yield step

    def plan_handoff(self, job_id: str) -> Handoff | None:
        """Prefill role: pick the bootstrap room before prefill, so decode can start first."""
        if self.role is not Role.PREFILL:
            return None
        return bootstrap.plan_handoff(self.bootstrap_host, self.bootstrap_port)

    async def prefill(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: PromptImages | None = None,
    ) -> Handoff:
        """Run the prompt into the handoff's bootstrap room; return when the KV is sent.

        ``max_new_tokens=1`` (SGLang's prefill scheduler forces it anyway). The token
        sampled here becomes the decode engine's first token, so everything else that
        shapes it (temperature, grammar, penalties, seed, min_new_tokens <= 1,
        logprobs) is the request's own.
        """
        if self.role is not Role.PREFILL:
            raise EngineError(f"prefill() on an SGLang engine in role {self.role.value!r}")
        text_only(images)
        planned = handoff
        if planned is None:
            planned = bootstrap.plan_handoff(self.bootstrap_host, self.bootstrap_port)
        fields = bootstrap.bootstrap_fields(planned)
        finish: str | None = None
        async with contextlib.aclosing(
            self._stream(job_id, prompt_token_ids, prefill_options(sampling), fields)
        ) as steps:
            async for step in steps:
                finish = step.finish_reason or finish
        if finish is None:
            raise EngineError(f"prefill of {job_id} ended without a result")
        if finish == "abort":
            raise EngineError(f"prefill of {job_id} was aborted")
        return dict(planned)

    async def abort(self, job_id: str) -> None:
        self._streams.abort(job_id)

    async def check_health(self) -> None:
        if self._dead or not engine_alive(self._engine):
            self._dead = True
            raise EngineDead("the SGLang engine died (a scheduler/detokenizer process is gone)")

    def running(self) -> int:
        states = getattr(getattr(self._engine, "tokenizer_manager", None), "rid_to_state", None)
        if isinstance(states, Mapping):
            return len(states)
        return len(self._streams)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.shutdown()
        except Exception:
            log.exception("SGLang engine shutdown failed")

    # ------------------------------------------------------------------ internals

    def _stream(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        fields: Mapping[str, Any],
    ) -> AsyncGenerator[StepOutput, None]:
        decoder = StreamDecoder(
            self._format, len(prompt_token_ids), sampling.logprobs, self._token_texts
        )
        request = generate_request(prompt_token_ids, sampling, fields)
        return self._streams.run(job_id, request, decoder)

    def _translate(self, exc: Exception) -> ConveyorError:
        if isinstance(exc, ValueError):  # TokenizerManager / SamplingParams validation
            return invalid_request(str(exc))
        if not engine_alive(self._engine):
            self._dead = True
            return EngineDead(f"the SGLang engine died: {type(exc).__name__}: {exc}")
        return EngineError(f"generation failed: {type(exc).__name__}: {exc}")


def _launched_bootstrap_port(engine: Any, default: int) -> int:
    """The bootstrap port in the engine's ``server_args`` (``default`` where they do not say)."""
    server_args = getattr(engine, "server_args", None)
    return int(getattr(server_args, "disaggregation_bootstrap_port", default))
