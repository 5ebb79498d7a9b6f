"""The vision-language parts of the demo models: a tiny random LLaVA and a tiny random Qwen2-VL.

:func:`shared.demo.model.write_demo_model` (``kind="llava"`` / ``"qwen2-vl"``) trains the
usual tokenizer, adds the family's image special tokens to it, and calls
:func:`write_vision_model` to write the rest: ``config.json``, ``generation_config.json``,
the image processor (``preprocessor_config.json``), the processor and the seeded float32
``model.safetensors``.

Both libraries must load the folder. vLLM's LLaVA loader wants the vision tower under
``vision_tower.vision_model.*`` (transformers 5 would save ``model.vision_tower.*``), so the
LLaVA state dict uses the pre-4.52 layout (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``language_model.lm_head``),
which transformers 5 still converts on load. Qwen2-VL uses transformers' own names
(``model.visual.*``, ``model.language_model.*``, ``lm_head``), which vLLM maps itself.

The chat template renders OpenAI-style content parts in order, one newline between parts;
each image part (``{"type": "image"}`` / ``"image_url"`` / ``"input_image"``) becomes the
family's single, unexpanded placeholder (the engine expands it to the image's tokens).

A little over 300 lines, kept whole: one concept (a vision-language demo model folder
both libraries load), whose two families share the template, config and weight writers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["VISION_KINDS", "VisionSpec", "chat_template", "vision_spec", "write_vision_model"]

INIT_STD: Final = 0.2
"""Like the Llama demo: peaked logits, so greedy decoding is not decided by near-ties."""
TEXT_HIDDEN: Final = 256
TEXT_INTERMEDIATE: Final = 512
TEXT_LAYERS: Final = 2
TEXT_HEADS: Final = 4  # head_dim 64: vLLM's CPU attention needs head_dim >= 64
MAX_POSITIONS: Final = 2048
VISION_HIDDEN: Final = 128
VISION_HEADS: Final = 2
PATCH: Final = 14

LLAVA_IMAGE_SIZE: Final = 112  # 8 x 8 patches: 64 tokens per image
QWEN_MIN_PIXELS: Final = 56 * 56  # 2 x 2 merged tokens at least
QWEN_MAX_PIXELS: Final = 112 * 112  # 4 x 4 merged tokens at most
QWEN_MERGE: Final = 2


@dataclass(frozen=True, slots=True)
class VisionSpec:
    kind: str
    special_tokens: tuple[str, ...]
    """Added to the tokenizer after training, in this order."""
    image_token: str
    """The token the engine expands; the placeholder holds exactly one."""
    placeholder: str
    """What the chat template writes per image."""


_SPECS: Final = {
    "llava": VisionSpec("llava", ("<image>",), "<image>", "<image>"),
    "qwen2-vl": VisionSpec(
        "qwen2-vl",
        ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
        "<|image_pad|>",
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
}
VISION_KINDS: Final = tuple(_SPECS)


def vision_spec(kind: str) -> VisionSpec:
    try:
        return _SPECS[kind]
    except KeyError:
        raise ValueError(f"unknown vision demo model kind {kind!r}") from None


def chat_template(placeholder: str) -> str:
    """ChatML; list content renders part by part, one newline between parts."""
    return (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}"
        "{{- message['content'] -}}"
        "{%- elif message['content'] is not none -%}"
        "{%- for part in message['content'] -%}"
        "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{%- if part is string -%}{{- part -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
        "{%- elif part['type'] in ('image', 'image_url', 'input_image') -%}"
        "{{- '" + placeholder + "' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- endif -%}"
    )


@dataclass(frozen=True, slots=True)
class TokenIds:
    vocab_size: int
    bos: int
    eos: list[int]
    pad: int
    special: dict[str, int]
    """The vision special tokens' ids."""


def write_vision_model(out: Path, *, kind: str, seed: int, tokenizer: Any, ids: TokenIds) -> None:
    """Write config, generation config, processor (+ tokenizer) and weights into ``out``."""
    from transformers import GenerationConfig

    spec = vision_spec(kind)
    config = _llava_config(ids) if kind == "llava" else _qwen2_vl_config(ids)
    config.save_pretrained(out)
    GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=ids.bos, eos_token_id=ids.eos, pad_token_id=ids.pad
    ).save_pretrained(out)
    processor = _processor(kind, tokenizer, chat_template(spec.placeholder))
    processor.save_pretrained(out)
    # transformers 5 nests the image processor in processor_config.json; older releases
    # (and tools that read the file directly) look for preprocessor_config.json.
    processor.image_processor.save_pretrained(out)
    _write_weights(out, kind, config, seed)


def _text_config(ids: TokenIds) -> dict[str, Any]:
    return {
        "vocab_size": ids.vocab_size,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": TEXT_INTERMEDIATE,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": TEXT_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "dtype": "float32",
    }


def _llava_config(ids: TokenIds) -> Any:
    from transformers import LlavaConfig

    text = _text_config(ids) | {
        "model_type": "llama",
        "head_dim": TEXT_HIDDEN // TEXT_HEADS,
        "architectures": ["LlamaForCausalLM"],
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": VISION_HEADS,
        "image_size": LLAVA_IMAGE_SIZE,
        "patch_size": PATCH,
        "projection_dim": VISION_HIDDEN,
        "hidden_act": "quick_gelu",
    }
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids.special["<image>"],
        image_seq_length=(LLAVA_IMAGE_SIZE // PATCH) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
        dtype="float32",
    )


def _qwen2_vl_config(ids: TokenIds) -> Any:
    from transformers import Qwen2VLConfig

    head_dim = TEXT_HIDDEN // TEXT_HEADS
    text = _text_config(ids) | {
        "model_type": "qwen2_vl_text",
        # M-RoPE splits head_dim / 2 rotary frequencies into (time, height, width).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
        },
    }
    vision = {
        "depth": 2,
        "embed_dim": VISION_HIDDEN,
        "hidden_size": TEXT_HIDDEN,  # the merger's output: the language model's width
        "num_heads": VISION_HEADS,
        "mlp_ratio": 2,
        "patch_size": PATCH,
        "spatial_merge_size": QWEN_MERGE,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids.special["<|image_pad|>"],
        video_token_id=ids.special["<|video_pad|>"],
        vision_start_token_id=ids.special["<|vision_start|>"],
        vision_end_token_id=ids.special["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen2VLForConditionalGeneration"],
        dtype="float32",
    )


def _processor(kind: str, tokenizer: Any, template: str) -> Any:
    if kind == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        size = LLAVA_IMAGE_SIZE
        clip = CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
        return LlavaProcessor(  # type: ignore[no-untyped-call]
            image_processor=clip,
            tokenizer=tokenizer,
            patch_size=PATCH,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's CLS token (dropped by "default")
            image_token="<image>",
            chat_template=template,
        )
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    qwen = Qwen2VLImageProcessor(
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
        patch_size=PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=QWEN_MIN_PIXELS,
        max_pixels=QWEN_MAX_PIXELS,
        patch_size=PATCH,
        merge_size=QWEN_MERGE,
        temporal_patch_size=2,
    )  # unused (no video) but the processor requires one
    return Qwen2VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=qwen,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=template,
    )


# --- weights -----------------------------------------------------------------------------

# LLaVA: transformers 5 names -> the pre-4.52 layout that vLLM's CLIP loader understands.
_LLAVA_RENAMES: Final = (
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)


def _checkpoint_name(kind: str, name: str) -> str:
    if kind != "llava":
        return name
    for old, new in _LLAVA_RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"unexpected LLaVA parameter {name!r}")


def _write_weights(out: Path, kind: str, config: Any, seed: int) -> None:
    """Seeded tensors for every parameter of the transformers model (built on ``meta``, so
    nothing is allocated twice), filled in name order so a seed always gives the same bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration

    model_class: Any = (
        LlavaForConditionalGeneration if kind == "llava" else Qwen2VLForConditionalGeneration
    )
    with torch.device("meta"):
        model = model_class(config)
    shapes = {
        _checkpoint_name(kind, name): tuple(param.shape) for name, param in model.named_parameters()
    }
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        tensors[name] = _init(name, shapes[name], gen)
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors creates it 0600


def _init(name: str, shape: tuple[int, ...], gen: Any) -> Any:
    import torch

    if name.endswith(".bias"):
        return torch.zeros(shape)
    if len(shape) == 1 and ("norm" in name or "ln_" in name):
        return torch.ones(shape)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
