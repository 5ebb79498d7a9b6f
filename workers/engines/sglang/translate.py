"""Conveyor's job protocol <-> SGLang's request and streamed-chunk shapes.

Requests: :class:`SamplingOptions` -> ``async_generate`` keyword arguments
(:func:`generate_request`, :func:`sampling_params`). Responses: SGLang streams dicts
``{"text", "output_ids", "meta_info"}``; :class:`StreamDecoder` turns them into
:class:`StepOutput` deltas, and SGLang's finish reasons and validation errors into
Conveyor's (:func:`finish_reason`, :func:`invalid_request`).

Depending on the SGLang release and ``ServerArgs`` (``incremental_streaming_output``,
formerly ``stream_output``), ``output_ids``, ``text`` and the output logprob lists in
``meta_info`` are either per-chunk deltas or cumulative. The engine is launched with
incremental output (as Dynamo does), but the decoder does not rely on it: new tokens
are counted with ``meta_info["completion_tokens"]`` (always ``len(req.output_ids)``),
logprobs are the tail of their lists, and only the text needs to know the format
(:class:`StreamFormat`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import msgspec

from shared.errors import ContextLengthExceeded, EngineError, InvalidRequest
from shared.protocol import SamplingOptions, TokenLogprob, TopLogprob
from workers.engines.base import PromptImages, StepOutput

TOP_K_DISABLED: Final = -1
"""SGLang's ``top_k`` for "whole vocabulary" (Conveyor uses 0, like vLLM)."""

JSON_OBJECT_SCHEMA: Final = '{"type": "object"}'
"""What SGLang's own OpenAI layer sends as ``json_schema`` for ``response_format=json_object``."""


# ----------------------------------------------------------------------------- requests


def generate_request(
    prompt_token_ids: Sequence[int], sampling: SamplingOptions, bootstrap: Mapping[str, Any]
) -> dict[str, Any]:
    """``Engine.async_generate`` keyword arguments for one streamed request (but its rid)."""
    kwargs: dict[str, Any] = {
        "input_ids": list(prompt_token_ids),
        "sampling_params": sampling_params(sampling),
        "stream": True,
        **bootstrap,
    }
    if sampling.logprobs is not None:
        kwargs["return_logprob"] = True
        kwargs["top_logprobs_num"] = sampling.logprobs
    return kwargs


def sampling_params(options: SamplingOptions) -> dict[str, Any]:
    """SGLang ``sampling_params`` (``sglang.srt.sampling.sampling_params.SamplingParams``).

    ``prompt_logprobs`` (prompt logprobs are not read from SGLang's answers), ``choice``,
    ``allowed_token_ids`` and ``cache_salt`` (no SGLang counterpart) are a 400
    (a salt ignored would share the prefix cache its client asked to keep apart).
    """
    _refuse_unsupported(options)
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
    elif options.regex is not None:
        params["regex"] = options.regex
    elif options.grammar is not None:
        params["ebnf"] = options.grammar
    elif options.structural_tag is not None:
        params["structural_tag"] = options.structural_tag
    if options.seed is not None:
        params["sampling_seed"] = options.seed
    if options.logit_bias:
        params["logit_bias"] = {str(token): bias for token, bias in options.logit_bias.items()}
    return params


def _refuse_unsupported(options: SamplingOptions) -> None:
    for name in ("choice", "allowed_token_ids", "cache_salt", "prompt_logprobs"):
        if getattr(options, name) is not None:
            param = "structured_outputs.choice" if name == "choice" else name
            raise InvalidRequest(f"the SGLang backend of Conveyor does not do {param}", param=param)


def prefill_options(options: SamplingOptions) -> SamplingOptions:
    """The prefill half of a request: one token, ``min_new_tokens`` capped to fit."""
    return msgspec.structs.replace(options, max_tokens=1, min_tokens=min(options.min_tokens, 1))


def text_only(images: PromptImages | None) -> None:
    if images is not None:
        raise InvalidRequest(
            "the SGLang backend of Conveyor does not take images yet; "
            "serve vision-language models with the vLLM engine"
        )


def invalid_request(message: str) -> InvalidRequest:
    """SGLang's validation message as Conveyor's error (context length has its own)."""
    if "context length" in message:
        return ContextLengthExceeded(message)
    return InvalidRequest(message)


# ----------------------------------------------------------------------------- responses


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


class StreamDecoder:
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
        prompt_tokens = _count(meta.get("prompt_tokens"))
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        cached = _count(meta.get("cached_tokens"))  # SGLang's radix-cache hits for the prompt
        if cached is not None:
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
        done = _count(meta.get("completion_tokens"))
        if done is not None:
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
    ``{"type": "abort", ...}`` is ``"abort"`` when this engine asked for it; otherwise
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
        raise invalid_request(message)
    raise EngineError(f"SGLang aborted the request: {message}")


def token_text_decoder(engine: Any) -> Callable[[list[int]], list[str]]:
    """Token id -> text the way SGLang's ``detokenize_logprob_tokens`` does it."""
    tokenizer = getattr(getattr(engine, "tokenizer_manager", None), "tokenizer", None)
    if tokenizer is None:
        return lambda ids: ["" for _ in ids]

    def decode(ids: list[int]) -> list[str]:
        return [str(text) for text in tokenizer.batch_decode([[token] for token in ids])]

    return decode


def _count(value: Any) -> int | None:
    """An integer ``meta_info`` count, or None when absent (booleans are not counts)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
