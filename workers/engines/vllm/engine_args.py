"""The operator's vLLM engine arguments (``CONVEYOR_ENGINE_ARGS``, or vLLM's own flags after
``--``): checked with vLLM's own parser, then laid over Conveyor's defaults.

Precedence: the operator's value wins over every default Conveyor picks (dtype,
max_model_len, enforce_eager, prefix caching, structured outputs, ...). The fields in
:data:`REFUSED` are Conveyor's to set, for the worker's contract; naming one refuses to
start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, NoReturn

REFUSED: dict[str, str] = {
    "model": "the model is --model (--embed-model for the embed role)",
    "tokenizer": "the gateway tokenizes with the model folder's own tokenizer",
    "served_model_name": "use --served-model-name",
    "runner": "the role picks it (embed: pooling)",
    "kv_transfer_config": "the prefill/decode roles set it (--kv-connector)",
    "max_num_seqs": "use --worker-max-slots: the worker admits jobs against it",
    "skip_tokenizer_init": "the worker streams text the engine detokenizes",
    "disable_log_stats": "prefill/decode workers report prompt-token stats from it",
    "enable_lora": "use --enable-lora (the engine keeps a slot for base-model requests)",
    "max_loras": "use --max-loras (the engine gets one more slot than it)",
    "max_lora_rank": "use --max-lora-rank",
    "max_cpu_loras": "use --max-cpu-loras",
    "kv_events_config": "use --kv-events (the worker subscribes to them and forwards them)",
}
"""Fields Conveyor sets itself, and what to use instead."""


class EngineArgsError(ValueError):
    """The operator's engine arguments cannot be used: the worker does not start."""


def operator_engine_args(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (AsyncEngineArgs field -> JSON value, or a flag's text) as vLLM's parser
    reads them: the same types `vllm serve` would pass on. Raises :class:`EngineArgsError`
    naming the first bad field."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    for name in values:
        if name in REFUSED:
            raise EngineArgsError(f"engine argument {name!r} is set by Conveyor: {REFUSED[name]}")
        if name not in known:
            raise EngineArgsError(f"unknown vLLM engine argument {name!r}")
    parser = _parser()
    parsed: dict[str, Any] = {}
    for name, value in values.items():
        try:
            parsed.update(vars(parser.parse_args(_tokens(name, value))))
        except EngineArgsError as exc:
            raise EngineArgsError(f"engine argument {name!r}={value!r}: {exc}") from None
    return parsed


def with_defaults(defaults: Mapping[str, Any], operator: Mapping[str, Any]) -> dict[str, Any]:
    """Conveyor's defaults, each replaced where the operator set the field."""
    return {**defaults, **operator}


def _tokens(name: str, value: Any) -> list[str]:
    """One field as vLLM command-line flags: ``--name value``, ``--name`` / ``--no-name`` for
    booleans, one token per item for lists, JSON text for objects."""
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + name.replace("_", "-")]
    if isinstance(value, list):
        return [flag, *(_text(item) for item in value)]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if value is None:
        return "None"  # what vLLM's optional flags read as None
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _parser() -> argparse.ArgumentParser:
    """vLLM's FlexibleArgumentParser with AsyncEngineArgs' flags, raising instead of exiting,
    and keeping only the flags given (no defaults)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class RaisingParser(FlexibleArgumentParser):
        def __init__(self) -> None:
            super().__init__(add_help=False)  # type: ignore[no-untyped-call]

        def error(self, message: str) -> NoReturn:
            raise EngineArgsError(message)

    parser: argparse.ArgumentParser = AsyncEngineArgs.add_cli_args(RaisingParser())
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser
