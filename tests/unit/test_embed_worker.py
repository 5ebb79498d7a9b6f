"""The embed role: one EmbeddingEvent per job, acked with it; failures end cleanly."""

from __future__ import annotations

import struct
import time

from shared.errors import EngineError
from shared.protocol import EmbeddingEvent, EmbedJob, ErrorEvent
from shared.roles import Role
from tests.conftest import RedisTarget
from tests.unit.worker_harness import MODEL, REPLY, FakeEngine, worker
from workers.roles import embed


def embed_job(request_id: str, index: int = 0, *, dimensions: int | None = None) -> EmbedJob:
    now = time.time()
    return EmbedJob(
        request_id=request_id,
        index=index,
        model=MODEL,
        prompt_token_ids=[101, 7, 8, 102],
        reply_to=REPLY,
        deadline_unix=now + 60,
        created_unix=now,
        dimensions=dimensions,
    )


def floats(event: EmbeddingEvent) -> list[float]:
    return list(struct.unpack(f"<{len(event.vector) // 4}f", event.vector))


async def test_each_input_gets_its_embedding_and_is_acked(redis_target: RedisTarget) -> None:
    async with worker(redis_target, role=Role.EMBED, parts=embed.parts) as w:
        await w.submit(embed_job("e1", 0), embed_job("e1", 1, dimensions=2))
        events = await w.final_events("e1", sequences=2)
        await w.drained()
    by_index = {e.index: e for e in events}
    assert all(isinstance(e, EmbeddingEvent) for e in events)
    assert floats(by_index[0]) == [101.0, 7.0, 8.0, 102.0]  # type: ignore[arg-type]
    assert floats(by_index[1]) == [101.0, 7.0]  # type: ignore[arg-type]
    assert by_index[0].prompt_tokens == 4  # type: ignore[union-attr]


async def test_an_engine_error_ends_the_input_with_an_error_event(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine()
    engine.fail = (0, EngineError("pooling failed"))
    async with worker(redis_target, engine, role=Role.EMBED, parts=embed.parts) as w:
        await w.submit(embed_job("bad"))
        [event] = await w.final_events("bad")
        await w.drained()
    assert isinstance(event, ErrorEvent)
    assert "pooling failed" in event.message
