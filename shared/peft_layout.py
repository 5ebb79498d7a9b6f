"""PEFT's LoRA layout for Llama-family decoders: which linear layers an adapter targets,
their shapes from a model's ``config.json``, and PEFT's tensor names.

The LoRA check, the vLLM engine's base-request fix and the demo adapter all read these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

TARGET_MODULES: Final = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""Every linear layer of the decoder vLLM applies LoRA to."""

_ATTENTION: Final = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


@dataclass(frozen=True, slots=True)
class LlamaShapes:
    """The linear layers' shapes of a Llama-family decoder, from its ``config.json``."""

    layers: int
    hidden: int
    intermediate: int
    q_out: int
    kv_out: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaShapes:
        text = config.get("text_config") or config  # vision-language: the language part
        try:
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            head_dim = int(text.get("head_dim") or hidden // heads)
            return cls(
                layers=int(text["num_hidden_layers"]),
                hidden=hidden,
                intermediate=int(text["intermediate_size"]),
                q_out=heads * head_dim,
                kv_out=int(text.get("num_key_value_heads") or heads) * head_dim,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a Llama-family config (missing or bad {exc})") from exc

    @classmethod
    def of_model(cls, model_dir: Path | str) -> LlamaShapes:
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")
        return cls.from_config(config)

    def linear(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a decoder layer's ``module``."""
        shapes = {
            "q_proj": (self.hidden, self.q_out),
            "k_proj": (self.hidden, self.kv_out),
            "v_proj": (self.hidden, self.kv_out),
            "o_proj": (self.q_out, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        return shapes[module]


def tensor_name(layer: int, module: str, part: str) -> str:
    """PEFT's name of one LoRA matrix (``part``: ``lora_A`` or ``lora_B``)."""
    block = "self_attn" if module in _ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.{part}.weight"
