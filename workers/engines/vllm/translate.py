"""The vLLM engine's translation: Conveyor's job protocol to vLLM's request classes
(SamplingParams, TokensPrompt), vLLM's outputs to :class:`StepOutput`, and vLLM's
exceptions to :mod:`shared.errors` (:func:`vllm_errors`, the one mapping).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from shared.errors import EngineDead, EngineError, InvalidRequest
from shared.protocol import (
    PromptLogprob,
    PromptLogprobs,
    SamplingOptions,
    TokenLogprob,
    TopLogprob,
    constraint_kind,
)
from workers.engines.base import (
    Handoff,
    PromptImages,
    StepOutput,
)
from workers.engines.vision.encoder import to_vllm_input

log = logging.getLogger(__name__)


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
    _check_constraint(params, options)
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    return params


def _check_constraint(params: Any, options: SamplingOptions) -> None:
    """The grammar checked by vLLM's own xgrammar check (the engine's backend), before the
    engine sees it, so that a bad regex, grammar, choice list or schema is a 400 naming
    its field. (vLLM runs the check again on admission; it is a parse, not a compile.)"""
    if params.structured_outputs is None:
        return
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    kind = constraint_kind(options)
    param = None if kind is None else f"structured_outputs.{kind}"
    with vllm_errors(
        "structured outputs", param=param, invalid_prefix=f"invalid {param or 'JSON schema'}: "
    ):
        validate_xgrammar_grammar(params)


def tokens_prompt(
    prompt_token_ids: list[int],
    images: PromptImages | None,
    family: str | None,
    cache_salt: str | None = None,
) -> Any:
    """vLLM's TokensPrompt: token ids holding each image's single, unexpanded placeholder,
    plus the images (raw, or an encode worker's embeddings in the model ``family``'s
    shape): vLLM expands the placeholders itself (expanded ids would be expanded again);
    and the request's ``cache_salt``."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
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
        cached_tokens=_cached_tokens(output),
        prompt_logprobs=_prompt_logprobs(getattr(output, "prompt_logprobs", None)),
    )


def _prompt_logprobs(raw: Any) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` (None first, then per position a dict whose first entry
    is the prompt token, then its top-k by rank) in the protocol's shape."""
    if not raw:
        return None
    return [
        None
        if position is None
        else [
            PromptLogprob(int(tid), lp.decoded_token or "", _finite(lp.logprob), lp.rank)
            for tid, lp in position.items()
        ]
        for position in raw
    ]


def _cached_tokens(output: Any) -> int | None:
    """vLLM's ``RequestOutput.num_cached_tokens`` (prefix-cache hits, whole blocks)."""
    cached = getattr(output, "num_cached_tokens", None)
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _build_sampling_params(options: SamplingOptions) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if options.json_schema is not None:
        structured = StructuredOutputsParams(json=json.loads(options.json_schema))
    elif options.json_object:
        structured = StructuredOutputsParams(json_object=True)
    elif (kind := constraint_kind(options)) is not None:
        value: Any = getattr(options, kind)
        value = list(value) if kind == "choice" else value
        structured = StructuredOutputsParams(**{kind: value})
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
        prompt_logprobs=options.prompt_logprobs,
        skip_special_tokens=options.skip_special_tokens,
        logit_bias=options.logit_bias,
        structured_outputs=structured,
        allowed_token_ids=None
        if options.allowed_token_ids is None
        else list(options.allowed_token_ids),
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
