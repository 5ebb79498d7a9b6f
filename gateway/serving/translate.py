"""OpenAI request fields -> prompt token ids and SamplingOptions, for the serving step
(:mod:`gateway.serving.endpoints`, the one translation point between the two vocabularies)."""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway.catalog.served_models import ServedModel
from gateway.catalog.tokenizer import CHAT_COMPLETION, RESERVED_TEMPLATE_VARIABLES, ChatRendering
from gateway.dispatch.plan import ChoiceSpec
from gateway.openai import vllm_fields
from gateway.openai.logprob_rows import Echo
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.openai.vllm_schemas import TokenizeChatRequest
from gateway.serving import prompts
from gateway.serving.structured import constraint, refuse_legacy
from shared.errors import ContextLengthExceeded, InvalidRequest, UnsupportedParameter
from shared.protocol import SamplingOptions

log = logging.getLogger(__name__)


def refuse_unsupported(request: SamplingFields, model: ServedModel) -> None:
    """Known OpenAI fields whose meaning this server cannot honour are a 400, not ignored:
    a client that asked for tool calls must not mistake a plain answer for one."""
    refuse_legacy(request)
    vllm_fields.refuse(request.model_extra, chat=isinstance(request, ChatCompletionRequest))
    if request.use_beam_search:
        raise UnsupportedParameter(
            "beam search is not supported (the engine path streams one sequence per choice)",
            param="use_beam_search",
        )
    if isinstance(request, ChatCompletionRequest):
        _refuse_chat_features(request, model.name)
    elif isinstance(request, CompletionRequest):
        _refuse_completion_features(request)


def _refuse_completion_features(request: CompletionRequest) -> None:
    if request.best_of not in (None, request.n):
        raise UnsupportedParameter(
            "best_of is not supported (only best_of equal to n, which returns every sample)",
            param="best_of",
        )
    if request.max_tokens == 0 and not request.echo:
        raise InvalidRequest(
            "max_tokens must be at least 1 (0 only with echo: the prompt alone, scored)",
            param="max_tokens",
        )


def _refuse_chat_features(request: ChatCompletionRequest, name: str) -> None:
    legacy = "the deprecated functions API is not supported; send tools and tool_choice"
    if request.functions:
        raise UnsupportedParameter(legacy, param="functions")
    if request.function_call not in (None, "none"):
        raise UnsupportedParameter(legacy, param="function_call")
    if request.audio is not None or any(m != "text" for m in request.modalities or ()):
        raise UnsupportedParameter(
            f"model `{name}` answers with text only",
            param="audio" if request.audio is not None else "modalities",
        )
    if request.web_search_options is not None:
        raise UnsupportedParameter("web search is not supported", param="web_search_options")


def chat_rendering(request: ChatCompletionRequest) -> ChatRendering:
    """vLLM's rendering options of a chat request (``chat_template_kwargs``, the ending)."""
    return ChatRendering(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        template_kwargs=template_kwargs(request.chat_template_kwargs),
    )


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs``, refused when they would set what the request's own fields
    set."""
    taken = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs or {}))
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields "
            "(messages, tools, add_generation_prompt, continue_final_message) do",
            param="chat_template_kwargs",
        )
    return dict(kwargs or {})


def chat_prompt(
    request: ChatCompletionRequest | TokenizeChatRequest,
    model: ServedModel,
    images: int = 0,
    tools: list[dict[str, Any]] | None = None,
    rendering: ChatRendering = CHAT_COMPLETION,
) -> list[int]:
    """The prompt's token ids; a vision-language model's images appear as one (unexpanded)
    placeholder token each, which the engine expands to the image's embeddings. ``tools``
    go to the template's ``tools`` variable (templates without one ignore them). /tokenize
    renders its messages here too, with its own ``rendering``."""
    placeholder = model.image_token_id
    vision = placeholder is not None
    messages = [_message_dict(i, message, vision) for i, message in enumerate(request.messages)]
    extra = {"tools": tools} if tools else {}
    prompt = model.tokenizer.encode_chat(messages, rendering, **extra)
    if placeholder is not None and prompt.count(placeholder) != images:
        raise InvalidRequest(
            f"the chat template of `{model.name}` placed {prompt.count(placeholder)} image "
            f"placeholder(s) for {images} image(s); this model cannot take images there",
            param="messages",
        )
    return prompt


def _message_dict(position: int, message: Any, vision: bool) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        if vision:
            content = [_template_part(part) for part in content]
        else:
            content = "".join(
                _text_only(position, index, part) for index, part in enumerate(content)
            )
    entry: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name:
        entry["name"] = message.name
    if message.tool_calls:
        entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _template_tool_call(call: Any) -> dict[str, Any]:
    """Chat templates render arguments with ``tojson``: give them the object (as
    transformers and vLLM do), or the text when it is not JSON."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def _template_part(part: Any) -> dict[str, Any]:
    """Hugging Face chat templates of vision models expect ``{"type": "image"}``."""
    if part.type == "text":
        return {"type": "text", "text": part.text}
    return {"type": "image"}


def _text_only(position: int, index: int, part: Any) -> str:
    if part.type != "text":
        raise InvalidRequest(
            f"model does not accept {part.type} content parts",
            param=f"messages[{position}].content[{index}]",
        )
    return str(part.text)


def prompt_list(request: CompletionRequest) -> list[str | list[int]]:
    try:
        return request.prompts()
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="prompt") from exc


def echoes(
    request: CompletionRequest, specs: list[ChoiceSpec], model: ServedModel
) -> dict[int, Echo]:
    """Each choice's prompt as ``echo`` writes it back: the prompt's text as sent (token
    ids: decoded), its first token decoded alone (vLLM's first echoed logprob row)."""
    texts = prompt_list(request)
    found: dict[int, Echo] = {}
    for spec in specs:
        sent = texts[spec.index // request.n]
        ids = spec.prompt_token_ids
        whole = isinstance(sent, str) and request.truncate_prompt_tokens is None
        text = sent if whole and isinstance(sent, str) else model.tokenizer.decode(ids)
        first = model.tokenizer.decode(ids[:1])
        found[spec.index] = Echo(text, first, ids[0], only=request.echo_only())
    return found


def completion_prompts(request: CompletionRequest, model: ServedModel) -> list[list[int]]:
    return prompts.token_lists(prompt_list(request), model, "prompt", indexed=False)


def choices(
    request: SamplingFields,
    prompts: list[list[int]],
    model: ServedModel,
    *,
    logprobs: int | None,
) -> list[ChoiceSpec]:
    """``n`` choices per prompt, indexed the way OpenAI numbers them."""
    bias = logit_bias(request, model)
    structured = constraint(request)
    token_ids = _token_ids(request, model)
    specs = []
    for prompt_index, whole in enumerate(prompts):
        prompt = truncated(request, whole, model.max_model_len)
        max_tokens = _max_tokens(request, len(prompt), model.max_model_len)
        for sample in range(request.n):
            index = prompt_index * request.n + sample
            seed = None if request.seed is None else request.seed + sample
            options = sampling_options(
                request, max_tokens, seed, logprobs, bias, structured, **token_ids
            )
            specs.append(ChoiceSpec(index, prompt, options))
    return specs


def logit_bias(request: SamplingFields, model: ServedModel) -> dict[int, float] | None:
    """``logit_bias`` with every token id checked against the model's vocabulary."""
    if not request.logit_bias:
        return None
    prompts.check_vocabulary(request.logit_bias, model, "logit_bias")
    return dict(request.logit_bias)


def _token_ids(request: SamplingFields, model: ServedModel) -> dict[str, Any]:
    """``stop_token_ids`` and ``allowed_token_ids``, checked against the vocabulary."""
    fields: dict[str, Any] = {}
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = getattr(request, name)
        if ids:
            prompts.check_vocabulary(ids, model, name)
            fields[name] = tuple(ids)
    return fields


def truncated(request: SamplingFields, prompt: list[int], max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep N tokens of the prompt (the last N, or the
    first with ``truncation_side: right``); -1 keeps what the context window leaves
    beside ``max_tokens`` (or one token)."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return prompt
    if keep == -1:
        keep = max(max_model_len - (request.token_budget() or 1), 0)  # type: ignore[attr-defined]
    elif keep > max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens ({keep}) is more than this model's maximum context "
            f"length ({max_model_len})",
            param="truncate_prompt_tokens",
        )
    if len(prompt) <= keep:
        return prompt
    return prompt[:keep] if request.truncation_side == "right" else prompt[len(prompt) - keep :]


def _max_tokens(request: SamplingFields, prompt_len: int, max_model_len: int) -> int:
    budget = request.token_budget()  # type: ignore[attr-defined]
    room = max_model_len - prompt_len
    param = "max_tokens"
    if budget is None:
        if room < 1:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {prompt_len} tokens, leaving no room to generate. Shorten the prompt.",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            )
        _check_min_tokens(request, room)
        return int(room)
    if prompt_len + budget > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. You requested "
            f"{prompt_len + budget} tokens ({prompt_len} in the prompt, {budget} for the "
            f"completion). Reduce max_tokens to at most {max(room, 0)} or shorten the prompt.",
            param=param,
        )
    _check_min_tokens(request, budget)
    return int(budget)


def _check_min_tokens(request: SamplingFields, max_tokens: int) -> None:
    if request.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({request.min_tokens}) is more than the {max_tokens} tokens this "
            "request may generate (max_tokens, or what the context window leaves)",
            param="min_tokens",
        )


def sampling_options(
    request: SamplingFields,
    max_tokens: int,
    seed: int | None,
    logprobs: int | None,
    logit_bias: dict[int, float] | None = None,
    structured: dict[str, Any] | None = None,
    **token_ids: Any,
) -> SamplingOptions:
    """One choice's SamplingOptions; ``structured`` is :func:`constraint`'s answer and
    ``token_ids`` the checked ``stop_token_ids`` / ``allowed_token_ids``."""
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k is None or request.top_k == -1 else request.top_k,
        min_p=request.min_p or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        seed=seed,
        stop=request.stop_list(),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        logit_bias=logit_bias,
        cache_salt=request.cache_salt,
        skip_special_tokens=request.skip_special_tokens,
        prompt_logprobs=_prompt_logprobs(request),
        **(constraint(request) if structured is None else structured),
        **token_ids,
    )


def _prompt_logprobs(request: SamplingFields) -> int | None:
    if isinstance(request, CompletionRequest):
        return request.prompt_logprobs_k()
    return request.prompt_logprobs


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        return None
    return request.top_logprobs or 0
