"""The Responses API request (``POST /v1/responses``): OpenAI's field names and shapes.

Only what the chat path can honour is declared with a meaning; the other known
OpenAI fields are declared so that they are refused by name (a 400), never ignored
(:func:`gateway.serving.responses_input.refuse_unsupported`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gateway.openai.schemas import MAX_TOOLS, CacheKey, FunctionName, Text, _Lenient

_INT32_MAX = 2**31 - 1
MAX_INPUT_ITEMS = 2048
MAX_METADATA = 16


class TextContent(_Lenient):
    type: Literal["input_text", "output_text"]
    text: Text


class ImageContent(_Lenient):
    type: Literal["input_image"]
    image_url: Text | None = None
    detail: str | None = None
    file_id: str | None = None


InputContent = Annotated[TextContent | ImageContent, Field(discriminator="type")]


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputContent]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: Text
    name: FunctionName
    arguments: Text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputContent]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Lenient):
    """An earlier turn's reasoning: kept in the history, not sent to the model (as the
    chat templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionTool(_Lenient):
    """Responses' flat function tool."""

    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: Text
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    metadata: dict[str, Text] | None = Field(None, max_length=MAX_METADATA)
    user: Text | None = None
    prompt_cache_key: CacheKey | None = None
    store: bool = True
    previous_response_id: Text | None = None
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Known OpenAI fields this server cannot honour yet: refused by name.
    background: bool | None = None
    conversation: Any = None
    include: list[str] | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    stream_options: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _typed_messages(cls, value: Any) -> Any:
        """OpenAI's easy input message leaves ``type`` out."""
        if isinstance(value, list):
            return [
                {**item, "type": "message"}
                if isinstance(item, dict) and "type" not in item
                else item
                for item in value
            ]
        return value

    def input_items(self) -> list[InputItem]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
