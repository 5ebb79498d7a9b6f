"""Limits checked before a request costs anything: headers, counts and text lengths.

Everything here is cheap (no tokenizing, no I/O) and runs before the work it
protects: a request over a limit is a 400 naming the field or header, never a
long tokenization followed by a context-length error, and never a 500.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.catalog.served_models import ServedModel
from gateway.openai.schemas import ChatCompletionRequest, TextPart
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.settings import GatewaySettings

MAX_IDEMPOTENCY_KEY_CHARS = 255
TIMEOUT_HEADER = "X-Request-Timeout"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def request_timeout_s(value: float | None, settings: GatewaySettings) -> float:
    """The request's deadline in seconds: the header's (finite, positive) or the default,
    cut to ``settings.max_request_timeout_s``."""
    if value is None:
        return min(settings.request_timeout_s, settings.max_request_timeout_s)
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest(
            f"{TIMEOUT_HEADER} must be a positive, finite number of seconds",
            param=TIMEOUT_HEADER,
        )
    return min(value, settings.max_request_timeout_s)


def idempotency_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not 0 < len(value) <= MAX_IDEMPOTENCY_KEY_CHARS or not _printable_ascii(value):
        raise InvalidRequest(
            f"{IDEMPOTENCY_HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII "
            "characters",
            param=IDEMPOTENCY_HEADER,
        )
    return value


def _printable_ascii(text: str) -> bool:
    return text.isascii() and text.isprintable()


def check_jobs(count: int, settings: GatewaySettings, param: str) -> None:
    """A request needing more jobs than a queue holds would be refused (429) forever."""
    if count > settings.queue_max_depth:
        raise InvalidRequest(
            f"this request needs {count} sequences; at most {settings.queue_max_depth} can be "
            "queued for a model (CONVEYOR_QUEUE_MAX_DEPTH)",
            param=param,
        )


def check_chat(
    request: ChatCompletionRequest, model: ServedModel, settings: GatewaySettings
) -> None:
    """Message count, sequence count and text length of a chat request (before templating)."""
    if len(request.messages) > settings.max_messages:
        raise InvalidRequest(
            f"{len(request.messages)} messages in one request; the limit is "
            f"{settings.max_messages} (CONVEYOR_MAX_MESSAGES)",
            param="messages",
        )
    check_jobs(request.n, settings, "n")
    check_text_fits(_chat_chars(request), model, "messages")


def _chat_chars(request: ChatCompletionRequest) -> int:
    total = 0
    for message in request.messages:
        total += len(message.name or "")
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content is not None:
            total += sum(len(p.text) for p in message.content if isinstance(p, TextPart))
    return total


def check_prompts_fit(
    prompts: Sequence[str | list[int]], model: ServedModel, name: str, *, indexed: bool
) -> None:
    """Every prompt (text or token ids) could fit the context window: checked for all of
    them before any is tokenized."""
    for position, prompt in enumerate(prompts):
        param = f"{name}[{position}]" if indexed else name
        if isinstance(prompt, str):
            check_text_fits(len(prompt), model, param)
        else:
            check_token_ids_fit(len(prompt), model, param)


def check_text_fits(chars: int, model: ServedModel, param: str) -> None:
    """Refuse text that cannot fit the context window, without tokenizing it.

    No token of the model covers more characters of input than its longest vocabulary
    entry, so a text longer than ``max_model_len`` times that holds more tokens than the
    window (unless the tokenizer's normalizer deletes characters wholesale)."""
    limit = model.max_model_len * model.tokenizer.max_token_chars
    if chars > limit:
        raise ContextLengthExceeded(
            f"{param} holds {chars} characters: more than the {model.max_model_len}-token "
            f"context window of `{model.name}` can take (at most {limit} characters). "
            "Shorten it.",
            param=param,
        )


def check_token_ids_fit(count: int, model: ServedModel, param: str) -> None:
    if count > model.max_model_len:
        raise ContextLengthExceeded(
            f"{param} holds {count} tokens; the context window of `{model.name}` is "
            f"{model.max_model_len} tokens",
            param=param,
        )
