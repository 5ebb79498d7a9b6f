"""Every metric the shipped Grafana dashboard (deploy/grafana) queries is on the gateway's
``/metrics`` page (the real app in process, a worker whose heartbeat carries engine
stats, one request of each kind so the labelled series exist)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from shared.engine_stats import EngineStats
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role
from tests.gateway.harness import BODIES, CHAT, LiveGateway

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "dashboards" / "conveyor.json"
METRIC = re.compile(r"\b(?:vllm:[a-z0-9_:]+|conveyor_[a-z0-9_]+)")


def queried_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    return {name for expr in exprs for name in METRIC.findall(expr)}


async def exposed_metrics(gateway: LiveGateway) -> set[str]:
    response = await gateway.client.get("/metrics")
    assert response.status_code == 200
    families = list(text_string_to_metric_families(response.text))
    counters = {f"{f.name}_total" for f in families if f.type == "counter"}  # before any
    return {f.name for f in families} | {s.name for f in families for s in f.samples} | counters


async def test_every_queried_metric_is_exposed(gateway: LiveGateway) -> None:
    cell = gateway.state.cells.for_model("tiny")
    await WorkerRegistry(cell.redis, ttl_s=60).beat(
        WorkerRegistration(
            worker_id="w-stats",
            role=Role.AGGREGATED,
            model="tiny",
            max_model_len=2048,
            active=0,
            slots=8,
            engine_stats=EngineStats(running=1, waiting=0, kv_cache_usage=0.1),
        )
    )
    await cell.directory.refresh()
    streamed = {**BODIES[CHAT], "max_tokens": 3, "stream": True}
    assert (await gateway.client.post(CHAT, json=streamed)).status_code == 200
    await gateway.state.cells.wait_background()
    queried = queried_metrics()
    assert {"vllm:num_requests_running", "vllm:e2e_request_latency_seconds_bucket"} <= queried
    missing = queried - await exposed_metrics(gateway)
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"
