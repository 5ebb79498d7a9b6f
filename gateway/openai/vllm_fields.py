"""Fields of vLLM's chat and completion request bodies that the schema here does not
declare: each is refused when a request sets it to anything but vLLM's default, or
ignored, with the reason. docs/api.md lists them; a unit test reads vLLM's request
classes and fails on a field the docs do not list, so a vLLM upgrade shows what is new.

A request's undeclared fields are its pydantic ``model_extra``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.errors import UnsupportedParameter


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    default: Any = None
    """vLLM's default (sent explicitly, it changes nothing and is accepted)."""
    completion_default: Any = None
    """The default on ``/v1/completions`` where it differs from chat's."""
    chat_only: bool = False


REFUSED: dict[str, Refused] = {
    "chat_template": Refused(
        "another chat template per request is not supported: the model's own renders every prompt",
        chat_only=True,
    ),
    "documents": Refused(
        "documents for the chat template are not supported (send them as messages)",
        chat_only=True,
    ),
    "include_reasoning": Refused(
        "reasoning is always returned (in reasoning_content) when the model writes it",
        default=True,
        chat_only=True,
    ),
    "thinking_token_budget": Refused("a thinking token budget is not supported"),
    "include_stop_str_in_output": Refused(
        "the stop string is always left out of the output", default=False
    ),
    "spaces_between_special_tokens": Refused(
        "special tokens are always detokenized with spaces between them", default=True
    ),
    "add_special_tokens": Refused(
        "special tokens are added as vLLM's default does (chat: by the template only; "
        "completions: by the tokenizer)",
        default=False,
        completion_default=True,
    ),
    "bad_words": Refused("bad_words is not supported", default=[]),
    "logprob_token_ids": Refused("logprobs of chosen token ids are not supported"),
    "watermarking": Refused("watermarking is not supported"),
    "priority": Refused(
        "priority scheduling is not supported (vLLM refuses it too unless started with "
        "--scheduling-policy priority)",
        default=0,
    ),
    "repetition_detection": Refused("repetition detection is not supported"),
    "return_token_offsets": Refused("token offsets are not returned", default=False),
    "return_prompt_text": Refused(
        "the templated prompt text is not returned (POST /tokenize shows the prompt's tokens)",
        chat_only=True,
    ),
    "media_io_kwargs": Refused("per-request media loading options are not supported"),
    "mm_processor_kwargs": Refused("per-request image processor options are not supported"),
    "prompt_embeds": Refused("prompt embeddings are not supported: send text or token ids"),
    "kv_transfer_params": Refused(
        "Conveyor runs prefill/decode itself; it takes no KV transfer parameters from clients"
    ),
    "ec_transfer_params": Refused(
        "Conveyor runs encode workers itself; it takes no encoder-cache parameters from clients"
    ),
    "vllm_xargs": Refused("custom engine extension arguments are not supported"),
}
"""Each changes what the answer holds: a request that asks for it is a 400."""

IGNORED: dict[str, str] = {
    "length_penalty": "beam search only (beam search is refused)",
    "request_id": "Conveyor names every request itself: ids stay unique across gateways",
    "session_id": "a routing hint: the queue routes every request",
    "stream_interval": "how many tokens one chunk batches: the streamed text is the same",
    "mm_payload": "what vLLM's render endpoint returns for images: no effect on an answer",
    "return_mm_kwargs": "the deprecated form of mm_payload",
    "routed_experts_prompt_start": "only with routed-expert data, which is not returned",
}
"""Accepted with no effect: none changes what a client relies on."""


def refuse(extra: Mapping[str, Any] | None, *, chat: bool) -> None:
    """A 400 naming the first refused vLLM field the request sets to a value that is not
    vLLM's default (null counts as unset)."""
    for name, value in (extra or {}).items():
        rule = REFUSED.get(name)
        if rule is None or value is None or (rule.chat_only and not chat):
            continue
        if value != _default(rule, chat=chat):
            raise UnsupportedParameter(f"{name}: {rule.reason}", param=name)


def _default(rule: Refused, *, chat: bool) -> Any:
    if not chat and rule.completion_default is not None:
        return rule.completion_default
    return rule.default
