"""vLLM's own flags after ``--`` (`conveyor worker -- --block-size 32`) as engine arguments:
a JSON object for CONVEYOR_ENGINE_ARGS. Only the shape is read here (vLLM is not imported
by the command); the worker checks names and values with vLLM's own parser."""

from __future__ import annotations

import json
from typing import Any


def split_engine_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Conveyor's arguments, vLLM's flags after the first ``--``)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def engine_flag_values(flags: list[str]) -> dict[str, Any]:
    """``--name value`` -> text, ``--name a b`` -> a list of texts, ``--name`` -> true,
    ``--no-name`` -> false, ``--name=value`` -> text; names as AsyncEngineArgs fields."""
    values: dict[str, Any] = {}
    name: str | None = None
    for token in flags:
        if token.startswith("--"):
            flag, eq, text = token[2:].partition("=")
            name = flag.replace("-", "_")
            if eq:
                values[name], name = text, None
            elif name.startswith("no_"):
                values[name[3:]], name = False, None
            else:
                values[name] = True
            continue
        if name is None:
            raise ValueError(f"vLLM flag value {token!r} follows no flag")
        held = values[name]
        values[name] = token if held is True else [*_as_list(held), token]
    return values


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def merged_engine_args(engine_args: str, flags: list[str]) -> str:
    """CONVEYOR_ENGINE_ARGS with the flags after ``--`` laid over it (the flags win)."""
    base = json.loads(engine_args) if engine_args.strip() else {}
    return json.dumps({**base, **engine_flag_values(flags)})
