"""Check a PEFT LoRA folder against the served model before any engine sees it.

An engine's own load (vLLM ``add_lora``) raises for a missing folder or mismatched
shapes, but on a mismatch it has already registered the adapter half-activated, and a
bad path in a request (rather than a load) kills the engine. So a folder is read here
first, without torch: ``adapter_config.json`` (a LoRA, rank within the worker's limit,
nothing but linear layers) and the safetensors header (every matrix's shape matches the
model's layers). The reasons are what the worker reports (``failed: <reason>``).

Only folders inside the LoRA roots are read (shared/lora_paths.py; a path outside them
gets the same answer whether or not it exists), and only safetensors weights: a pickled
``adapter_model.bin`` can run code when loaded.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.lora_paths import OUTSIDE_ROOTS, resolve_in_roots
from shared.peft_layout import LlamaShapes
from workers.engines.base import LoraLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024
_LINEAR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_NOT_LINEAR = ("embed_tokens", "lm_head", "lora_embedding")


@dataclass(frozen=True, slots=True)
class LoraFiles:
    path: Path
    rank: int
    weights: Path


def check_adapter(
    path: str, *, roots: Sequence[Path], max_rank: int, model: LlamaShapes | None
) -> LoraFiles:
    """The checked adapter at ``path`` (``LoraFiles.path``: symlinks resolved, the folder
    to load from); raises :class:`LoraLoadError` with the reason. ``model`` None (not a
    Llama-family config): the shapes are left to the engine."""
    if not Path(path).is_absolute():
        raise LoraLoadError(f"adapter path {path!r} is not absolute")
    folder = resolve_in_roots(path, roots)
    if folder is None:
        raise LoraLoadError(OUTSIDE_ROOTS)
    if not folder.is_dir():
        raise LoraLoadError(f"no adapter folder at {path}")
    config = _config(folder)
    rank = _rank(config, max_rank)
    weights = folder / WEIGHT_FILE
    if not weights.is_file():
        raise LoraLoadError(
            f"{path} has no {WEIGHT_FILE} (only safetensors weights are loaded; convert a "
            "pickled adapter_model.bin)"
        )
    _check_shapes(_header(weights), model)
    return LoraFiles(folder, rank, weights)


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise LoraLoadError(f"{folder} has no {CONFIG_FILE}") from exc
    except (OSError, ValueError) as exc:
        raise LoraLoadError(f"unreadable {CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraLoadError(f"{CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraLoadError(f"not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    if config.get("modules_to_save"):
        raise LoraLoadError("adapters with modules_to_save are not served")
    if config.get("use_dora"):
        raise LoraLoadError("DoRA adapters are not served")
    targets = config.get("target_modules") or []
    if any(name in str(targets) for name in _NOT_LINEAR):
        raise LoraLoadError(
            "adapters of the embeddings or lm_head are not served (linear layers only)"
        )
    return config


def _rank(config: dict[str, Any], max_rank: int) -> int:
    try:
        ranks = [int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    except (KeyError, TypeError, ValueError) as exc:
        raise LoraLoadError(f"{CONFIG_FILE} has no valid rank 'r'") from exc
    rank = max(ranks)
    if rank < 1:
        raise LoraLoadError(f"rank {rank} is not a LoRA rank")
    if rank > max_rank:
        raise LoraLoadError(f"rank {rank} is over this worker's max_lora_rank {max_rank}")
    return rank


def _header(weights: Path) -> dict[str, Any]:
    """The safetensors header: tensor name -> {dtype, shape, data_offsets}."""
    try:
        with weights.open("rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            if size > MAX_HEADER_BYTES:
                raise LoraLoadError(f"{weights.name} is corrupt (header of {size} bytes)")
            header = json.loads(file.read(size))
    except LoraLoadError:
        raise
    except (OSError, ValueError, struct.error) as exc:
        raise LoraLoadError(f"{weights.name} is corrupt ({exc})") from exc
    if not isinstance(header, dict):
        raise LoraLoadError(f"{weights.name} is corrupt (header is not an object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        raise LoraLoadError(f"{weights.name} holds no tensors")
    return tensors


def _check_shapes(tensors: dict[str, Any], model: LlamaShapes | None) -> None:
    for name, info in tensors.items():
        if any(part in name for part in _NOT_LINEAR):
            raise LoraLoadError(
                f"{name}: adapters of the embeddings or lm_head are not served (linear layers only)"
            )
        match = _LINEAR.search(name)
        if model is None or match is None:
            continue
        layer, module, part = int(match[1]), match[2], match[3]
        if layer >= model.layers:
            raise LoraLoadError(
                f"made for another model: {name} names layer {layer}, "
                f"this model has {model.layers} layers"
            )
        try:
            in_features, out_features = model.linear(module)
        except KeyError:
            continue  # a module this check does not know: the engine checks it
        shape = list(info.get("shape") or []) if isinstance(info, dict) else []
        expected_dim = in_features if part == "A" else out_features
        got_dim = shape[1] if part == "A" and len(shape) == 2 else shape[0] if shape else None
        if len(shape) != 2 or got_dim != expected_dim:
            side = "input" if part == "A" else "output"
            raise LoraLoadError(
                f"made for another model: {name} has shape {shape}, this model's {module} "
                f"{side} size is {expected_dim}"
            )
