"""GET /metrics: Prometheus text format (gateway/metrics/ says what is in it).

With auth on, it needs a key holding one of CONVEYOR_METRICS_SCOPES (default
``metrics,admin``); with auth off it is open, like every other route.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from gateway.auth import require_metrics
from gateway.metrics import CONTENT_TYPE
from gateway.state import StateDep

router = APIRouter(dependencies=[Depends(require_metrics())])


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    await state.metrics.refresh(state)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
