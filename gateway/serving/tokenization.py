"""vLLM's tokenizer endpoints: /tokenize, /detokenize and /tokenizer_info, answered by the
gateway itself (it holds every served model's tokenizer and chat template).

Chat messages are rendered by the chat completions' own step
(:func:`gateway.serving.translate.chat_prompt`), so /tokenize counts exactly the tokens a
chat completion with the same messages and tools would send to the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.catalog.served_models import ServedModel
from gateway.catalog.tokenizer import ChatRendering
from gateway.control.records import Principal
from gateway.openai.vllm_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from gateway.serving import prompts, translate
from gateway.serving.tool_choice import check_caps, template_tools
from gateway.state import GatewayState
from shared.errors import UnsupportedParameter

PATH_FIELDS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path"})
"""Fields of tokenizer_config.json that name files on the server: never shown (vLLM drops
the first two)."""


def served_model(state: GatewayState, name: str | None, principal: Principal) -> ServedModel:
    """The model ``name`` (as the key may use it); None: the server's first model, as
    vLLM's ``model`` is optional on these bodies."""
    return state.catalog.get(name or state.catalog.all()[0].name, principal.models)


async def tokenize(
    state: GatewayState,
    body: TokenizeChatRequest | TokenizeCompletionRequest,
    principal: Principal,
) -> dict[str, Any]:
    model = served_model(state, body.model, principal)
    if isinstance(body, TokenizeChatRequest):
        tokens = await asyncio.to_thread(_chat_tokens, body, model)
    else:
        encode = model.tokenizer.encode
        tokens = await asyncio.to_thread(
            encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
    strings = model.tokenizer.token_strings(tokens) if body.return_token_strs else None
    answer = TokenizeResponse(
        count=len(tokens), max_model_len=model.max_model_len, tokens=tokens, token_strs=strings
    )
    return answer.model_dump()


def _chat_tokens(body: TokenizeChatRequest, model: ServedModel) -> list[int]:
    if body.chat_template is not None:
        raise UnsupportedParameter(
            "chat_template is not supported: prompts are rendered with the model's own "
            "template, as chat completions are",
            param="chat_template",
        )
    tools = body.tools or []
    check_caps(tools)
    images = sum(
        1
        for message in body.messages
        if isinstance(message.content, list)
        for part in message.content
        if part.type != "text"
    )
    rendering = ChatRendering(
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        template_kwargs=translate.template_kwargs(body.chat_template_kwargs),
    )
    return translate.chat_prompt(body, model, images, template_tools(tools) or None, rendering)


def detokenize(
    state: GatewayState, body: DetokenizeRequest, principal: Principal
) -> dict[str, Any]:
    model = served_model(state, body.model, principal)
    prompts.check_vocabulary(body.tokens, model, "tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens)).model_dump()


def tokenizer_info(model: ServedModel) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json) with
    added tokens as their text, file names left out, its class and its chat template."""
    tokenizer = model.tokenizer
    info = {k: _json_safe(v) for k, v in tokenizer.config.items() if k not in PATH_FIELDS}
    info["tokenizer_class"] = str(tokenizer.config.get("tokenizer_class") or "Tokenizer")
    if tokenizer.template_source is not None:
        info["chat_template"] = tokenizer.template_source
    return info


def _json_safe(value: Any) -> Any:
    """An added token (``{"content": ...}``, transformers' ``AddedToken``) as its text, as
    vLLM's ``TokenizerInfo._make_json_serializable`` does."""
    if isinstance(value, dict):
        added = "special" in value or value.get("__type") == "AddedToken"
        if added and isinstance(value.get("content"), str):
            return value["content"]
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value
