"""vLLM's own flags after `--` on `conveyor worker`/`up` (conveyor/engine_flags.py)."""

from __future__ import annotations

import json

import pytest

from conveyor.engine_flags import engine_flag_values, merged_engine_args, split_engine_flags


def test_split_at_the_first_double_dash() -> None:
    assert split_engine_flags(["worker", "--port", "1"]) == (["worker", "--port", "1"], [])
    assert split_engine_flags(["up", "--", "--block-size", "16", "--"]) == (
        ["up"],
        ["--block-size", "16", "--"],
    )


def test_flags_become_engine_argument_values() -> None:
    flags = [
        "--block-size",
        "16",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        '--speculative-config={"method": "ngram"}',
        "--cuda-graph-sizes",
        "1",
        "2",
    ]
    assert engine_flag_values(flags) == {
        "block_size": "16",
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "speculative_config": '{"method": "ngram"}',
        "cuda_graph_sizes": ["1", "2"],
    }
    with pytest.raises(ValueError, match="follows no flag"):
        engine_flag_values(["16"])


def test_the_flags_win_over_the_setting() -> None:
    merged = merged_engine_args('{"block_size": 32, "dtype": "float32"}', ["--block-size", "16"])
    assert json.loads(merged) == {"block_size": "16", "dtype": "float32"}
