"""VllmLoras against a scripted AsyncLLM: the order of the slot reservation, what a
refused load leaves behind, the per-worker limits. (The real engine: tests/e2e/test_lora.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shared.demo.lora import write_demo_lora
from shared.errors import EngineDead, ModelNotFound
from shared.settings import Settings
from workers.engines.base import LoraLoadError
from workers.engines.vllm.lora import ZERO_ID, VllmLoras, engine_args, lora_request

CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "head_dim": 64,
}


class FakeLLM:
    """Records LoRA calls; an adapter whose path contains 'explode' fails in add_lora (as
    vLLM does for a mismatch: after registering it); 'die' kills the engine."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.registered: set[int] = set()
        self.model_config = SimpleNamespace(hf_text_config=SimpleNamespace(to_dict=lambda: CONFIG))

    async def add_lora(self, request: Any) -> bool:
        self.calls.append(("add", request.lora_int_id))
        if "die" in request.lora_path:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError("gone")
        self.registered.add(request.lora_int_id)
        if "explode" in request.lora_path:
            raise Exception(
                "Call to add_lora method failed: The size of tensor a (256) must "
                "match the size of tensor b (512)"
            )
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        self.registered.discard(lora_id)
        return True

    async def pin_lora(self, lora_id: int) -> bool:
        self.calls.append(("pin", lora_id))
        return True


def settings(**changes: Any) -> Settings:
    lora: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    lora["lora_roots"] = "/"  # the adapters live in pytest's temporary folders
    return Settings(**{**lora, "max_cpu_loras": 3, **changes})


@pytest.fixture
def adapter_dirs(tmp_path: Path) -> dict[str, Path]:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(__import__("json").dumps(CONFIG))
    return {
        name: write_demo_lora(tmp_path / name, base=base, seed=i)
        for i, name in enumerate(["a", "b", "c", "d", "explode", "die"])
    }


def test_the_engine_gets_one_slot_more_than_max_loras(tmp_path: Path) -> None:
    args = engine_args(settings(), str(tmp_path))
    assert args == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_cpu_loras": 4}
    assert engine_args(settings(enable_lora=False), str(tmp_path)) == {}
    assert engine_args(settings(role="prefill"), str(tmp_path)) == {}


async def test_the_zero_adapter_is_pinned_in_the_last_slot_before_any_adapter(
    adapter_dirs: dict[str, Path],
) -> None:
    llm = FakeLLM()
    adapters = VllmLoras(llm, settings())
    await adapters.load("a", str(adapter_dirs["a"]))
    fillers = [2**31 - 2, 2**31 - 3]
    assert llm.calls[:6] == [
        ("add", fillers[0]),
        ("add", fillers[1]),  # slots 0 and 1
        ("add", ZERO_ID),
        ("pin", ZERO_ID),  # the last slot, pinned
        ("remove", fillers[0]),
        ("remove", fillers[1]),  # free again for real adapters
    ]
    assert llm.calls[6][0] == "add" and llm.registered == {ZERO_ID, llm.calls[6][1]}
    await adapters.load("b", str(adapter_dirs["b"]))
    assert sum(call == ("pin", ZERO_ID) for call in llm.calls) == 1  # reserved once
    assert adapters.loaded() == ["a", "b"] and adapters.max_active == 2
    assert lora_request(adapters, "a").lora_path == str(adapter_dirs["a"])
    assert lora_request(adapters, None) is None


async def test_a_refused_load_leaves_nothing_registered(adapter_dirs: dict[str, Path]) -> None:
    llm = FakeLLM()
    adapters = VllmLoras(llm, settings())
    with pytest.raises(LoraLoadError, match=r"^The size of tensor a \(256\)"):
        await adapters.load("x", str(adapter_dirs["explode"]))
    assert llm.registered == {ZERO_ID} and adapters.loaded() == []
    with pytest.raises(ModelNotFound):
        lora_request(adapters, "x")
    with pytest.raises(EngineDead):
        await adapters.load("y", str(adapter_dirs["die"]))


async def test_limits_and_reloads(adapter_dirs: dict[str, Path]) -> None:
    adapters = VllmLoras(FakeLLM(), settings())
    for name in "abc":
        await adapters.load(name, str(adapter_dirs[name]))
    await adapters.load("a", str(adapter_dirs["a"]))  # the same again: nothing to do
    with pytest.raises(LoraLoadError, match="maximum of 3 adapters"):
        await adapters.load("d", str(adapter_dirs["d"]))
    with pytest.raises(LoraLoadError, match="unload it first"):
        await adapters.load("a", str(adapter_dirs["b"]))
    await adapters.unload("c")
    await adapters.load("d", str(adapter_dirs["d"]))
    assert adapters.loaded() == ["a", "b", "d"]


async def test_unload_waits_for_running_sequences_and_refuses_new_ones(
    adapter_dirs: dict[str, Path],
) -> None:
    llm = FakeLLM()
    adapters = VllmLoras(llm, settings())
    await adapters.load("a", str(adapter_dirs["a"]))
    lora_id = lora_request(adapters, "a").lora_int_id
    release = asyncio.Event()

    async def sequence() -> None:
        async with adapters.running("a"):
            await release.wait()

    running = asyncio.create_task(sequence())
    await asyncio.sleep(0.01)
    unload = asyncio.create_task(adapters.unload("a"))
    await asyncio.sleep(0.05)
    assert ("remove", lora_id) not in llm.calls  # still running
    with pytest.raises(ModelNotFound, match="being unloaded"):
        async with adapters.running("a"):
            pass
    release.set()
    await asyncio.gather(running, unload)
    assert ("remove", lora_id) in llm.calls and adapters.loaded() == []
    with pytest.raises(ModelNotFound, match="not loaded"):
        async with adapters.running("a"):
            pass


async def test_ids_are_stable_across_workers(adapter_dirs: dict[str, Path]) -> None:
    one, two = VllmLoras(FakeLLM(), settings()), VllmLoras(FakeLLM(), settings())
    await one.load("a", str(adapter_dirs["a"]))
    await two.load("b", str(adapter_dirs["b"]))
    await two.load("a", str(adapter_dirs["a"]))
    assert lora_request(one, "a").lora_int_id == lora_request(two, "a").lora_int_id
