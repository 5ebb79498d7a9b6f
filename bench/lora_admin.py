"""LoRA admin latency through the gateway: ``POST /admin/loras`` (SQL commit, publish,
until a worker reports the adapter loaded) and ``DELETE /admin/loras/{name}``, and the
first request with a freshly loaded adapter.

Starts `conveyor up` (one aggregated worker, the demo model) on ``--redis-url``, writes
``--adapters`` random rank-8 adapters, then loads and unloads each in turn.

    .venv/bin/python -m bench.lora_admin [--adapters 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.servers import conveyor_server, running
from shared.demo.lora import write_demo_lora
from shared.demo.model import write_demo_model

MODEL = "bench-tiny"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.lora_admin", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/11")
    parser.add_argument("--adapters", type=int, default=8)
    return parser


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    return (
        f"p50 {statistics.median(ordered) * 1000:.0f} ms, min {ordered[0] * 1000:.0f} ms, "
        f"max {ordered[-1] * 1000:.0f} ms (n={len(ordered)})"
    )


def measure(base_url: str, folders: list[Path]) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"load": [], "first request": [], "unload": []}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for index, folder in enumerate(folders):
            name = f"bench-lora-{index}"
            started = time.perf_counter()
            body = {"name": name, "path": str(folder), "base_model": MODEL}
            client.post("/admin/loras", json=body).raise_for_status()
            loaded = time.perf_counter()
            request = {"model": name, "prompt": [1, 2, 3], "max_tokens": 1}
            client.post("/v1/completions", json=request).raise_for_status()
            answered = time.perf_counter()
            client.delete(f"/admin/loras/{name}").raise_for_status()
            timings["load"].append(loaded - started)
            timings["first request"].append(answered - loaded)
            timings["unload"].append(time.perf_counter() - answered)
    return timings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-lora-admin-") as scratch:
        root = Path(scratch)
        model = write_demo_model(root / "model")
        folders = [
            write_demo_lora(root / f"lora-{i}", base=model, seed=i) for i in range(args.adapters)
        ]
        server = conveyor_server(
            model,
            MODEL,
            args.redis_url,
            "float32",
            16,
            root,
            env_overrides={"CONVEYOR_ENABLE_LORA": "true"},
        )
        with running(server, startup_timeout_s=300) as up:
            timings = measure(up.base_url, folders)
    for what, values in timings.items():
        print(f"{what:>14}: {_ms(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
