"""``/v1/embeddings``: inputs to token ids, and the embedding events to OpenAI's response."""

from __future__ import annotations

import base64
import struct

from gateway.catalog.served_models import ServedModel
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.responses import Json
from gateway.openai.schemas import EmbeddingRequest
from gateway.serving import prompts
from shared.errors import ContextLengthExceeded, InvalidRequest, RemoteError
from shared.protocol import EmbeddingEvent, ErrorEvent


def embedding_inputs(request: EmbeddingRequest) -> list[str | list[int]]:
    try:
        return request.inputs()
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="input") from exc


def input_token_ids(request: EmbeddingRequest, model: ServedModel) -> list[list[int]]:
    """Each input tokenized with the model's special tokens; empty or too long is a 400."""
    inputs = embedding_inputs(request)
    indexed = len(inputs) > 1
    token_lists = prompts.token_lists(inputs, model, "input", indexed=indexed)
    for position, ids in enumerate(token_lists):
        if len(ids) > model.max_model_len:
            where = f"input[{position}]" if indexed else "input"
            raise ContextLengthExceeded(
                f"{where} has {len(ids)} tokens; `{model.name}` embeds at most "
                f"{model.max_model_len}",
                param=where,
            )
    return token_lists


async def collect_embeddings(
    handle: RequestHandle, request: EmbeddingRequest, model_name: str
) -> Json:
    """Every input's embedding, in input order; raises the first error a worker reported."""
    vectors: dict[int, EmbeddingEvent] = {}
    async for event in handle.events():
        if isinstance(event, EmbeddingEvent):
            vectors[event.index] = event
        elif isinstance(event, ErrorEvent):
            raise RemoteError(event)
    ordered = [vectors[index] for index in sorted(vectors)]
    prompt_tokens = sum(event.prompt_tokens for event in ordered)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": event.index,
                "embedding": _encode(event.vector, request.encoding_format),
            }
            for event in ordered
        ],
        "model": model_name,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encode(vector: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # float32 little-endian, as OpenAI sends it
        return base64.b64encode(vector).decode()
    return list(struct.unpack(f"<{len(vector) // 4}f", vector))
