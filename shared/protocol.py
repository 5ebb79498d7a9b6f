"""The internal message protocol: every message that crosses a process boundary.

Named by pipeline stage: the gateway sends a :class:`GenerateJob` down a job
stream; a worker sends :class:`TokenEvent` / :class:`FinishEvent` /
:class:`ErrorEvent` back on the gateway's reply stream; :class:`CancelCommand`
and :class:`WorkerCommand` travel on the command channel (a worker answers the latter
with a :class:`WorkerCommandResult`). Messages are frozen msgspec structs encoded as
MessagePack (never pickled) and carry a protocol version.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from shared.errors import ProtocolError
from shared.roles import Role

PROTOCOL_VERSION: Final = 1
VERSION: Final = b"%d" % PROTOCOL_VERSION
"""The version field's value, as every writer sends it (the journal's and the admission's
Lua scripts get it as an argument)."""
VERSION_FIELD: Final = b"v"
PAYLOAD_FIELD: Final = b"m"
EVENTS_FIELD: Final = b"e"
"""A reply-stream entry holding a MessagePack array of events (one engine step's worth)."""


# --------------------------------------------------------------------------- jobs


class SamplingOptions(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """What the engine needs to sample one sequence (OpenAI names, engine semantics).

    Encoded as a map with defaults omitted: a new field takes a default (and goes at the
    end), so messages written before it still decode, without a protocol version bump.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    """Top-k alternatives per sampled token (0 = only the sampled token's logprob)."""
    prompt_logprobs: int | None = None
    """Top-k alternatives per prompt token (vLLM's ``prompt_logprobs``): the first event of
    the sequence carries them."""
    json_schema: str | None = None
    """JSON schema (serialized) the output must follow."""
    json_object: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit before sampling (OpenAI's -100..100)."""
    json_schema_stored: bool = False
    """``json_schema`` is stored once per request, apart from its jobs (in Redis under
    ``names.json_schema(request_id)``, see shared/queue/job_queue.py): the job stream
    carries the job without it, and the job queue fills it in when a worker reads the job."""
    regex: str | None = None
    """A regular expression (xgrammar's dialect) the output must match."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A grammar (EBNF, or Lark) the output must follow."""
    structural_tag: str | None = None
    """An xgrammar structural tag (JSON text)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens may be sampled."""
    cache_salt: str | None = None
    """The prompt shares prefix-cache entries only with prompts of the same salt."""


def is_guided(sampling: SamplingOptions) -> bool:
    """Structured output: a grammar constrains every token."""
    return (
        sampling.json_schema is not None
        or sampling.json_object
        or sampling.json_schema_stored
        or constraint_kind(sampling) is not None
    )


def constraint_kind(sampling: SamplingOptions) -> str | None:
    """The grammar constraint beyond JSON (``regex``, ``choice``, ``grammar`` or
    ``structural_tag``) that ``sampling`` carries, if any."""
    for kind in ("regex", "choice", "grammar", "structural_tag"):
        if getattr(sampling, kind) is not None:
            return kind
    return None


def without_stored_schema(job: Job) -> Job:
    """``job`` as its stream carries it: without a schema that is stored apart."""
    if not isinstance(job, GenerateJob) or not job.sampling.json_schema_stored:
        return job
    if job.sampling.json_schema is None:
        return job
    sampling = msgspec.structs.replace(job.sampling, json_schema=None)
    return msgspec.structs.replace(job, sampling=sampling)


def is_deterministic(sampling: SamplingOptions) -> bool:
    """The same prompt gives the same tokens again: greedy, or sampled with a seed."""
    return sampling.temperature == 0 or sampling.seed is not None


class ImageRef(msgspec.Struct, frozen=True, array_like=True):
    """One image of a prompt, named by the SHA-256 of its bytes (see shared/images.py)."""

    digest: str
    nbytes: int


class GenerateJob(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag_field="kind", tag="generate"
):
    """One sequence to generate. ``n`` choices are ``n`` jobs sharing a request_id."""

    request_id: str
    index: int
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    reply_to: str
    deadline_unix: float
    created_unix: float
    handoff: dict[str, Any] | None = None
    """Disaggregated decode: where the prefilled KV cache is (engine-specific, JSON-safe)."""
    images: tuple[ImageRef, ...] = ()
    """The prompt's images, in the order of its (unexpanded) image placeholders."""
    images_encoded: bool = False
    """An encode worker stored the images' embeddings: use those, not the raw images."""
    after_encode: Role | None = None
    """Encode stage: the role (stage) the job goes to once its images are encoded."""
    adapter: str | None = None
    """The LoRA adapter to run with (its registered name; ``model`` is that name too, so
    the job travels on the adapter's own streams: see shared/queue/lora_registry.py)."""
    started_unix: float | None = None
    """When the job's first stage (encode, prefill) began it: the stage that forwards it
    sets this, so the last stage reports the request's queue time, not its own."""
    traceparent: str | None = None
    """The request's W3C trace context (its gateway span): a worker's spans for this job
    join that trace (shared/tracing). None: the gateway does not trace."""
    cached_tokens: int = 0
    """The prompt tokens the gateway found cached on the worker it placed the job on (0:
    not placed by cache): that worker counts only the rest as its queued prefill."""

    @property
    def job_id(self) -> str:
        return f"{self.request_id}/{self.index}"

    @property
    def uncached_tokens(self) -> int:
        """The prompt tokens its worker has to compute, as far as the gateway knew."""
        return max(0, len(self.prompt_token_ids) - self.cached_tokens)


class EmbedJob(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag_field="kind", tag="embed"
):
    """One input to embed (``/v1/embeddings``): a list input is one job per item."""

    request_id: str
    index: int
    model: str
    prompt_token_ids: list[int]
    reply_to: str
    deadline_unix: float
    created_unix: float
    dimensions: int | None = None
    """Matryoshka truncation, for models that support it."""
    traceparent: str | None = None
    """As :attr:`GenerateJob.traceparent`."""

    @property
    def job_id(self) -> str:
        return f"{self.request_id}/{self.index}"

    @property
    def uncached_tokens(self) -> int:
        """As :attr:`GenerateJob.uncached_tokens` (an embedding job is never placed)."""
        return len(self.prompt_token_ids)


Job = GenerateJob | EmbedJob


def started_now(job: GenerateJob, now_unix: float) -> GenerateJob:
    """``job`` as a stage forwards it: stamped with when its first stage began it."""
    if job.started_unix is not None:
        return job
    return msgspec.structs.replace(job, started_unix=now_unix)


# ------------------------------------------------------------------------- events


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob]


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One entry of a prompt position's logprobs (vLLM's ``Logprob`` with its token id)."""

    token_id: int
    token: str
    logprob: float
    rank: int | None


PromptLogprobs = list[list[PromptLogprob] | None]
"""Per prompt position: the prompt token's entry first, then its top-k alternatives;
None for the first position (nothing precedes it)."""


class TokenEvent(msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="tok"):
    """New tokens of one sequence from one engine step."""

    request_id: str
    index: int
    seq: int
    attempt: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """With ``SamplingOptions.prompt_logprobs``: on the sequence's first event (a migrated
    run may send them again; they are the same, and the later copy replaces the first)."""


class FinishEvent(msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="fin"):
    """The sequence ended normally; the last event of a job.

    A field added later goes at the end with a default: a reader that knows it decodes
    arrays written before it (the default fills in), and one that does not ignores the
    extra trailing item, so no protocol version bump is needed.
    """

    request_id: str
    index: int
    seq: int
    attempt: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    """Prompt tokens served from the engine's prefix cache, where the engine reports it."""
    started_unix: float | None = None
    """When a worker first began the job (its first stage's start; vLLM's queue time is
    from the request's arrival to this)."""


class ErrorEvent(msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="err"):
    """The sequence failed; carries the OpenAI error the client should see."""

    request_id: str
    index: int
    seq: int
    attempt: int
    status: int
    type: str
    code: str | None
    message: str
    param: str | None = None


class EmbeddingEvent(msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="emb"):
    """The embedding of one input: its last (and only) event."""

    request_id: str
    index: int
    seq: int
    attempt: int
    vector: bytes
    """float32, little-endian (what ``encoding_format=base64`` sends as is)."""
    prompt_tokens: int


Event = TokenEvent | FinishEvent | ErrorEvent | EmbeddingEvent
FINAL_EVENTS = (FinishEvent, ErrorEvent, EmbeddingEvent)
"""A job's last event: one of these ends its sequence."""

# ------------------------------------------------------------------------ control


class CancelCommand(msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="cancel"):
    request_id: str


class WorkerCommand(msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="wcmd"):
    """An admin command for one worker (command channel); answered with a
    :class:`WorkerCommandResult` pushed onto ``keys.command_reply(command_id)``."""

    command_id: str
    worker_id: str
    command: str
    """A :class:`shared.queue.worker_commands.Command` value (a plain string on the wire, so a
    command a worker does not know is answered, not dropped as undecodable)."""
    timeout_s: float
    """How long the sender waits: the worker answers within it."""


class WorkerCommandResult(
    msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="wres"
):
    command_id: str
    worker_id: str
    status: str
    """A :class:`shared.queue.worker_commands.CommandStatus` value."""
    detail: str


Message = (
    GenerateJob
    | EmbedJob
    | TokenEvent
    | FinishEvent
    | ErrorEvent
    | EmbeddingEvent
    | CancelCommand
    | WorkerCommand
    | WorkerCommandResult
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_events_decoder = msgspec.msgpack.Decoder(list[Event])


def encode(message: Message) -> dict[bytes, bytes]:
    """Stream-entry fields for ``message``."""
    return {VERSION_FIELD: VERSION, PAYLOAD_FIELD: _encoder.encode(message)}


def encode_payload(message: Message) -> bytes:
    """The payload field alone (the version travels in its own field)."""
    return _encoder.encode(message)


def encode_bytes(message: Message) -> bytes:
    return VERSION + b":" + _encoder.encode(message)


def decode(fields: dict[bytes, bytes]) -> Message:
    version = fields.get(VERSION_FIELD)
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}")
    return _decode_payload(fields.get(PAYLOAD_FIELD, b""))


def encode_events(events: list[Event]) -> dict[bytes, bytes]:
    """Stream-entry fields for several events (workers build the same bytes in Lua)."""
    return {VERSION_FIELD: VERSION, EVENTS_FIELD: _encoder.encode(events)}


def decode_events(fields: dict[bytes, bytes]) -> list[Message]:
    """The messages of a reply-stream entry: a batch of events, or one message."""
    batch = fields.get(EVENTS_FIELD)
    if batch is None:
        return [decode(fields)]
    version = fields.get(VERSION_FIELD)
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}")
    try:
        events: list[Message] = list(_events_decoder.decode(batch))
        return events
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(str(exc)) from exc


def decode_bytes(data: bytes) -> Message:
    version, _, payload = data.partition(b":")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r}")
    return _decode_payload(payload)


def _decode_payload(payload: bytes) -> Message:
    try:
        message: Message = _decoder.decode(payload)
        return message
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(str(exc)) from exc
