"""Generate a small random LoRA adapter (PEFT format) for any Llama-family model folder.

``write_demo_lora(target, base=...)`` reads only the base model's ``config.json`` and
writes:

* ``adapter_config.json``: PEFT's LoRA config (rank :data:`RANK`, ``lora_alpha`` twice the
  rank, every linear layer of the decoder vLLM applies LoRA to: q/k/v/o and gate/up/down);
* ``adapter_model.safetensors``: seeded random ``lora_A`` / ``lora_B`` float32 weights,
  named as PEFT names them (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A
  .weight``). They are as large as the demo model's own weights, so the adapter visibly
  changes the demo model's greedy output (a real adapter starts with ``lora_B = 0``);
* ``conveyor-demo-lora.json``: a marker written last (seed, rank, base config digest);
  its presence means the folder is complete, and writing the same adapter again is a no-op.

Like the demo model, the point is to exercise the LoRA machinery (admin, registry,
routing, the engine's adapter slots) offline, in seconds, on a CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final

from shared.peft_layout import TARGET_MODULES, LlamaShapes, tensor_name

__all__ = ["MARKER_FILE", "RANK", "write_demo_lora"]

MARKER_FILE: Final = "conveyor-demo-lora.json"
MARKER_VERSION: Final = 1
RANK: Final = 8
INIT_STD: Final = 0.2
"""lora_A and lora_B entries: B @ A * alpha / r then has std ~0.2 * 0.2 * sqrt(8) * 2 ~ 0.23,
the size of the demo model's own weights (0.2)."""


def write_demo_lora(
    target: Path | str, *, base: Path | str, seed: int = 1, rank: int = RANK
) -> Path:
    """Write (idempotently, atomically) a random LoRA adapter for the model folder ``base``.

    Returns ``target``. A folder that already holds this very adapter is left alone; a
    non-empty folder that is not a demo adapter raises ``FileExistsError``.
    """
    target = Path(target)
    shapes = LlamaShapes.of_model(base)
    marker = {"version": MARKER_VERSION, "seed": seed, "rank": rank, "shapes": _digest(shapes)}
    if _read_marker(target) == marker:
        return target
    if (
        target.exists()
        and (not target.is_dir() or any(target.iterdir()))
        and (_read_marker(target) is None)
    ):
        raise FileExistsError(f"{target} exists and is not a Conveyor demo LoRA adapter")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        _write_config(tmp, base=Path(base), rank=rank)
        _write_weights(tmp, shapes, seed=seed, rank=rank)
        (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _digest(shapes: LlamaShapes) -> str:
    return hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]


def _read_marker(target: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((target / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_config(out: Path, *, base: Path, rank: int) -> None:
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base.resolve()),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (out / "adapter_config.json").write_text(text, encoding="utf-8")


def _write_weights(out: Path, shapes: LlamaShapes, *, seed: int, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes.layers):
        for module in TARGET_MODULES:
            in_features, out_features = shapes.linear(module)
            tensors[tensor_name(layer, module, "lora_A")] = normal(rank, in_features)
            tensors[tensor_name(layer, module, "lora_B")] = normal(out_features, rank)
    weights = out / "adapter_model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)
