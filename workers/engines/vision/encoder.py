"""The vision encoder an encode worker runs: image -> the embeddings a language engine splices in.

:class:`VisionEncoder` loads a vision-language model's processor and only its vision part
(LLaVA: vision tower + multi-modal projector; Qwen2-VL: the ``visual`` tower) with
transformers on the CPU, in the model's dtype. Its output, an :class:`ImageEmbedding`, is
what vLLM computes internally for the same image, so an engine started with
``enable_mm_embeds=True`` can take it instead of the image (:func:`to_vllm_input`).

Embeddings travel between processes as :meth:`ImageEmbedding.to_bytes` (a JSON header and
raw little-endian bytes; never pickle). torch, transformers and PIL are imported lazily.

A little over 300 lines, kept whole: the encoder and its output's wire format change
together (each family's tensors, their bytes, and vLLM's input shape for them).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

__all__ = ["FAMILIES", "ImageEmbedding", "VisionEncoder", "to_vllm_input", "vision_family"]

FAMILIES: Final = {"llava": "llava", "qwen2_vl": "qwen2_vl"}
"""``config.json`` ``model_type`` -> vision family."""

# --- the embedding and its wire format --------------------------------------------------

MAGIC: Final = b"CVEMB"
FORMAT_VERSION: Final = 1
_PREFIX: Final = struct.Struct("<5sBI")  # magic, format version, header length
_DTYPES: Final = ("float32", "float16", "bfloat16")
_ITEMSIZE: Final = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, eq=False, slots=True)
class ImageEmbedding:
    """One image's embeddings, ready for the language model."""

    embeds: torch.Tensor
    """(num_tokens, hidden) on the CPU, contiguous; float32 from :class:`VisionEncoder`."""
    grid_thw: tuple[int, int, int] | None = None
    """Qwen2-VL: the image's patch grid (time, height, width), before the 2x2 merge."""

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.embeds.numel() * self.embeds.element_size())

    def to_bytes(self) -> bytes:
        import torch

        dtype = str(self.embeds.dtype).removeprefix("torch.")
        if dtype not in _DTYPES or self.embeds.ndim != 2 or self.embeds.numel() == 0:
            raise ValueError(f"cannot serialise a {dtype} tensor of shape {self.embeds.shape}")
        _require_little_endian()
        header = json.dumps(
            {
                "dtype": dtype,
                "shape": list(self.embeds.shape),
                "grid_thw": None if self.grid_thw is None else list(self.grid_thw),
            },
            separators=(",", ":"),
        ).encode()
        tensor = self.embeds.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: same bits as int16
            tensor = tensor.view(torch.int16)
        raw = tensor.numpy().tobytes()
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + raw

    @classmethod
    def from_bytes(cls, data: bytes) -> ImageEmbedding:
        import torch

        header, raw = _split(data)
        dtype, shape, grid = header["dtype"], header["shape"], header["grid_thw"]
        if dtype not in _DTYPES or not _is_shape(shape) or len(shape) != 2:
            raise ValueError(f"bad image embedding header {header!r}")
        if len(raw) != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(f"image embedding of shape {shape} has {len(raw)} bytes")
        if grid is not None and not (_is_shape(grid) and len(grid) == 3):
            raise ValueError(f"bad grid_thw {grid!r}")
        _require_little_endian()
        embeds = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
        return cls(embeds, None if grid is None else (grid[0], grid[1], grid[2]))


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    if len(data) < _PREFIX.size:
        raise ValueError("image embedding too short")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"not an image embedding (format {magic!r} v{version})")
    end = _PREFIX.size + length
    try:
        header = json.loads(data[_PREFIX.size : end])
    except ValueError as exc:
        raise ValueError(f"bad image embedding header: {exc}") from exc
    if not isinstance(header, dict) or {"dtype", "shape", "grid_thw"} - header.keys():
        raise ValueError(f"bad image embedding header {header!r}")
    return header, data[end:]


def _is_shape(value: object) -> bool:
    return isinstance(value, list) and all(type(n) is int and n > 0 for n in value)


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("image embeddings are exchanged in little-endian hosts' byte order")


def to_vllm_input(embeddings: list[ImageEmbedding], family: str) -> Any:
    """What vLLM (``enable_mm_embeds=True``) takes as ``multi_modal_data["image"]`` for a
    prompt's images, in placeholder order.

    LLaVA: a list of (num_tokens, hidden) tensors, one per image (a 3-D tensor would do
    too). Qwen2-VL: ``{"image_embeds": (sum of num_tokens, hidden), "image_grid_thw":
    (num_images, 3)}``; vLLM splits the rows by each grid's size.
    """
    import torch

    if not embeddings:
        raise ValueError("no image embeddings")
    if family == "llava":
        return [e.embeds for e in embeddings]
    if family == "qwen2_vl":
        grids = [e.grid_thw for e in embeddings]
        if any(g is None for g in grids):
            raise ValueError("Qwen2-VL image embeddings need their grid_thw")
        return {
            "image_embeds": torch.cat([e.embeds for e in embeddings]),
            "image_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }
    raise ValueError(f"unknown vision family {family!r}")


# --- which models -----------------------------------------------------------------------


def vision_family(model_path: str) -> str | None:
    """The vision family of a model folder (or hub id); None for a text-only model."""
    config = _read_config(model_path)
    return FAMILIES.get(str(config.get("model_type"))) if "vision_config" in config else None


def _read_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not Path(model_path).is_dir():
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(model_path, "config.json"))
        except Exception:  # not a hub id either: the engine will say what is wrong
            return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_folder(model_path: str) -> Path:
    if Path(model_path).is_dir():
        return Path(model_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_path))


# --- the encoder ------------------------------------------------------------------------


class VisionEncoder:
    """A model's image processor and vision part; :meth:`encode` one RGB image at a time."""

    def __init__(self, family: str, processor: Any, modules: dict[str, Any], config: Any) -> None:
        self.family = family
        self._image_processor = processor.image_processor
        self._modules = modules
        self._config = config
        self._dtype = next(modules[next(iter(modules))].parameters()).dtype

    @classmethod
    def load(cls, model_path: str) -> VisionEncoder:
        from transformers import AutoConfig, AutoProcessor

        family = vision_family(model_path)
        if family is None:
            raise ValueError(
                f"{model_path} is not a vision-language model this encoder knows "
                f"(model types: {', '.join(FAMILIES)})"
            )
        folder = _model_folder(model_path)
        config = AutoConfig.from_pretrained(str(folder))
        modules = _llava_modules(config) if family == "llava" else _qwen2_vl_modules(config)
        _load_weights(folder, modules)
        processor = AutoProcessor.from_pretrained(str(folder))  # type: ignore[no-untyped-call]
        return cls(family, processor, modules, config)

    def encode(self, image: Image) -> ImageEmbedding:
        import torch

        if image.mode != "RGB":
            image = image.convert("RGB")
        inputs = self._image_processor(images=[image], return_tensors="pt")
        pixels = inputs["pixel_values"].to(self._dtype)
        with torch.inference_mode():
            if self.family == "llava":
                return ImageEmbedding(self._llava(pixels)[0].float().contiguous())
            grid = inputs["image_grid_thw"]
            embeds = self._modules["visual"](pixels, grid_thw=grid).pooler_output
            t, h, w = (int(n) for n in grid[0])
            return ImageEmbedding(embeds.float().contiguous(), (t, h, w))

    def _llava(self, pixels: torch.Tensor) -> torch.Tensor:
        """As ``LlavaModel.get_image_features``: the chosen hidden state(s), CLS dropped by
        the "default" strategy, through the projector."""
        import torch

        layer = self._config.vision_feature_layer
        out = self._modules["vision_tower"](pixels, output_hidden_states=True)
        layers = [layer] if isinstance(layer, int) else list(layer)
        states = [out.hidden_states[i] for i in layers]
        if self._config.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]
        projected: torch.Tensor = self._modules["multi_modal_projector"](torch.cat(states, -1))
        return projected


def _llava_modules(config: Any) -> dict[str, Any]:
    from transformers import AutoModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    dtype = _dtype(config)
    return {
        "vision_tower": AutoModel.from_config(  # type: ignore[no-untyped-call]
            config.vision_config, dtype=dtype
        ).eval(),
        "multi_modal_projector": LlavaMultiModalProjector(config).to(dtype).eval(),
    }


def _qwen2_vl_modules(config: Any) -> dict[str, Any]:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    visual = Qwen2VisionTransformerPretrainedModel._from_config(  # type: ignore[no-untyped-call]
        config.vision_config, dtype=_dtype(config)
    )
    return {"visual": visual.eval()}


def _dtype(config: Any) -> Any:
    import torch

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# Checkpoint prefixes of each module: the transformers >= 4.52 layout, then the older one.
_PREFIXES: Final = {
    "vision_tower": ("model.vision_tower.", "vision_tower."),
    "multi_modal_projector": ("model.multi_modal_projector.", "multi_modal_projector."),
    "visual": ("model.visual.", "visual."),
}


def _load_weights(folder: Path, modules: dict[str, Any]) -> None:
    """Read only the modules' tensors from the safetensors files and load them strictly."""
    from safetensors import safe_open

    own = {name: set(module.state_dict()) for name, module in modules.items()}
    found: dict[str, dict[str, Any]] = {name: {} for name in modules}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                for name in modules:
                    local = _local_name(key, _PREFIXES[name], own[name])
                    if local is not None:
                        found[name][local] = f.get_tensor(key)
    for name, module in modules.items():
        missing, unexpected = module.load_state_dict(found[name], strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(
                f"{folder}: {name} weights do not fit the model "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )


def _local_name(key: str, prefixes: tuple[str, ...], own: set[str]) -> str | None:
    """The module's own name for checkpoint ``key``; None if the key is not the module's.
    CLIP/SigLIP towers appear with and without their ``vision_model.`` level."""
    for prefix in prefixes:
        if key.startswith(prefix):
            local = key[len(prefix) :]
            flat = local.removeprefix("vision_model.")
            for candidate in (local, flat, "vision_model." + flat):
                if candidate in own:
                    return candidate
            return local
    return None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files
