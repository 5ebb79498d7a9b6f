"""The stacks the placement benchmark compares: `conveyor up` with N workers (vLLM or
fake engines), one per variant, and the model they serve.

Fake-engine fleets get GPU-scale step timing and a KV cache per worker sized from the
workload: the fleet's cache holds ``kv_fleet_share`` times the workload's working set,
so one worker's cache holds only a fraction of it and placement decides the hits.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from bench.servers import ManagedServer, free_port
from shared.demo.model import DemoShape, write_demo_model
from shared.queue import names

PREFILL_SHAPE = DemoShape(
    hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, max_positions=8192
)
"""The benchmark's demo model: prefilling 2k tokens takes ~0.5 s on one CPU core (the
default demo model is far faster), and 8k tokens of context fit multi-turn histories."""


@dataclass(frozen=True, slots=True)
class FakeTiming:
    """GPU-scale step timing (an 8B model on one H100 under vLLM: prefill ~28k tokens/s,
    a decode step ~12 ms plus ~0.06 ms per sequence in the batch)."""

    step_base_ms: float = 12.0
    step_per_seq_us: float = 60.0
    prefill_per_token_us: float = 35.0
    prefill_chunk_tokens: int = 8192
    block_tokens: int = 16
    speedup: float = 1.0
    """Below 1 slows every step (e.g. 0.25: four times slower), so that on a small
    machine the simulated engines, not the CPU, set the latencies."""


@dataclass(frozen=True, slots=True)
class StackSpec:
    engine: str
    workers: int
    model: Path
    served_name: str
    dtype: str
    max_slots: int
    log_dir: Path
    fake: FakeTiming
    fake_kv_blocks: int


def ensure_model(path: Path) -> Path:
    """The benchmark's demo model at ``path`` (generated once, in ~10 s)."""
    path = path.resolve()
    if not (path / "config.json").exists():
        print(f"writing the benchmark's demo model to {path}", flush=True)
    return write_demo_model(path, shape=PREFILL_SHAPE)


def fake_kv_blocks(working_set_tokens: int, block_tokens: int, workers: int, share: float) -> int:
    """Blocks per worker so that the fleet holds ``share`` x the working set."""
    blocks = math.ceil(working_set_tokens / block_tokens)
    return max(1, math.ceil(share * blocks / workers))


def conveyor_stack(
    spec: StackSpec, redis_url: str, name: str, env_overrides: dict[str, str]
) -> ManagedServer:
    """`conveyor up` for one variant, on its own Redis db and state folder."""
    port = free_port()
    script = Path(sys.executable).with_name("conveyor")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "conveyor.cli"]
    command += ["up", "--port", str(port), "--model", str(spec.model)]
    command += ["--served-model-name", spec.served_name, "--redis-url", redis_url]
    command += ["--workers", str(spec.workers), "--engine", spec.engine]
    command += ["--data-dir", str(spec.log_dir / f"{name}-data")]
    command += ["--dtype", spec.dtype, "--worker-max-slots", str(spec.max_slots)]
    if spec.engine == "fake":
        command += _fake_flags(spec.fake, spec.fake_kv_blocks)
    env = {**os.environ, **env_overrides}
    return ManagedServer(name, command, env, port, "/ready", spec.log_dir / f"{name}.log")


def _fake_flags(timing: FakeTiming, kv_blocks: int) -> list[str]:
    return [
        "--fake-step-base-ms",
        str(timing.step_base_ms),
        "--fake-step-per-seq-us",
        str(timing.step_per_seq_us),
        "--fake-prefill-per-token-us",
        str(timing.prefill_per_token_us),
        "--fake-prefill-chunk-tokens",
        str(timing.prefill_chunk_tokens),
        "--fake-block-tokens",
        str(timing.block_tokens),
        "--fake-kv-blocks",
        str(kv_blocks),
        "--fake-speedup",
        str(timing.speedup),
    ]


def live_workers(redis_url: str, served_name: str) -> int:
    """Workers of ``served_name`` with a heartbeat in the db of ``redis_url``."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
        beats = [json.loads(value) for value in (client.mget(keys) if keys else []) if value]
    finally:
        client.close()
    return sum(beat.get("model") == served_name for beat in beats)


def wait_for_workers(redis_url: str, served_name: str, count: int, timeout_s: float) -> None:
    """The gateway is ready with one worker; a fleet is measured with all of them."""
    deadline = time.monotonic() + timeout_s
    while live_workers(redis_url, served_name) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} workers of {served_name} not up after {timeout_s:.0f}s")
        time.sleep(0.5)
