"""Tests for shared.demo.model (no vLLM: only the generated files are checked)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.demo.model import (
    DEMO_MODEL_NOTICE,
    MARKER_FILE,
    is_demo_model,
    write_demo_model,
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)


def _digests(path: Path) -> dict[str, tuple[str, int]]:
    """File name -> (sha256, mtime_ns) for every file in ``path``."""
    return {
        f.name: (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
        for f in sorted(path.iterdir())
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_layout_and_marker(model_dir: Path) -> None:
    for name in MODEL_FILES:
        assert (model_dir / name).is_file(), name
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    assert marker == {"kind": "llama", "version": 1, "seed": 0}
    assert is_demo_model(model_dir)
    # Small, and no temp dirs left next to the target.
    size = sum(f.stat().st_size for f in model_dir.iterdir())
    assert size < 32 * 1024 * 1024
    assert [p.name for p in model_dir.parent.iterdir()] == ["model"]


def test_idempotent(model_dir: Path) -> None:
    before = _digests(model_dir)
    t0 = time.perf_counter()
    assert write_demo_model(model_dir, seed=0) == model_dir
    assert time.perf_counter() - t0 < 0.5
    assert _digests(model_dir) == before


def test_deterministic_and_reseed(model_dir: Path, tmp_path: Path) -> None:
    other = write_demo_model(tmp_path / "again", seed=0)
    for name in MODEL_FILES:
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name

    # A different seed replaces the old demo model in place: new weights, same tokenizer.
    write_demo_model(other, seed=1)
    assert json.loads((other / MARKER_FILE).read_text())["seed"] == 1
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (model_dir / weights).read_bytes()
    tok = "tokenizer.json"
    assert (other / tok).read_bytes() == (model_dir / tok).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_refuses_to_clobber_foreign_dir(tmp_path: Path) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "weights.bin").write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        write_demo_model(target)
    assert (target / "weights.bin").read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_config(model_dir: Path, tokenizer: Any) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    assert cfg.model_type == "llama"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim >= 64
    assert cfg.hidden_size == cfg.num_attention_heads * head_dim
    assert cfg.vocab_size >= len(tokenizer)
    assert cfg.vocab_size % 64 == 0
    assert cfg.tie_word_embeddings is False
    assert cfg.max_position_embeddings == 2048

    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("</s>", "<|im_end|>")]
    assert cfg.eos_token_id == eos
    assert cfg.bos_token_id == tokenizer.bos_token_id
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == eos
    raw = json.loads((model_dir / "config.json").read_text())
    assert (raw.get("dtype") or raw.get("torch_dtype")) == "float32"


def test_weights_float32(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
        for name in names:
            assert str(f.get_slice(name).get_dtype()) == "F32", name


def test_special_tokens(tokenizer: Any) -> None:
    assert tokenizer.bos_token == "<s>"
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.unk_token == "<unk>"
    assert tokenizer.pad_token == "<pad>"
    for tok in ("<|im_start|>", "<|im_end|>"):
        ids = tokenizer.encode(tok, add_special_tokens=False)
        assert len(ids) == 1
        assert tok in tokenizer.all_special_tokens
    ids = tokenizer.encode("hello world")
    assert ids[0] == tokenizer.bos_token_id
    assert len(tokenizer) <= 4096 + 64


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello, world!",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n",
        "héllo wörld — “quotes” 日本語 中文 한국어 العربية עברית",
        "emoji 🎉👩‍👩‍👧 and ZWJ \u200d and nbsp\u00a0",
        "\x00\x01\x7f control chars",
        "def f(x):\n    return x ** 2  # code\n",
        "<|im_start|>user\nliteral chat tokens<|im_end|> <s> </s>",
    ],
)
def test_round_trip_examples(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=st.text(max_size=200))
def test_round_trip_unicode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.unk_token_id not in ids


def test_chat_template(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}],
        },
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nOne\nTwo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert prompt.startswith(no_gen)
    assert no_gen.endswith("<|im_end|>\n")

    ids = tokenizer.encode(prompt, add_special_tokens=False)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(im_start) == 5


def test_notice() -> None:
    assert "random" in DEMO_MODEL_NOTICE.lower()
    assert "conveyor up --model" in DEMO_MODEL_NOTICE
    assert "CONVEYOR_MODEL=" in DEMO_MODEL_NOTICE
    assert "\n" not in DEMO_MODEL_NOTICE


def test_import_is_light() -> None:
    code = (
        "import sys, shared.demo.model\n"
        "heavy = {'torch', 'transformers', 'tokenizers', 'vllm'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- vision-language demo models ----------------------------------------------------------

VISION_FILES = (
    *MODEL_FILES,
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
)
PLACEHOLDER = {
    "llava": "<image>",
    "qwen2-vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
IMAGE_TOKEN = {"llava": "<image>", "qwen2-vl": "<|image_pad|>"}


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def vision_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind = str(request.param)
    return write_demo_model(tmp_path_factory.mktemp("vision") / kind, kind=kind)


def _kind(path: Path) -> str:
    return str(json.loads((path / MARKER_FILE).read_text())["kind"])


def test_vision_layout_and_marker(vision_dir: Path) -> None:
    kind = vision_dir.name
    for name in VISION_FILES:
        assert (vision_dir / name).is_file(), name
    marker = json.loads((vision_dir / MARKER_FILE).read_text())
    assert marker == {"kind": kind, "version": 1, "seed": 0}
    assert is_demo_model(vision_dir) and is_demo_model(vision_dir, kind)
    assert not is_demo_model(vision_dir, "llama")
    size = sum(f.stat().st_size for f in vision_dir.iterdir())
    assert size < 32 * 1024 * 1024
    assert [p.name for p in vision_dir.parent.iterdir()] == [kind]


def test_vision_idempotent_per_kind(vision_dir: Path, tmp_path: Path) -> None:
    kind = vision_dir.name
    before = _digests(vision_dir)
    t0 = time.perf_counter()
    assert write_demo_model(vision_dir, kind=kind) == vision_dir
    assert time.perf_counter() - t0 < 0.5
    assert _digests(vision_dir) == before

    # Same seed, same bytes; another kind replaces the folder (the marker says which).
    other = write_demo_model(tmp_path / "m", kind=kind)
    weights = "model.safetensors"
    assert (other / weights).read_bytes() == (vision_dir / weights).read_bytes()
    write_demo_model(other, kind="llama")
    assert _kind(other) == "llama" and not (other / "preprocessor_config.json").exists()
    write_demo_model(other, kind=kind)
    assert _kind(other) == kind
    assert (other / weights).read_bytes() == (vision_dir / weights).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown demo model kind"):
        write_demo_model(tmp_path / "x", kind="gpt")
    assert list(tmp_path.iterdir()) == []


def test_vision_config_and_tokens(vision_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    kind = vision_dir.name
    cfg = AutoConfig.from_pretrained(str(vision_dir))
    tok = AutoTokenizer.from_pretrained(str(vision_dir))
    text = cfg.text_config
    assert text.hidden_size == 256 and text.num_hidden_layers == 2
    assert text.hidden_size // text.num_attention_heads >= 64
    assert text.vocab_size >= len(tok) and text.vocab_size % 64 == 0
    image_id = cfg.image_token_index if kind == "llava" else cfg.image_token_id
    assert image_id == tok.convert_tokens_to_ids(IMAGE_TOKEN[kind])
    assert tok.encode(PLACEHOLDER[kind], add_special_tokens=False).count(image_id) == 1
    # The text vocabulary is the Llama demo's: image tokens come after it.
    assert tok.convert_tokens_to_ids("<|im_end|>") == 5
    assert image_id >= 4096
    raw = json.loads((vision_dir / "config.json").read_text())
    assert "image_token_id" in raw or "image_token_index" in raw  # what the gateway reads


def test_vision_weights_use_names_vllm_loads(vision_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(vision_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in names:
            assert str(f.get_slice(name).get_dtype()) == "F32", name
    if vision_dir.name == "llava":
        assert {
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "multi_modal_projector.linear_1.weight",
            "language_model.model.embed_tokens.weight",
            "language_model.lm_head.weight",
        } <= names
        assert not [n for n in names if n.startswith("model.")]
    else:
        assert {
            "model.visual.patch_embed.proj.weight",
            "model.visual.merger.mlp.0.weight",
            "model.language_model.embed_tokens.weight",
            "lm_head.weight",
        } <= names


def test_vision_transformers_loads_every_weight(vision_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    loaded: Any = AutoModelForImageTextToText.from_pretrained(
        str(vision_dir), output_loading_info=True
    )
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (
        type(model).__name__
        == {
            "llava": "LlavaForConditionalGeneration",
            "qwen2-vl": "Qwen2VLForConditionalGeneration",
        }[vision_dir.name]
    )


def test_vision_processor(vision_dir: Path) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    processor: Any = AutoProcessor.from_pretrained(str(vision_dir))  # type: ignore[no-untyped-call]
    pixels = processor.image_processor(images=[Image.new("RGB", (64, 48))], return_tensors="pt")
    if vision_dir.name == "llava":
        assert tuple(pixels["pixel_values"].shape) == (1, 3, 112, 112)
    else:
        assert pixels["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56 x 56 after resizing


def test_vision_chat_template(vision_dir: Path) -> None:
    from transformers import AutoProcessor, AutoTokenizer

    kind = vision_dir.name
    image = PLACEHOLDER[kind]
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                {"type": "text", "text": "with"},
                {"type": "image"},
            ],
        },
    ]
    tok: Any = AutoTokenizer.from_pretrained(str(vision_dir))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\nCompare\n{image}\nwith\n{image}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    processor: Any = AutoProcessor.from_pretrained(str(vision_dir))  # type: ignore[no-untyped-call]
    assert (
        processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        == prompt
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(IMAGE_TOKEN[kind])) == 2
    assert tok.decode(ids) == prompt
    # Text-only content renders as for the Llama demo.
    plain: Any = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "One"}, {"type": "text", "text": "Two"}],
        }
    ]
    assert tok.apply_chat_template(plain, tokenize=False) == (
        "<s><|im_start|>user\nOne\nTwo<|im_end|>\n"
    )


def test_cli_kind(tmp_path: Path) -> None:
    from conveyor.cli import main

    assert main(["demo-model", str(tmp_path / "q"), "--kind", "qwen2-vl"]) == 0
    assert is_demo_model(tmp_path / "q", "qwen2-vl")
    with pytest.raises(SystemExit):
        main(["demo-model", str(tmp_path / "z"), "--kind", "gpt"])


def test_a_larger_shape_is_recorded_in_the_marker_the_default_is_not() -> None:
    from shared.demo.model import DEFAULT_SHAPE, DemoShape, _marker

    assert _marker(0, "llama", DEFAULT_SHAPE) == {"kind": "llama", "version": 1, "seed": 0}
    bigger = DemoShape(hidden_size=512, num_heads=8, max_positions=8192)
    assert _marker(0, "llama", bigger)["shape"]["hidden_size"] == 512


def test_a_shape_applies_to_the_text_model_only(tmp_path: Path) -> None:
    from shared.demo.model import DemoShape

    with pytest.raises(ValueError, match="shape"):
        write_demo_model(tmp_path / "model", kind="llava", shape=DemoShape(num_layers=3))
