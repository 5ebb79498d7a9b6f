"""Conveyor's vLLM-named metrics against a real ``vllm serve`` on the same model.

    python -m bench.metrics_parity                  # the demo model (generated if missing)
    python -m bench.metrics_parity --model /models/qwen

Starts vLLM's OpenAI server (CPU: about a minute), sends it one streamed request so
every histogram has a series, reads its ``/metrics``, and compares each metric the
fleet-metrics issue lists with what Conveyor's gateway exports (built in process: the
same registry ``GET /metrics`` serves, with one worker's engine stats and one finished
request): the same type, and for histograms the same bucket bounds. Prints one line
per metric; exits 1 on any difference. CI checks the same against vLLM's source
(tests/unit/test_vllm_metrics.py); this is the check against the running server.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import running, vllm_server
from gateway.dispatch.request_tally import RequestTally
from gateway.metrics.vllm import ClientMetrics, EngineCollector
from shared.engine_stats import StatsRecorder
from shared.queue.liveness import WorkerRegistration
from shared.queue.usage import UsageRecord
from shared.roles import Role

LISTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
)
"""The metrics the issue names (vLLM's names; counters without ``_total``)."""

Shape = tuple[str, tuple[float, ...]]
"""A metric's type and, for a histogram, its bucket bounds."""


def shapes(text: str) -> dict[str, Shape]:
    found: dict[str, Shape] = {}
    for family in text_string_to_metric_families(text):
        bounds = sorted({float(s.labels["le"]) for s in family.samples if "le" in s.labels})
        found[family.name] = (family.type, tuple(bounds))
    return found


def conveyor_text(max_model_len: int) -> str:
    registry = CollectorRegistry()
    tally = RequestTally(received_unix=100.0, finish_reasons=["stop"], token_gaps_s=[0.02])
    record = UsageRecord(
        request_id="r", key_id=None, model="m", prompt_tokens=5, completion_tokens=2,
        status="completed", received_unix=100.0, finished_unix=101.0, first_token_unix=100.5,
    )  # fmt: skip
    ClientMetrics(registry, max_model_len).observe(record, tally)
    engines = EngineCollector()
    registry.register(engines)
    recorder = StatsRecorder()
    recorder.step(5)
    engines.set_workers(
        [
            WorkerRegistration(
                worker_id="w",
                role=Role.AGGREGATED,
                model="m",
                max_model_len=max_model_len,
                active=0,
                slots=1,
                engine_stats=recorder.snapshot(),
            )
        ]
    )
    return generate_latest(registry).decode()


def vllm_text(model: Path, served_name: str, startup_timeout_s: float) -> tuple[str, int]:
    """vLLM's /metrics after one streamed request, and its max_model_len."""
    with (
        tempfile.TemporaryDirectory() as logs,
        running(
            vllm_server(model, served_name, "float32", 4, Path(logs)), startup_timeout_s
        ) as server,
    ):
        base = server.base_url
        card = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
        body = {"model": served_name, "prompt": "hello", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as answer:
            answer.read()
        return httpx.get(f"{base}/metrics", timeout=10).text, int(card["max_model_len"])


def compare(theirs: dict[str, Shape], ours: dict[str, Shape]) -> list[str]:
    """One line per listed metric; those that differ start with ``DIFFERS``."""
    lines = []
    for name in LISTED:
        want, got = theirs.get(name), ours.get(name)
        same = want is not None and want == got
        verdict = "same" if same else "DIFFERS"
        lines.append(f"{verdict:8} {name:36} vllm={want} conveyor={got}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/demo-model"))
    parser.add_argument("--served-model-name", default="parity")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").exists():
        from shared.demo.model import write_demo_model

        write_demo_model(args.model)
    text, max_model_len = vllm_text(args.model, args.served_model_name, args.startup_timeout)
    lines = compare(shapes(text), shapes(conveyor_text(max_model_len)))
    print("\n".join(lines))
    return 1 if any(line.startswith("DIFFERS") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
