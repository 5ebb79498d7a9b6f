"""SGLang engine: the only module that imports sglang (lazily, so importing this works without it).

Wraps the offline ``sglang.Engine`` -- the same object NVIDIA Dynamo's SGLang
workers drive -- through ``await Engine.async_generate(input_ids=..., stream=True,
rid=...)``, which returns an async iterator of dicts ``{"text", "output_ids",
"meta_info"}``. SGLang's scheduler subprocess does the continuous batching.

Streaming. Depending on the SGLang version and ``ServerArgs``
(``incremental_streaming_output``, formerly ``stream_output``), ``output_ids``,
``text`` and the output logprob lists in ``meta_info`` are either per-chunk deltas
or cumulative. The engine is launched with incremental output (as Dynamo does),
but :class:`_StreamDecoder` does not rely on it: new tokens are counted with
``meta_info["completion_tokens"]`` (always ``len(req.output_ids)``), logprobs are
the tail of their lists, and only the text needs to know the format
(:class:`StreamFormat`).

Disaggregation follows SGLang's bootstrap protocol. The prefill engine runs a
bootstrap server (``--disaggregation-bootstrap-port``); a request pair is joined
by a *bootstrap room*, a random 63-bit integer the caller picks. So the handoff
is known before prefill starts (``EngineInfo.handoff_before_prefill``): the
prefill worker plans ``{bootstrap_host, bootstrap_port, bootstrap_room}``, queues
the decode job with it, and runs the prompt into that room; the decode engine
registers with the prefill engine for the room and receives the KV cache plus
the first sampled token. Without a handoff, a prefill or decode engine runs
SGLang's *fake transfer* (``bootstrap_host=FAKE_BOOTSTRAP_HOST``, as Dynamo's
disaggregated health check does), which is only good as a liveness probe (the
worker canary).

Aborts go through ``engine.tokenizer_manager.abort_request(rid=...)``. SGLang's
scheduler aborts every request whose rid *starts with* the given rid, so rids
are ``"{job_id}#{random suffix}"`` (no rid is a prefix of another).

See docs/sglang.md for the SGLang and Dynamo sources each behaviour comes from.

Why one file of ~850 lines: it is one concept (the SGLang boundary: launch config,
request/response translation, the stream decoder, aborts, the bootstrap handoff),
and it has only been exercised against fakes recorded from SGLang's source
(tests/unit/test_sglang_engine.py, no GPU here); splitting it without a real
SGLang to test against risks more than the size costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import secrets
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any, Final, Literal

import msgspec

from shared.errors import (
    ContextLengthExceeded,
    ConveyorError,
    EngineDead,
    EngineError,
    InvalidRequest,
    ModelNotFound,
)
from shared.protocol import SamplingOptions, TokenLogprob, TopLogprob
from shared.settings import Settings
from workers.engines.base import (
    EngineInfo,
    Handoff,
    PromptImages,
    PromptTokenStats,
    StepOutput,
)

log = logging.getLogger(__name__)

DisaggregationMode = Literal["null", "prefill", "decode"]
"""SGLang's ``ServerArgs.disaggregation_mode`` values ("null" = aggregated)."""

FAKE_BOOTSTRAP_HOST: Final = "2.2.2.2"
"""``sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST``: a request carrying it uses the
fake KV transfer (no peer engine needed)."""

BOOTSTRAP_ROOM_BITS: Final = 63
"""Rooms are random 63-bit integers (SGLang's mini_lb and Dynamo both use
``random.randint(0, 2**63 - 1)``)."""

TOP_K_DISABLED: Final = -1
"""SGLang's ``top_k`` for "whole vocabulary" (Conveyor uses 0, like vLLM)."""

JSON_OBJECT_SCHEMA: Final = '{"type": "object"}'
"""What SGLang's own OpenAI layer sends as ``json_schema`` for ``response_format=json_object``."""

HANDOFF_KEYS: Final = ("bootstrap_host", "bootstrap_port", "bootstrap_room")

_IN_BAND_ERRORS: Final = (InvalidRequest, EngineError)
"""Raised by the decoder when SGLang ended a request with an error chunk."""

STREAM_DRAIN_TIMEOUT_S: Final = 30.0
"""How long an aborted request's stream may take to deliver SGLang's abort chunk."""

ABORT_RETRY_S: Final = 0.5
"""While an aborted stream has not ended, ``abort_request`` is repeated this often."""

_END: Final = object()


# ----------------------------------------------------------------------------- launch config


@dataclasses.dataclass(frozen=True, slots=True)
class SglangLaunchConfig:
    """Everything the SGLang engine is launched with.

    Read from :class:`Settings` where a field exists; the ``sglang_*`` fields are
    looked up with ``getattr`` so the defaults below apply until the lead adds
    them to ``shared/settings.py`` (see docs/sglang.md, "Settings").
    """

    disaggregation_mode: DisaggregationMode = "null"
    bootstrap_port: int = 8998
    """``--disaggregation-bootstrap-port`` of a prefill engine (SGLang's default)."""
    bootstrap_host: str | None = None
    """Address decode engines reach this prefill engine's bootstrap server at
    (default: this machine's outbound IP, like Dynamo's ``get_local_ip_auto``)."""
    bind_host: str = "0.0.0.0"
    """``ServerArgs.host``: the bootstrap server binds here (SGLang's default is 127.0.0.1,
    which other machines cannot reach)."""
    transfer_backend: str = "mooncake"
    """``--disaggregation-transfer-backend``: mooncake (SGLang's default) or nixl."""
    ib_device: str | None = None
    tp_size: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    dtype: str = "auto"
    max_running_requests: int | None = None
    disable_any_whitespace: bool = True
    log_level: str = "error"

    @classmethod
    def from_settings(cls, settings: Settings) -> SglangLaunchConfig:
        role = str(getattr(settings.role, "value", settings.role))
        mode: DisaggregationMode = (
            "prefill" if role == "prefill" else "decode" if role == "decode" else "null"
        )
        defaults = cls()
        return cls(
            disaggregation_mode=mode,
            bootstrap_port=int(
                _setting(settings, "sglang_bootstrap_port", defaults.bootstrap_port)
            ),
            bootstrap_host=_setting(settings, "sglang_bootstrap_host", None),
            transfer_backend=str(
                _setting(settings, "sglang_transfer_backend", defaults.transfer_backend)
            ),
            ib_device=_setting(settings, "sglang_ib_device", None),
            tp_size=int(_setting(settings, "sglang_tp_size", defaults.tp_size)),
            mem_fraction_static=_setting(settings, "sglang_mem_fraction_static", None),
            context_length=settings.max_model_len,
            dtype=settings.dtype,
            max_running_requests=settings.worker_max_slots,
            disable_any_whitespace=not settings.json_any_whitespace,
        )

    def engine_kwargs(self, model_path: str, served_name: str) -> dict[str, Any]:
        """Keyword arguments for ``sglang.Engine`` (= ``ServerArgs`` fields)."""
        kwargs: dict[str, Any] = {
            "model_path": model_path,
            "served_model_name": served_name,
            "dtype": self.dtype,
            "tp_size": self.tp_size,
            "host": self.bind_host,
            "log_level": self.log_level,
            "disaggregation_mode": self.disaggregation_mode,
            # Disjoint output chunks, as Dynamo sets (the decoder copes either way).
            "incremental_streaming_output": True,
            "constrained_json_disable_any_whitespace": self.disable_any_whitespace,
        }
        optional = {
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "mem_fraction_static": self.mem_fraction_static,
        }
        kwargs.update({key: value for key, value in optional.items() if value is not None})
        if self.disaggregation_mode != "null":
            kwargs["disaggregation_bootstrap_port"] = self.bootstrap_port
            kwargs["disaggregation_transfer_backend"] = self.transfer_backend
            if self.ib_device:
                kwargs["disaggregation_ib_device"] = self.ib_device
        return kwargs


def fit_server_args(kwargs: dict[str, Any], fields: Collection[str]) -> dict[str, Any]:
    """Adapt ``kwargs`` to the installed SGLang's ``ServerArgs`` field names.

    ``incremental_streaming_output`` was called ``stream_output`` in older releases;
    ``constrained_json_disable_any_whitespace`` is dropped where it does not exist.
    Anything else unknown is left in, so ``ServerArgs`` reports it.
    """
    fitted = dict(kwargs)
    if "incremental_streaming_output" not in fields and "stream_output" in fields:
        fitted["stream_output"] = fitted.pop("incremental_streaming_output")
    for optional in ("incremental_streaming_output", "constrained_json_disable_any_whitespace"):
        if optional in fitted and optional not in fields:
            log.warning("this SGLang has no ServerArgs.%s; not setting it", optional)
            del fitted[optional]
    return fitted


@dataclasses.dataclass(frozen=True, slots=True)
class StreamFormat:
    """Whether streamed ``output_ids`` / ``text`` are per-chunk deltas or cumulative.

    * ``incremental_streaming_output=True``: both are deltas (text since the rename).
    * older ``stream_output=True``: ``output_ids`` deltas, ``text`` cumulative.
    * neither: both cumulative.
    """

    incremental_ids: bool
    incremental_text: bool

    @classmethod
    def of(cls, server_args: Any) -> StreamFormat:
        if hasattr(server_args, "incremental_streaming_output"):
            incremental = bool(server_args.incremental_streaming_output)
            return cls(incremental_ids=incremental, incremental_text=incremental)
        return cls(
            incremental_ids=bool(getattr(server_args, "stream_output", False)),
            incremental_text=False,
        )


# ----------------------------------------------------------------------------- the adapter


class SglangEngine:
    """A :class:`~workers.engines.base.PrefillEngine` (generate + prefill) over
    ``sglang.Engine``. It serves no embeddings: an embed worker must use vLLM."""

    info: EngineInfo

    def __init__(self, settings: Settings, model_path: str, served_name: str) -> None:
        config = SglangLaunchConfig.from_settings(settings)
        sglang = importlib.import_module("sglang")
        server_args_module = importlib.import_module("sglang.srt.server_args")
        fields = {field.name for field in dataclasses.fields(server_args_module.ServerArgs)}
        engine = sglang.Engine(
            **fit_server_args(config.engine_kwargs(model_path, served_name), fields)
        )
        server_args = engine.server_args
        context_len = getattr(engine.tokenizer_manager, "context_len", None)
        info = EngineInfo(
            model=served_name,
            max_model_len=int(context_len or settings.max_model_len or 0),
            handoff_before_prefill=True,
            can_decode_alone=config.disaggregation_mode != "decode",
        )
        self._attach(
            engine,
            info,
            role=config.disaggregation_mode,
            bootstrap_host=config.bootstrap_host or _default_bootstrap_host(config.bind_host),
            bootstrap_port=int(
                getattr(server_args, "disaggregation_bootstrap_port", config.bootstrap_port)
            ),
            stream_format=StreamFormat.of(server_args),
        )

    @classmethod
    def from_engine(
        cls,
        engine: Any,
        info: EngineInfo,
        *,
        role: DisaggregationMode = "null",
        bootstrap_host: str = "127.0.0.1",
        bootstrap_port: int | None = None,
        stream_format: StreamFormat | None = None,
    ) -> SglangEngine:
        """Wrap an existing ``sglang.Engine`` (or a test double with its API)."""
        self = cls.__new__(cls)
        server_args = getattr(engine, "server_args", None)
        port = bootstrap_port
        if port is None:
            port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
        self._attach(
            engine,
            info,
            role=role,
            bootstrap_host=bootstrap_host,
            bootstrap_port=port,
            stream_format=stream_format or StreamFormat.of(server_args),
        )
        return self

    def _attach(
        self,
        engine: Any,
        info: EngineInfo,
        *,
        role: DisaggregationMode,
        bootstrap_host: str,
        bootstrap_port: int,
        stream_format: StreamFormat,
    ) -> None:
        self.info = info
        self.prompt_stats = PromptTokenStats()  # SGLang's cache stats are not wired in yet
        self.role: DisaggregationMode = role
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port
        self._engine = engine
        self._format = stream_format
        self._token_texts = _token_text_decoder(engine)
        self._rids: dict[str, str] = {}
        self._aborting: set[str] = set()
        self._dead = False
        self._closed = False
        self._warned_fake_decode = False
        self._background: set[asyncio.Task[None]] = set()
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
        _text_only(images)
        bootstrap = self._bootstrap_for_generate(handoff)
        params = sampling_params(sampling)
        # aclosing: an early aclose() of this generator must reach _stream's cleanup now
        async with contextlib.aclosing(
            self._stream(job_id, prompt_token_ids, sampling, params, bootstrap)
        ) as steps:
            async for step in steps:
                yield step

    def plan_handoff(self, job_id: str) -> Handoff | None:
        """Prefill role: pick the bootstrap room before prefill, so decode can start first."""
        if self.role != "prefill":
            return None
        return {
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": secrets.randbits(BOOTSTRAP_ROOM_BITS),
        }

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
        if self.role != "prefill":
            raise EngineError(f"prefill() on an SGLang engine in role {self.role!r}")
        _text_only(images)
        planned = handoff if handoff is not None else self.plan_handoff(job_id)
        assert planned is not None
        bootstrap = _bootstrap_fields(planned)
        options = prefill_options(sampling)
        finish: str | None = None
        async with contextlib.aclosing(
            self._stream(job_id, prompt_token_ids, options, sampling_params(options), bootstrap)
        ) as steps:
            async for step in steps:
                finish = step.finish_reason or finish
        if finish is None:
            raise EngineError(f"prefill of {job_id} ended without a result")
        if finish == "abort":
            raise EngineError(f"prefill of {job_id} was aborted")
        return dict(planned)

    async def abort(self, job_id: str) -> None:
        rid = self._rids.get(job_id)
        if rid is None:
            return
        self._aborting.add(job_id)
        self._abort_rid(rid)

    async def check_health(self) -> None:
        if self._dead or not self._engine_alive():
            self._dead = True
            raise EngineDead("the SGLang engine died (a scheduler/detokenizer process is gone)")

    def running(self) -> int:
        states = getattr(getattr(self._engine, "tokenizer_manager", None), "rid_to_state", None)
        if isinstance(states, Mapping):
            return len(states)
        return len(self._rids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.shutdown()
        except Exception:
            log.exception("SGLang engine shutdown failed")

    # ------------------------------------------------------------------ internals

    def _bootstrap_for_generate(self, handoff: Handoff | None) -> dict[str, Any]:
        if handoff is not None:
            if self.role != "decode":
                raise EngineError(f"an SGLang engine in role {self.role!r} got a KV handoff")
            return _bootstrap_fields(handoff)
        if self.role == "null":
            return {}
        if self.role == "decode" and not self._warned_fake_decode:
            self._warned_fake_decode = True
            log.warning(
                "decode engine ran a job without a handoff: SGLang fake KV transfer, output "
                "is only good as a liveness probe (every real job must come through prefill)"
            )
        # Dynamo's SglangDisaggHealthCheckPayload: fake transfer, room 0, own bootstrap port.
        return {
            "bootstrap_host": FAKE_BOOTSTRAP_HOST,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": 0,
        }

    async def _stream(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        params: dict[str, Any],
        bootstrap: Mapping[str, Any],
    ) -> AsyncGenerator[StepOutput, None]:
        """One request. SGLang's stream is read by a separate pump task.

        Cancelling the consumer must not cancel SGLang's ``generate_request``
        generator: on the way out it drops the rid from ``rid_to_state``
        (``_discard_pending_req_states``), after which ``abort_request`` ignores the
        rid and the request runs on in the scheduler. So the consumer's cancellation
        stops here; ``abort_request`` goes out while SGLang still holds the rid, and
        the pump drains the stream to SGLang's own abort chunk (Dynamo's handlers do
        the same: abort from a monitor task, let the stream end by itself).
        """
        rid = f"{job_id}#{uuid.uuid4().hex[:12]}"
        self._rids[job_id] = rid
        kwargs: dict[str, Any] = {
            "input_ids": list(prompt_token_ids),
            "sampling_params": params,
            "stream": True,
            "rid": rid,
            **bootstrap,
        }
        if sampling.logprobs is not None:
            kwargs["return_logprob"] = True
            kwargs["top_logprobs_num"] = sampling.logprobs
        decoder = _StreamDecoder(
            self._format, len(prompt_token_ids), sampling.logprobs, self._token_texts
        )
        chunks: asyncio.Queue[Any] = asyncio.Queue()
        pump = asyncio.create_task(self._pump(kwargs, chunks), name=f"sglang-stream-{rid}")
        finished = False
        try:
            while True:
                chunk = await chunks.get()
                if chunk is _END:
                    finished = True
                    log.warning("SGLang stream of %s ended without a finish reason", job_id)
                    return
                if isinstance(chunk, Exception):
                    finished = True  # the request never started or is gone
                    raise self._translate(chunk) from chunk
                step = decoder.step(chunk, abort_requested=job_id in self._aborting)
                if step is None:
                    continue
                finished = step.finish_reason is not None
                yield step
                if finished:
                    return
        except _IN_BAND_ERRORS:
            finished = True  # an error chunk: SGLang has already finished the request
            raise
        finally:
            if self._rids.get(job_id) == rid:
                del self._rids[job_id]
            self._aborting.discard(job_id)
            if not finished:  # cancelled or closed early
                self._abort_rid(rid)
            self._reap(pump, None if finished else rid)

    async def _pump(self, kwargs: dict[str, Any], chunks: asyncio.Queue[Any]) -> None:
        try:
            stream = await self._engine.async_generate(**kwargs)
            async for chunk in stream:
                chunks.put_nowait(chunk)
        except Exception as exc:
            chunks.put_nowait(exc)
            return
        chunks.put_nowait(_END)

    def _reap(self, pump: asyncio.Task[None], aborted_rid: str | None) -> None:
        """Let the pump finish in the background (bounded), without holding the consumer."""
        if pump.done():
            return
        reaper = asyncio.create_task(self._drain(pump, aborted_rid))
        self._background.add(reaper)
        reaper.add_done_callback(self._background.discard)

    async def _drain(self, pump: asyncio.Task[None], aborted_rid: str | None) -> None:
        """Wait for SGLang to end an aborted stream, repeating the abort meanwhile.

        ``abort_request`` is dropped while SGLang does not hold the rid yet (older
        releases register it only after tokenizing), so it is sent again until the
        stream ends. Past the deadline the stream is closed regardless.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STREAM_DRAIN_TIMEOUT_S
        while True:
            done, _ = await asyncio.wait({pump}, timeout=ABORT_RETRY_S)
            if done:
                return
            if loop.time() >= deadline:
                log.warning(
                    "SGLang stream %s did not end %.0fs after its abort; closing it",
                    aborted_rid,
                    STREAM_DRAIN_TIMEOUT_S,
                )
                pump.cancel()
                await asyncio.wait({pump})
                return
            if aborted_rid is not None:
                self._abort_rid(aborted_rid)

    def _abort_rid(self, rid: str) -> None:
        manager = getattr(self._engine, "tokenizer_manager", None)
        abort_request = getattr(manager, "abort_request", None)
        if not callable(abort_request):
            log.warning("cannot abort %s: the engine has no tokenizer_manager.abort_request", rid)
            return
        try:
            abort_request(rid=rid, abort_all=False)
        except Exception:
            log.exception("SGLang abort_request(%s) failed", rid)

    def _translate(self, exc: Exception) -> ConveyorError:
        if isinstance(exc, ValueError):  # TokenizerManager / SamplingParams validation
            return _invalid_request(str(exc))
        if not self._engine_alive():
            self._dead = True
            return EngineDead(f"the SGLang engine died: {type(exc).__name__}: {exc}")
        return EngineError(f"generation failed: {type(exc).__name__}: {exc}")

    def _engine_alive(self) -> bool:
        manager = getattr(self._engine, "tokenizer_manager", None)
        if getattr(manager, "gracefully_exit", False) is True:
            return False
        get_pids = getattr(self._engine, "get_all_child_pids", None)
        if not callable(get_pids):
            return True
        try:
            pids = [int(pid) for pid in get_pids()]
        except Exception:
            log.exception("could not list the SGLang engine's child processes")
            return True
        return all(_pid_alive(pid) for pid in pids)


# ----------------------------------------------------------------------------- request side


def sampling_params(options: SamplingOptions) -> dict[str, Any]:
    """SGLang ``sampling_params`` (``sglang.srt.sampling.sampling_params.SamplingParams``).

    ``prompt_logprobs`` is not supported (prompt logprobs never reach :class:`StepOutput`).
    """
    params: dict[str, Any] = {
        "max_new_tokens": options.max_tokens,
        "min_new_tokens": options.min_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k if options.top_k > 0 else TOP_K_DISABLED,
        "min_p": options.min_p,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "repetition_penalty": options.repetition_penalty,
        "ignore_eos": options.ignore_eos,
        "skip_special_tokens": options.skip_special_tokens,
    }
    if options.stop:
        params["stop"] = list(options.stop)
    if options.stop_token_ids:
        params["stop_token_ids"] = list(options.stop_token_ids)
    if options.json_schema is not None:
        params["json_schema"] = options.json_schema
    elif options.json_object:
        params["json_schema"] = JSON_OBJECT_SCHEMA
    if options.seed is not None:
        params["sampling_seed"] = options.seed
    if options.logit_bias:
        params["logit_bias"] = {str(token): bias for token, bias in options.logit_bias.items()}
    return params


def _text_only(images: PromptImages | None) -> None:
    if images is not None:
        raise InvalidRequest(
            "the SGLang backend of Conveyor does not take images yet; "
            "serve vision-language models with the vLLM engine"
        )


def prefill_options(options: SamplingOptions) -> SamplingOptions:
    """The prefill half of a request: one token, ``min_new_tokens`` capped to fit."""
    return msgspec.structs.replace(options, max_tokens=1, min_tokens=min(options.min_tokens, 1))


def _bootstrap_fields(handoff: Handoff) -> dict[str, Any]:
    try:
        host, port, room = (handoff[key] for key in HANDOFF_KEYS)
    except (KeyError, TypeError) as exc:
        raise EngineError(f"malformed SGLang handoff {handoff!r}") from exc
    if (
        not isinstance(host, str)
        or not isinstance(port, int)
        or not isinstance(room, int)
        or isinstance(port, bool)
        or isinstance(room, bool)
    ):
        raise EngineError(f"malformed SGLang handoff {handoff!r}")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def _invalid_request(message: str) -> InvalidRequest:
    if "context length" in message:
        return ContextLengthExceeded(message)
    return InvalidRequest(message)


# ----------------------------------------------------------------------------- response side


class _StreamDecoder:
    """Turns one request's streamed SGLang dicts into :class:`StepOutput` deltas."""

    def __init__(
        self,
        stream_format: StreamFormat,
        prompt_tokens: int,
        top_logprobs: int | None,
        token_texts: Callable[[list[int]], list[str]],
    ) -> None:
        self._format = stream_format
        self._top_logprobs = top_logprobs
        self._token_texts = token_texts
        self.emitted = 0
        self.text = ""
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: int | None = None

    def step(self, chunk: Mapping[str, Any], *, abort_requested: bool) -> StepOutput | None:
        """The delta this chunk adds, or None for an empty, unfinished chunk.

        Raises ``InvalidRequest`` / ``EngineError`` when SGLang ended the request with
        an error (an abort nobody asked for).
        """
        meta: Mapping[str, Any] = chunk.get("meta_info") or {}
        finish = finish_reason(meta.get("finish_reason"), abort_requested=abort_requested)
        new_ids = self._new_ids(chunk.get("output_ids") or (), meta)
        # TokenizerManager._handle_abort_req answers an abort with the *whole* text and the
        # last token again, whatever the streaming format: no new tokens means no new text.
        echo = finish == "abort" and not new_ids
        text = self._text_delta(chunk.get("text"), cumulative=echo)
        prompt_tokens = meta.get("prompt_tokens")
        if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool):
            self.prompt_tokens = prompt_tokens
        cached = meta.get("cached_tokens")  # SGLang's radix-cache hits for the prompt
        if isinstance(cached, int) and not isinstance(cached, bool):
            self.cached_tokens = cached
        if not new_ids and not text and finish is None:
            return None
        logprobs = None
        if self._top_logprobs is not None:
            logprobs = self._logprobs(meta, len(new_ids))
        self.emitted += len(new_ids)
        return StepOutput(
            token_ids=new_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=finish,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
        )

    def _new_ids(self, raw: Sequence[Any], meta: Mapping[str, Any]) -> list[int]:
        ids = [int(token) for token in raw]
        done = meta.get("completion_tokens")
        if isinstance(done, int) and not isinstance(done, bool):
            count = max(0, min(len(ids), done - self.emitted))
        elif self._format.incremental_ids:
            count = len(ids)
        else:
            count = max(0, len(ids) - self.emitted)
        return ids[len(ids) - count :] if count else []

    def _text_delta(self, raw: Any, *, cumulative: bool) -> str:
        if raw is None:  # non-incremental intermediate chunk whose text was not built
            return ""
        text = str(raw)
        if self._format.incremental_text and not cumulative:
            self.text += text
            return text
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text
        return delta

    def _logprobs(self, meta: Mapping[str, Any], count: int) -> list[TokenLogprob]:
        if count == 0:
            return []
        sampled = _tail(meta.get("output_token_logprobs"), count)
        tops: list[Any] = [None] * len(sampled)
        if self._top_logprobs:
            available = _tail(meta.get("output_top_logprobs"), len(sampled))
            tops[len(tops) - len(available) :] = available
        missing = sorted(
            {int(entry[1]) for entry in sampled if _entry_text(entry) is None}
            | {int(entry[1]) for top in tops for entry in (top or ()) if _entry_text(entry) is None}
        )
        names = dict(zip(missing, self._token_texts(missing), strict=False)) if missing else {}

        def text_of(entry: Sequence[Any]) -> str:
            given = _entry_text(entry)
            return given if given is not None else names.get(int(entry[1]), "")

        return [
            TokenLogprob(
                token_id=int(entry[1]),
                token=text_of(entry),
                logprob=_logprob(entry[0]),
                top=[
                    TopLogprob(int(alt[1]), text_of(alt), _logprob(alt[0]))
                    for alt in (top or ())[: self._top_logprobs or 0]
                ],
            )
            for entry, top in zip(sampled, tops, strict=True)
        ]


def finish_reason(raw: Any, *, abort_requested: bool = False) -> str | None:
    """Map SGLang's ``meta_info["finish_reason"]`` to Conveyor's.

    ``{"type": "stop", "matched": ...}`` / ``{"type": "length", ...}`` pass through. An
    ``{"type": "abort", ...}`` is ``"abort"`` when this adapter asked for it; otherwise
    SGLang rejected or lost the request: ``status_code`` 4xx -> ``InvalidRequest``,
    anything else -> ``EngineError``.
    """
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        kind = str(raw.get("type"))
        message = str(raw.get("message") or "aborted by SGLang")
        status = _status(raw.get("status_code"))
    else:
        kind, message, status = str(raw), str(raw), None
    if kind != "abort":
        return kind
    if abort_requested:
        return "abort"
    if status is not None and 400 <= status < 500:
        raise _invalid_request(message)
    raise EngineError(f"SGLang aborted the request: {message}")


def _tail(values: Any, count: int) -> list[Any]:
    """The last ``count`` items: right whether SGLang sent the list cumulative or per chunk."""
    items = list(values or ())
    return items[len(items) - min(count, len(items)) :]


def _status(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _entry_text(entry: Sequence[Any]) -> str | None:
    """Logprob entries are ``(logprob, token_id, text)``; text is None unless the request
    set ``return_text_in_logprobs`` (which ``Engine.async_generate`` cannot)."""
    text = entry[2] if len(entry) > 2 else None
    return None if text is None else str(text)


def _logprob(value: Any) -> float:
    return float("-inf") if value is None else float(value)


def _token_text_decoder(engine: Any) -> Callable[[list[int]], list[str]]:
    """Token id -> text the way SGLang's ``detokenize_logprob_tokens`` does it."""
    tokenizer = getattr(getattr(engine, "tokenizer_manager", None), "tokenizer", None)
    if tokenizer is None:
        return lambda ids: ["" for _ in ids]

    def decode(ids: list[int]) -> list[str]:
        return [str(text) for text in tokenizer.batch_decode([[token] for token in ids])]

    return decode


# ----------------------------------------------------------------------------- host helpers


def _setting(settings: Settings, name: str, default: Any) -> Any:
    value = getattr(settings, name, None)
    return default if value is None else value


def _default_bootstrap_host(bind_host: str) -> str:
    """The address other machines reach this one at (``bind_host`` if it is specific)."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))  # UDP: no packet is sent
        return str(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat.rsplit(")", 1)[-1].split()
    return not fields or fields[0] not in ("Z", "X")
