"""LoRA adapters in a vLLM engine, with the fix for base requests on CPU.

The pitfall (DESIGN.md section 4, reproduced here: 6 of 6 base requests wrong). vLLM
marks a base-model row of a batch with adapter index -1. Its CPU LoRA ops (torch
``bgmv``/``sgmv``) gather each row's weights with ``stacked[indices]``, and -1 is
Python for "the last slot". A batch of base rows only skips LoRA altogether, but once
a batch mixes base and adapter rows, base rows get whatever adapter sits in the last
slot; slots fill from the first, and stay filled (LRU), so this starts as soon as
``max_loras`` distinct adapters have ever run.

The fix: the engine gets one slot more than ``max_loras`` and that last slot holds a
pinned all-zero adapter, so index -1 adds exactly nothing. vLLM places an adapter in
the first free slot, so :meth:`VllmLoras._reserve` fills the others with throwaway
copies, adds and pins the zero adapter (it lands last), and removes the throwaways.
Pinned, it is never evicted; the other ``max_loras`` slots serve real adapters, and
the :class:`~workers.engines.lora.gate.LoraGate` keeps at most ``max_loras``
distinct adapters in the engine (vLLM's scheduler would admit ``max_loras + 1``, one
more than there are free slots). Base-only batches still skip LoRA entirely.

A path reaches vLLM only through :meth:`VllmLoras.load`: checked first
(:mod:`workers.engines.lora.check`), then ``add_lora`` (which only raises). A
request carries the ``LoRARequest`` of a loaded adapter, never a path of its own, and
the CPU cache holds every loaded adapter (no eviction that a request would undo by
reading the path again).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shared.errors import EngineDead, ModelNotFound
from shared.peft_layout import LlamaShapes, tensor_name
from shared.roles import Role
from shared.settings import WorkerSettings
from workers.engines.base import LoraLoadError
from workers.engines.lora.check import check_adapter
from workers.engines.lora.gate import LoraClosed, LoraGate
from workers.engines.vision.encoder import vision_family

log = logging.getLogger(__name__)

ZERO_ID = 2**31 - 1
"""The pinned all-zero adapter in the reserved last slot."""
_FILLER_ID = 2**31 - 2
"""Throwaway adapters take ids counting down from here while the slot is reserved."""
_ID_SPACE = 2**30


def adapters_off_reason(settings: WorkerSettings, model_path: str) -> str | None:
    """Why this worker's engine serves no adapters (None: it serves them)."""
    if not settings.enable_lora:
        return "LoRA is off on this worker (CONVEYOR_ENABLE_LORA=false)"
    if settings.role is not Role.AGGREGATED:
        return f"adapters are served by aggregated workers (this one is {settings.role})"
    if vision_family(model_path) is not None:
        return "adapters are served for text models only"
    return None


def engine_args(settings: WorkerSettings, model_path: str) -> dict[str, Any]:
    """The ``AsyncEngineArgs`` of LoRA: one slot more than ``max_loras`` (reserved)."""
    if adapters_off_reason(settings, model_path) is not None:
        return {}
    slots = settings.max_loras + 1
    return {
        "enable_lora": True,
        "max_loras": slots,
        "max_lora_rank": settings.max_lora_rank,
        "max_cpu_loras": max(settings.max_cpu_loras + 1, slots),
    }


def attach(llm: Any, settings: WorkerSettings, model_path: str) -> tuple[VllmLoras | None, str]:
    """The engine's adapters, or None and the reason."""
    reason = adapters_off_reason(settings, model_path)
    if reason is not None:
        return None, reason
    return VllmLoras(llm, settings), ""


def lora_request(adapters: VllmLoras | None, name: str | None) -> Any:
    """The ``LoRARequest`` a sequence of adapter ``name`` runs with (None: the base)."""
    if name is None:
        return None
    if adapters is None:
        raise ModelNotFound(f"this worker serves no LoRA adapters (asked for {name!r})")
    return adapters.request(name)


class VllmLoras:
    """The :class:`~workers.engines.base.EngineLoras` of one ``AsyncLLM``."""

    def __init__(self, llm: Any, settings: WorkerSettings) -> None:
        self._llm = llm
        self._slots = settings.max_loras
        self._max_loaded = settings.max_cpu_loras
        self._max_rank = settings.max_lora_rank
        self._roots = settings.lora_root_paths()
        self._shapes = _shapes(llm)
        self._gate = LoraGate(settings.max_loras)
        self._loaded: dict[str, Any] = {}
        self._closing: set[str] = set()
        self._lock = asyncio.Lock()
        self._reserved: bool | str = False
        """True once the slot is reserved; a string: why it could not be."""

    @property
    def max_active(self) -> int:
        return self._gate.max_active

    def loaded(self) -> list[str]:
        return sorted(self._loaded)

    def request(self, name: str) -> Any:
        try:
            return self._loaded[name]
        except KeyError:
            raise ModelNotFound(f"adapter {name!r} is not loaded on this worker") from None

    @contextlib.asynccontextmanager
    async def running(self, name: str | None) -> AsyncIterator[None]:
        if name is not None and name not in self._loaded:
            raise ModelNotFound(f"adapter {name!r} is not loaded on this worker")
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(self._gate.hold(name))
            except LoraClosed:
                raise ModelNotFound(f"adapter {name!r} is being unloaded") from None
            yield

    async def load(self, name: str, path: str) -> None:
        async with self._lock:
            await self._reserve()
            if name in self._closing:
                raise LoraLoadError(f"{name!r} is being unloaded; load it again after")
            current = self._loaded.get(name)
            if current is not None:
                if current.lora_path == path:
                    return
                raise LoraLoadError(f"{name!r} is loaded from {current.lora_path}; unload it first")
            if len(self._loaded) >= self._max_loaded:
                raise LoraLoadError(
                    f"this worker holds its maximum of {self._max_loaded} "
                    "adapters (CONVEYOR_MAX_CPU_LORAS)"
                )
            files = await asyncio.to_thread(
                check_adapter, path, roots=self._roots, max_rank=self._max_rank, model=self._shapes
            )
            request = self._new_request(name, str(files.path))
            started = time.monotonic()
            await self._add(request)
            self._loaded[name] = request
            log.info(
                "adapter %s loaded from %s (rank %d, id %d) in %.3fs",
                name,
                files.path,
                files.rank,
                request.lora_int_id,
                time.monotonic() - started,
            )

    async def unload(self, name: str) -> None:
        request = self._loaded.get(name)
        if request is None or name in self._closing:
            return
        self._closing.add(name)
        self._gate.close(name)
        try:
            await self._gate.idle(name)  # outside the lock: other loads go on meanwhile
            async with self._lock:
                del self._loaded[name]
                await self._remove(request.lora_int_id)
        finally:
            self._closing.discard(name)
            self._gate.reopen(name)
        log.info("adapter %s unloaded", name)

    async def _add(self, request: Any) -> None:
        """``add_lora``; a refusal leaves nothing behind (vLLM registers an adapter whose
        activation failed, half-written into a slot: it is removed again here)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            await self._llm.add_lora(request)
        except EngineDeadError as exc:
            raise EngineDead(f"the vLLM engine died loading an adapter: {exc}") from exc
        except Exception as exc:
            await self._remove(request.lora_int_id)
            raise LoraLoadError(_reason(exc)) from exc

    async def _remove(self, lora_id: int) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            await self._llm.remove_lora(lora_id)
        except EngineDeadError as exc:
            raise EngineDead(f"the vLLM engine died unloading an adapter: {exc}") from exc
        except Exception as exc:
            log.warning("removing adapter id %d failed: %s", lora_id, _reason(exc))

    def _new_request(self, name: str, path: str) -> Any:
        from vllm.lora.request import LoRARequest

        taken = {request.lora_int_id for request in self._loaded.values()}
        lora_id = zlib.crc32(name.encode()) % _ID_SPACE + 1  # stable across workers
        while lora_id in taken:
            lora_id = lora_id % _ID_SPACE + 1
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)

    async def _reserve(self) -> None:
        """Put the pinned zero adapter in the last slot (once, before any real adapter)."""
        if self._reserved is True:
            return
        if isinstance(self._reserved, str):
            raise LoraLoadError(self._reserved)
        try:
            await self._reserve_slot()
        except LoraLoadError as exc:
            self._reserved = f"the engine's base-model slot could not be reserved: {exc}"
            raise LoraLoadError(self._reserved) from exc
        self._reserved = True

    async def _reserve_slot(self) -> None:
        from vllm.lora.request import LoRARequest

        shapes = self._shapes
        if shapes is None:
            raise LoraLoadError("the model's config.json is not Llama-family")
        with tempfile.TemporaryDirectory(prefix="conveyor-zero-lora-") as folder:
            write_zero_adapter(Path(folder), shapes)
            fillers = [
                LoRARequest(f"conveyor-filler-{i}", _FILLER_ID - i, folder)
                for i in range(self._slots)
            ]
            for filler in fillers:  # slots 0 .. max_loras-1
                await self._add(filler)
            await self._add(LoRARequest("conveyor-zero", ZERO_ID, folder))  # the last slot
            await self._llm.pin_lora(ZERO_ID)
            for filler in fillers:
                await self._remove(filler.lora_int_id)
        log.info(
            "LoRA: %d adapter slots, plus the last one kept empty for base requests", self._slots
        )


def write_zero_adapter(folder: Path, shapes: LlamaShapes) -> None:
    """A rank-1 adapter of layer 0's q_proj with zero weights: activating it zeroes every
    module's weights in its slot (a module it lacks is reset to zero)."""
    import torch
    from safetensors.torch import save_file

    in_features, out_features = shapes.linear("q_proj")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": ["q_proj"],
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    save_file(
        {
            tensor_name(0, "q_proj", "lora_A"): torch.zeros(1, in_features),
            tensor_name(0, "q_proj", "lora_B"): torch.zeros(out_features, 1),
        },
        str(folder / "adapter_model.safetensors"),
    )


def _shapes(llm: Any) -> LlamaShapes | None:
    """The served model's layer shapes, from the config the engine loaded."""
    try:
        return LlamaShapes.from_config(llm.model_config.hf_text_config.to_dict())
    except (AttributeError, ValueError):
        return None


def _reason(exc: BaseException) -> str:
    text = str(exc).removeprefix("Call to add_lora method failed: ").strip()
    return " ".join(text.split())[:300] or type(exc).__name__
