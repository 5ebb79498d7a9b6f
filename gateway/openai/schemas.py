"""The OpenAI wire schema for requests (the gateway's vocabulary).

Unknown fields are accepted and ignored (logged once per field name, within the bounds of
gateway/openai/unknown_fields.py), so clients that send extras, like LangChain, keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

MAX_STOP_SEQUENCES = 32
MAX_STOP_CHARS = 256
"""vLLM holds back this many characters of a stream while it looks for a stop string."""
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 300
"""Entries of ``logit_bias`` (each costs the sampler work on every step)."""
LOGIT_BIAS_RANGE = 100.0
MAX_TOKEN_ID_LIST = 1024
"""Entries of ``stop_token_ids`` and ``allowed_token_ids``."""
MAX_CONSTRAINT_CHARS = 16 * 1024
"""A ``structured_outputs`` regex, grammar or structural tag, or all its choices together:
each job of the request carries it (``n`` copies on the job stream)."""
MAX_CHOICES = 256
_INT32_MAX = 2**31 - 1


def _valid_unicode(text: str) -> str:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer, encoder
    or response can take: refused here, naming the field."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "text holds an unpaired UTF-16 surrogate (not valid Unicode)"
            ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _cache_salt(salt: str) -> str:
    """vLLM's rule (``validate_cache_salt``): non-empty, at most 128 characters, none of
    ``@ / \\`` or NUL."""
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS or _CACHE_SALT_FORBIDDEN & set(salt):
        raise ValueError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
            "characters without '@', '/', '\\' or NUL"
        )
    return salt


StopSequence = Annotated[Text, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
LogitBias = Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE, allow_inf_nan=False)]


MAX_PROMPT_CACHE_KEY_CHARS = 1024
CacheKey = Annotated[Text, Field(min_length=1, max_length=MAX_PROMPT_CACHE_KEY_CHARS)]
"""OpenAI's ``prompt_cache_key`` (chat, completions, responses)."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: usage on every chunk (with ``include_usage``)."""


class JsonSchemaSpec(_Lenient):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        missing = self.json_schema is None or not self.json_schema.schema_
        if self.type == "json_schema" and missing:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


Constraint = Annotated[Text, StringConstraints(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]
TokenIds = Annotated[
    list[Annotated[int, Field(ge=0, le=_INT32_MAX)]], Field(max_length=MAX_TOKEN_ID_LIST)
]


class StructuredOutputs(_Lenient):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``): exactly one of
    ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or ``structural_tag``."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    """A JSON schema, as an object or as JSON text (capped as response_format's)."""
    regex: Constraint | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Constraint | None = None
    json_object: bool | None = None
    structural_tag: Constraint | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputs:
        kinds = [name for name in CONSTRAINT_KINDS if self.kind_value(name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag (got {', '.join(kinds) or 'none'})"
            )
        if self.regex is not None and "\x00" in self.regex:
            raise ValueError("structured_outputs.regex must not contain a NUL character")
        if self.choice is not None and sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"structured_outputs.choice holds over {MAX_CONSTRAINT_CHARS} characters"
            )
        return self

    def kind_value(self, name: str) -> Any:
        return self.json_ if name == "json" else getattr(self, name)

    def kind(self) -> str:
        return next(n for n in CONSTRAINT_KINDS if self.kind_value(n) not in (None, False))


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class TextPart(_Lenient):
    type: Literal["text"]
    text: Text


class ImageUrl(_Lenient):
    url: Text
    detail: str | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


MAX_TOOLS = 128
FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"
FunctionName = Annotated[str, StringConstraints(pattern=FUNCTION_NAME)]


class FunctionDefinition(_Lenient):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema (size and depth are capped in gateway/serving/tool_choice.py)."""
    strict: bool | None = None


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Lenient):
    name: FunctionName


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: ChosenFunction


class FunctionCall(_Lenient):
    name: FunctionName
    arguments: Text
    """JSON text, as the model wrote it."""


class AssistantToolCall(_Lenient):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Text
    """``system``, ``developer``, ``user``, ``assistant``, ``tool``, or any other role the
    chat template renders (vLLM's custom roles)."""
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(max_length=MAX_TOOLS)] | None = None
    """An assistant's earlier calls (a multi-turn agent loop)."""
    tool_call_id: Text | None = None
    """A ``tool`` message: the call it answers."""

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        """Only an assistant message (its earlier tool calls) may leave ``content`` out or
        null, as at OpenAI."""
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"the content of a {self.role} message must be a string or an array of "
                "content parts, not null"
            )
        return self


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions. Floats refuse NaN and infinity, which
    Python's JSON parser accepts."""

    model: Text
    max_tokens: int | None = Field(None, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    stop: (
        StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None
    ) = None
    logit_bias: dict[int, LogitBias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    """Token id -> bias added to its logit (-100..100); ids are checked against the vocabulary."""
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    return_token_ids: bool = False
    """Extension (as in vLLM's server): each choice carries its generated token ids."""
    structured_outputs: StructuredOutputs | None = None
    stop_token_ids: TokenIds | None = None
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1)] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT32_MAX)
    """Keep only N prompt tokens (-1: the model's context window), as vLLM."""
    truncation_side: Literal["left", "right"] | None = None
    """``left`` (default) keeps the last N tokens, ``right`` the first N."""
    use_beam_search: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """vLLM's: each prompt token's logprob and its top-k alternatives (not streamed)."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprob tokens written as ``token_id:N`` (for tokens that are not text)."""
    cache_salt: Annotated[Text, AfterValidator(_cache_salt)] | None = None
    """Isolates the request's prefix-cache entries: only requests with the same salt share
    them (vLLM's rule for the value)."""
    skip_special_tokens: bool = True
    """vLLM's: false keeps special tokens in the output text."""
    prompt_cache_key: CacheKey | None = None
    """OpenAI's: requests sharing a long prefix send one key; placement keeps them on the
    worker that caches it (an affinity hint, never a promise)."""
    # Removed from vLLM (its server now ignores them with a warning): refused here.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    user: Text | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """vLLM's rule: ``continuous_usage_stats`` counts only with ``include_usage``."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: more variables for the chat template (``enable_thinking``, ...)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the last message is left open and the model continues it."""
    echo: bool = False
    """vLLM's: the last message's content starts the answer when it has the answer's role."""
    # Known OpenAI fields this server cannot honour yet: declared so they are refused
    # (gateway/serving/translate.py::refuse_unsupported) rather than silently ignored.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self

    def echoed(self) -> str | None:
        """vLLM's chat ``echo``: the last message's text, when its role is the answer's
        (``assistant``, or with ``add_generation_prompt: false`` the last message's own)."""
        if not self.echo:
            return None
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return None
        content = last.content
        if isinstance(content, list):
            return "\n".join(part.text for part in content if isinstance(part, TextPart))
        return content or None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=_INT32_MAX)
    """0 (with ``echo``): the prompt alone is answered, scored with ``logprobs``."""
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def echo_only(self) -> bool:
        """vLLM's ``echo`` with ``max_tokens: 0``: one token is generated and dropped."""
        return self.echo and self.max_tokens == 0

    def prompt_logprobs_k(self) -> int | None:
        """vLLM's rule: ``echo`` scores the prompt with ``logprobs`` alternatives."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    def token_budget(self) -> int | None:
        return 1 if self.echo_only() else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Normalize the four OpenAI prompt shapes to a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


def known_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields) | frozenset(
        f.alias for f in model.model_fields.values() if f.alias
    )


MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Lenient):
    """``POST /v1/embeddings``: a string, a list of strings, token ids, or lists of them."""

    model: Text
    input: Text | list[Text] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=_INT32_MAX)
    user: Text | None = None

    def inputs(self) -> list[str | list[int]]:
        """Normalize the four input shapes to a list of inputs."""
        value = self.input
        if isinstance(value, str):
            items: list[str | list[int]] = [value]
        elif value and all(isinstance(item, int) for item in value):
            items = [list(value)]  # type: ignore[arg-type]
        else:
            items = list(value)  # type: ignore[arg-type]
        if not items:
            raise ValueError("input must not be empty")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input accepts at most {MAX_EMBEDDING_INPUTS} items")
        return items
