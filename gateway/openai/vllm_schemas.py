"""vLLM's own endpoints beside the OpenAI ones (``vllm serve`` answers them too): the
request and response bodies of /tokenize, /detokenize, /tokenizer_info, /version, /load,
/is_sleeping and the model card's ``permission``, field for field as vLLM's
``entrypoints/serve/*/protocol.py`` and ``serve/engine/protocol.py`` define them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from gateway.openai.schemas import MAX_TOOLS, ChatMessage, Text, ToolDefinition

_INT64_MAX = 2**63 - 1


class _VllmBody(BaseModel):
    """Unknown fields are accepted and ignored, as vLLM's ``OpenAIBaseModel`` does."""

    model_config = ConfigDict(extra="allow")


class TokenizeCompletionRequest(_VllmBody):
    model: Text | None = None
    """None: the server's (first) model, as in vLLM."""
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_VllmBody):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    """Special tokens on top of those the chat template writes (vLLM's default: none)."""
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    """Declared to be refused (a 400): the model's own template renders every prompt."""
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self


_CHAT, _PROMPT = "tokenize[messages]", "tokenize[prompt]"
"""Branch names with ``[``: the error funnel leaves them out of an error's ``param``."""


def _tokenize_kind(body: Any) -> str:
    """vLLM tells the two bodies apart by which one validates; here by ``messages`` (so
    that a bad chat body gets its own error, not "prompt is missing")."""
    if isinstance(body, dict):
        return _CHAT if "messages" in body else _PROMPT
    return _CHAT if hasattr(body, "messages") else _PROMPT


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag(_CHAT)] | Annotated[TokenizeCompletionRequest, Tag(_PROMPT)],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_VllmBody):
    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT64_MAX)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission entry of a model card."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """vLLM's card (OpenAI's fields, then vLLM's) and Conveyor's ``kind``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])
    kind: str
    """Conveyor's: ``generate`` (chat and completions) or ``embed``."""
