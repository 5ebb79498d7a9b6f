"""workers.engines.vision.encoder without vLLM: the wire format, vLLM's input shapes, and the
encoder against transformers' full model on the tiny demo models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.demo.model import write_demo_model
from workers.engines.vision.encoder import (
    ImageEmbedding,
    VisionEncoder,
    to_vllm_input,
    vision_family,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=60, deadline=None, database=None)
@given(
    tokens=st.integers(1, 40),
    hidden=st.integers(1, 64),
    dtype=st.sampled_from(DTYPES),
    grid=st.none() | st.tuples(st.integers(1, 4), st.integers(1, 64), st.integers(1, 64)),
    seed=st.integers(0, 2**31),
)
def test_bytes_round_trip(
    tokens: int, hidden: int, dtype: torch.dtype, grid: tuple[int, int, int] | None, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    embeds = (torch.randn(tokens, hidden, generator=gen) * 100).to(dtype)
    embedding = ImageEmbedding(embeds, grid)
    back = ImageEmbedding.from_bytes(embedding.to_bytes())
    assert back.embeds.dtype == dtype and back.grid_thw == grid
    assert torch.equal(back.embeds, embeds)
    assert back.nbytes == embedding.nbytes == tokens * hidden * embeds.element_size()
    assert len(embedding.to_bytes()) < embedding.nbytes + 100


def test_bytes_are_little_endian_float32() -> None:
    blob = ImageEmbedding(torch.tensor([[1.0, -2.0]]), (1, 2, 2)).to_bytes()
    assert blob.endswith(b"\x00\x00\x80\x3f\x00\x00\x00\xc0")
    assert blob.startswith(b"CVEMB\x01")


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"pickle!" * 4,
        ImageEmbedding(torch.zeros(2, 3)).to_bytes()[:-1],  # truncated
        ImageEmbedding(torch.zeros(2, 3)).to_bytes() + b"\x00",
        ImageEmbedding(torch.zeros(2, 3)).to_bytes().replace(b"float32", b"float64"),
        ImageEmbedding(torch.zeros(2, 3)).to_bytes().replace(b"CVEMB\x01", b"CVEMB\x02"),
        ImageEmbedding(torch.zeros(2, 3)).to_bytes().replace(b"[2,3]", b"[3,2,1]"),
        ImageEmbedding(torch.zeros(1, 1)).to_bytes().replace(b"[1,1]", b"[0,1]")[:-4],
    ],
)
def test_malformed_bytes(blob: bytes) -> None:
    with pytest.raises(ValueError):
        ImageEmbedding.from_bytes(blob)


def test_empty_embedding_is_refused() -> None:
    with pytest.raises(ValueError):
        ImageEmbedding(torch.zeros(0, 8)).to_bytes()


def test_to_vllm_input() -> None:
    a = ImageEmbedding(torch.ones(4, 8), (1, 4, 4))
    b = ImageEmbedding(torch.zeros(9, 8), (1, 6, 6))
    llava = to_vllm_input([a, b], "llava")
    assert [tuple(t.shape) for t in llava] == [(4, 8), (9, 8)]
    qwen = to_vllm_input([a, b], "qwen2_vl")
    assert tuple(qwen["image_embeds"].shape) == (13, 8)
    assert qwen["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 6]]
    assert qwen["image_grid_thw"].dtype == torch.int64
    with pytest.raises(ValueError):
        to_vllm_input([ImageEmbedding(torch.ones(4, 8))], "qwen2_vl")
    with pytest.raises(ValueError):
        to_vllm_input([a], "pixtral")
    with pytest.raises(ValueError):
        to_vllm_input([], "llava")


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind = str(request.param)
    return write_demo_model(tmp_path_factory.mktemp("vision") / kind, kind=kind)


def _pictures() -> list[Any]:
    from PIL import Image, ImageDraw

    red = Image.new("RGB", (64, 48), (220, 20, 20))
    ImageDraw.Draw(red).rectangle((8, 8, 30, 30), fill=(35, 40, 200))
    green = Image.new("L", (80, 80), 120)  # not RGB: converted
    return [red, green]


def test_encoder_matches_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    encoder = VisionEncoder.load(str(model_dir))
    family = {"llava": "llava", "qwen2-vl": "qwen2_vl"}[model_dir.name]
    assert encoder.family == vision_family(str(model_dir)) == family
    model: Any = AutoModelForImageTextToText.from_pretrained(str(model_dir))
    processor: Any = AutoProcessor.from_pretrained(str(model_dir))  # type: ignore[no-untyped-call]
    model.eval()
    shapes = []
    for image in _pictures():
        embedding = encoder.encode(image)
        assert embedding.embeds.dtype == torch.float32 and embedding.embeds.is_contiguous()
        inputs = processor.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            reference = model.get_image_features(**inputs).pooler_output[0]
        assert torch.allclose(embedding.embeds, reference, rtol=1e-5, atol=1e-4)
        shapes.append((tuple(embedding.embeds.shape), embedding.grid_thw))
    if family == "llava":
        assert shapes == [((64, 256), None), ((64, 256), None)]
    else:
        assert shapes == [((4, 256), (1, 4, 4)), ((9, 256), (1, 6, 6))]
    # Different images, different embeddings.
    a, b = (encoder.encode(image).embeds for image in _pictures())
    assert a.shape != b.shape or not torch.allclose(a, b)


def test_text_model_has_no_vision_family(tmp_path: Path) -> None:
    llama = write_demo_model(tmp_path / "llama")
    assert vision_family(str(llama)) is None
    with pytest.raises(ValueError, match="not a vision-language model"):
        VisionEncoder.load(str(llama))


def test_import_is_light() -> None:
    code = (
        "import sys, workers.engines.vision.encoder\n"
        "heavy = {'torch', 'transformers', 'PIL', 'vllm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
