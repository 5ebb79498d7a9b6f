"""Whether an ``sglang.Engine`` is alive: its tokenizer manager is not exiting and none of
its child processes (schedulers, detokenizer) is gone or a zombie."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def engine_alive(engine: Any) -> bool:
    """False once the tokenizer manager exits or a child of the engine is dead; releases
    without ``get_all_child_pids`` only get the first check."""
    manager = getattr(engine, "tokenizer_manager", None)
    if getattr(manager, "gracefully_exit", False) is True:
        return False
    get_pids = getattr(engine, "get_all_child_pids", None)
    if not callable(get_pids):
        return True
    try:
        pids = [int(pid) for pid in get_pids()]
    except Exception:
        log.exception("could not list the SGLang engine's child processes")
        return True
    return all(pid_alive(pid) for pid in pids)


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (``/proc``; ``kill(pid, 0)`` without it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat.rsplit(")", 1)[-1].split()
    return not fields or fields[0] not in ("Z", "X")
