"""Responses API input -> the chat request the chat path already serves.

One translation point: the history (a stored chain's items, then this request's input)
becomes chat messages, Responses' flat function tools become chat tools, ``text.format``
becomes ``response_format`` and ``max_output_tokens`` the completion budget.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.openai.responses_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageContent,
    InputContent,
    InputItem,
    MessageItem,
    NamedFunction,
    ResponsesRequest,
    TextFormat,
)
from gateway.openai.schemas import (
    AssistantToolCall,
    ChatCompletionRequest,
    ChatMessage,
    ChosenFunction,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImagePart,
    ImageUrl,
    JsonSchemaSpec,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolDefinition,
)
from shared.errors import InvalidRequest, UnsupportedParameter

_REFUSED = {
    "conversation": "conversations are not supported; use previous_response_id",
    "include": "include is not supported",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses",
    "max_tool_calls": "max_tool_calls is not supported",
    "stream_options": "stream_options is not supported on /v1/responses",
}


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Known OpenAI fields this server cannot honour: a 400 naming the field."""
    for name, why in _REFUSED.items():
        if getattr(body, name) not in (None, False, []):
            raise UnsupportedParameter(why, param=name)
    if body.background and not body.store:
        raise InvalidRequest(
            "background responses must be stored: set store=true", param="background"
        )
    for item in body.input_items():
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            for part in item.content:
                if isinstance(part, ImageContent) and part.image_url is None:
                    raise UnsupportedParameter(
                        "input_image needs image_url (file_id is not supported)",
                        param="input",
                    )


def chat_request(body: ResponsesRequest, history: Sequence[InputItem]) -> ChatCompletionRequest:
    """The chat request that answers ``body`` after ``history`` (earlier turns' items)."""
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    for item in [*history, *body.input_items()]:
        _append(messages, item)
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text.format if body.text else None),
        user=body.user,
        prompt_cache_key=body.prompt_cache_key,
    )


def _append(messages: list[ChatMessage], item: InputItem) -> None:
    if isinstance(item, MessageItem):
        messages.append(_message(item))
    elif isinstance(item, FunctionCallItem):
        call = AssistantToolCall(
            id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
        )
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _text(item.output)
        messages.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
    # reasoning items: not sent back to the model


def _message(item: MessageItem) -> ChatMessage:
    if isinstance(item.content, str):
        return ChatMessage(role=item.role, content=item.content)
    if item.role != "user":  # only a user's message carries images in chat
        return ChatMessage(role=item.role, content=_text(item.content))
    parts: list[ContentPart] = [
        ImagePart(
            type="image_url", image_url=ImageUrl(url=part.image_url or "", detail=part.detail)
        )
        if isinstance(part, ImageContent)
        else TextPart(type="text", text=part.text)
        for part in item.content
    ]
    return ChatMessage(role="user", content=parts)


def _text(parts: list[InputContent]) -> str:
    return "".join(part.text for part in parts if not isinstance(part, ImageContent))


def _tools(body: ResponsesRequest) -> list[ToolDefinition] | None:
    if not body.tools:
        return None
    return [
        ToolDefinition(
            type="function",
            function=FunctionDefinition(
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            ),
        )
        for tool in body.tools
    ]


def _tool_choice(body: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        return NamedToolChoice(type="function", function=ChosenFunction(name=choice.name))
    return choice


def _response_format(fmt: TextFormat | None) -> ResponseFormat | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    spec = JsonSchemaSpec.model_validate(
        {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    )
    return ResponseFormat(type="json_schema", json_schema=spec)
