"""What an operator may ask of a vLLM engine: clear its prefix cache; sleep and wake.

``reset_prefix_cache()`` does nothing and returns False while requests run; the
caller retries (:mod:`workers.commands.admin`). Sleep mode (releasing the weights' and KV
cache's memory) exists only on CUDA/ROCm/XPU and only for an engine started with
``enable_sleep_mode``; Conveyor starts none, and on CPU ``sleep()`` would only pause
scheduling: it is answered :class:`~workers.engines.base.NotSupported`, never faked.
"""

from __future__ import annotations

from typing import Any

from shared.errors import EngineDead, EngineError
from workers.engines.base import NotSupported


class VllmAdmin:
    """The :class:`~workers.engines.base.EngineAdmin` of one ``AsyncLLM``."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    async def clear_kv(self) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return bool(await self._llm.reset_prefix_cache())
        except EngineDeadError as exc:
            raise EngineDead(f"the vLLM engine died: {exc}") from exc
        except Exception as exc:
            raise EngineError(f"reset_prefix_cache failed: {exc}") from exc

    async def sleep(self) -> None:
        raise NotSupported(sleep_unsupported_reason())

    async def wake(self) -> None:
        raise NotSupported(sleep_unsupported_reason())


def sleep_unsupported_reason() -> str:
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        return (
            f"not supported on this engine: vLLM on {current_platform.device_type or 'cpu'} "
            "has no sleep mode (it cannot release the weights' or the KV cache's memory; "
            "sleep() would only pause scheduling)"
        )
    return (
        "not supported on this engine: Conveyor starts vLLM without sleep mode (enable_sleep_mode)"
    )
