"""The live in-process gateway (tests/gateway/harness.py) for the async tests here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.catalog.served_models import ServedModel
from tests.gateway.harness import LiveGateway, live_gateway
from tests.waiting import eventually

KEEPALIVE_S = 0.05


@pytest.fixture
async def gateway(served_model: ServedModel) -> AsyncIterator[LiveGateway]:
    """A gateway with an echoing aggregated and embed worker. Every test ends with no
    request left open: each path through the gateway closes its request's handle."""
    async with live_gateway(served_model, sse_keepalive_s=KEEPALIVE_S) as live:
        yield live

        async def none_open() -> bool:
            return await live.open_requests() == 0

        await eventually(none_open, timeout_s=2.0, what="every request's route closed")
