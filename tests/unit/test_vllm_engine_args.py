"""The operator's vLLM engine arguments (workers/engines/vllm/engine_args.py): checked with
vLLM's own parser, and laid over Conveyor's defaults. No engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from shared.settings import Settings
from workers.engines.vllm.engine import _default_args
from workers.engines.vllm.engine_args import (
    REFUSED,
    EngineArgsError,
    operator_engine_args,
    with_defaults,
)


def test_values_are_read_as_vllm_serve_reads_its_flags() -> None:
    parsed = operator_engine_args(
        {
            "enable_prefix_caching": False,
            "block_size": 32,
            "max_num_batched_tokens": "2K",
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            "dtype": "float32",
            "quantization": None,
        }
    )
    assert parsed == {
        "enable_prefix_caching": False,
        "block_size": 32,
        "max_num_batched_tokens": 2048,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
        "dtype": "float32",
        "quantization": None,
    }
    assert operator_engine_args({"block_size": "16"}) == {"block_size": 16}  # a flag's text


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"block_sise": 16}, "unknown vLLM engine argument 'block_sise'"),
        ({"block_size": "x"}, "'block_size'"),
        ({"dtype": "float64"}, "invalid choice"),
        ({"max_num_batched_tokens": 1.5}, "'max_num_batched_tokens'"),
        ({"enable_prefix_caching": "maybe"}, "'enable_prefix_caching'"),
        ({"model": "/elsewhere"}, "set by Conveyor"),
        ({"max_num_seqs": 8}, "--worker-max-slots"),
        ({"kv_transfer_config": {}}, "--kv-connector"),
    ],
)
def test_bad_arguments_refuse_naming_the_field(values: dict[str, object], message: str) -> None:
    with pytest.raises(EngineArgsError, match=message):
        operator_engine_args(values)


def test_every_refused_field_is_an_engine_argument() -> None:
    assert set(REFUSED) <= set(AsyncEngineArgs.__dataclass_fields__)


def test_the_operator_wins_over_conveyors_defaults(tmp_path: Path) -> None:
    settings = Settings(worker_max_slots=4, max_model_len=256, dtype="auto")
    defaults = _default_args(settings, str(tmp_path), "demo")
    assert defaults["enable_prefix_caching"] is True and defaults["enforce_eager"] is True
    operator = operator_engine_args(
        {"enable_prefix_caching": False, "max_model_len": 512, "enforce_eager": False}
    )
    merged = with_defaults(defaults, operator)
    assert merged["enable_prefix_caching"] is False
    assert merged["max_model_len"] == 512
    assert merged["enforce_eager"] is False
    assert merged["max_num_seqs"] == 4 and merged["model"] == str(tmp_path)
    args = AsyncEngineArgs(**merged)  # vLLM takes the merged arguments as they are
    assert args.enable_prefix_caching is False


def test_the_setting_must_be_a_json_object() -> None:
    assert Settings(engine_args="").engine_arg_values() == {}
    assert Settings(engine_args='{"block_size": 16}').engine_arg_values() == {"block_size": 16}
    for bad in ("[1]", "{block_size: 16}"):
        with pytest.raises(ValueError, match="engine_args"):
            Settings(engine_args=bad)
