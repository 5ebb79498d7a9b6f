"""Which engine runs a language model: vLLM, SGLang on GPU boxes, or the fake engine
(no model: load and routing tests) (``--engine``).

The engine packages import their library lazily, so choosing one loads only it.
"""

from __future__ import annotations

from shared.settings import EngineKind, Settings
from workers.engines.base import EmbedEngine, PrefillEngine


def load_language_engine(settings: Settings, model_path: str, served_name: str) -> PrefillEngine:
    """An engine that generates and, in a prefill role, prefills (every engine does both)."""
    if settings.engine is EngineKind.FAKE:
        from workers.engines.fake.engine import FakeEngine

        return FakeEngine(settings, model_path, served_name)
    if settings.engine is EngineKind.SGLANG:
        from workers.engines.sglang.engine import SglangEngine

        return SglangEngine(settings, model_path, served_name)
    from workers.engines.vllm.engine import VllmEngine

    return VllmEngine(settings, model_path, served_name)


def load_embedding_engine(settings: Settings, model_path: str, served_name: str) -> EmbedEngine:
    """A pooling engine: vLLM, or the fake engine's deterministic unit vectors."""
    if settings.engine is EngineKind.FAKE:
        from workers.engines.fake.engine import FakeEngine

        return FakeEngine(settings, model_path, served_name)
    if settings.engine is not EngineKind.VLLM:
        raise ValueError(
            "embeddings are served by vLLM (or fake) workers (--engine vllm --role embed)"
        )
    from workers.engines.vllm.engine import VllmEngine

    return VllmEngine(settings, model_path, served_name)
