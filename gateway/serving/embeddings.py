"""``/v1/embeddings``: inputs to token ids, and the embedding events to OpenAI's response."""

from __future__ import annotations

import base64
import struct

from gateway.catalog.served_models import ServedModel
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.responses import Json
from gateway.openai.schemas import EmbeddingRequest
from gateway.serving import limits
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
    limits.check_prompts_fit(inputs, model, "input", indexed=len(inputs) > 1)
    prompts: list[list[int]] = []
    for position, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{position}]"
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"{where} is an empty string", param=where)
            ids = model.tokenizer.encode(item, add_special_tokens=True)
        else:
            if not item:
                raise InvalidRequest(f"{where} is an empty token list", param=where)
            _check_vocabulary(item, model, where)
            ids = item
        if len(ids) > model.max_model_len:
            raise ContextLengthExceeded(
                f"{where} has {len(ids)} tokens; `{model.name}` embeds at most "
                f"{model.max_model_len}",
                param=where,
            )
        prompts.append(ids)
    return prompts


def _check_vocabulary(ids: list[int], model: ServedModel, where: str) -> None:
    size = model.tokenizer.vocab_size()
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
        raise InvalidRequest(
            f"{where} holds token id {bad}, outside the vocabulary (0..{size - 1})", param=where
        )


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
