"""Observing many values at once leaves a histogram exactly as observing each one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from gateway.metrics.vllm import observe_all

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
VALUES = [0.0, 0.01, 0.0100001, 0.03, 0.05, 0.05, 0.7, 1.0, 2.5, 99.0, -1.0, 0.049]


def exposition(values: list[float], batched: bool) -> bytes:
    registry = CollectorRegistry()
    histogram = Histogram("h", "help", ["model_name"], buckets=BUCKETS, registry=registry)
    child = histogram.labels("m")
    if batched:
        observe_all(child, values)
    else:
        for value in values:
            child.observe(value)
    return b"\n".join(
        line for line in generate_latest(registry).splitlines() if b"_created" not in line
    )


@pytest.mark.parametrize("values", [VALUES, VALUES[:2], [], [0.2] * 64])
def test_the_same_buckets_count_and_sum(values: list[float]) -> None:
    assert exposition(values, batched=True) == exposition(values, batched=False)
