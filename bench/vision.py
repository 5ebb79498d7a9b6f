"""Image-request benchmark: TTFT with a cold vs a warm embedding cache, per topology.

    python -m bench.vision                      # tiny LLaVA demo model, three topologies
    python -m bench.vision --kind qwen2-vl --requests 16

For each topology (aggregated worker taking raw images; encode -> aggregated;
encode -> prefill -> decode) Conveyor is started with ``conveyor up``, then:

* cold: every request carries an image never seen before (the encoder runs);
* warm: the same images again, each with new text before it, so no KV prefix is
  shared and only the image embedding can be reused.

Requests stream one at a time (TTFT without queueing); images come from a local
HTTP server (allowed through ``CONVEYOR_IMAGE_PRIVATE_NETWORKS``) as a client's
URLs would. The table shows medians and p90s in milliseconds.
"""

from __future__ import annotations

import argparse
import http.server
import io
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.load import percentile
from bench.servers import conveyor_server, running

TOPOLOGIES = {
    "aggregated, raw images": ["--mode", "aggregated"],
    "encode -> aggregated": ["--mode", "aggregated", "--encode", "true"],
    "encode -> prefill -> decode": [
        "--mode",
        "disaggregated",
        "--encode",
        "true",
        "--disagg-min-prompt-tokens",
        "0",
    ],
}


def _noise_png(seed: int, size: int) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    image = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@contextmanager
def picture_server(pictures: dict[str, bytes]) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pictures.get(self.path.lstrip("/"), b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@dataclass(frozen=True)
class Row:
    topology: str
    cold_ms: list[float]
    warm_ms: list[float]
    cache_hits: int | None


def ttft_ms(client: httpx.Client, model: str, text: str, url: str, max_tokens: int) -> float:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    started = time.perf_counter()
    first: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()!r}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("no token arrived")
    return (first - started) * 1000


def measure(
    name: str,
    flags: list[str],
    args: argparse.Namespace,
    model: Path,
    base: str,
    log_dir: Path,
    db: int,
) -> Row:
    import os

    server = conveyor_server(
        model,
        "bench-vl",
        f"redis://127.0.0.1:6379/{db}",
        "float32",
        16,
        log_dir / name.replace(" ", "_").replace(">", ""),
    )
    server.command += flags
    server.env = {**os.environ, "CONVEYOR_IMAGE_PRIVATE_NETWORKS": "127.0.0.1/32"}
    cold: list[float] = []
    warm: list[float] = []
    with (
        running(server, 900),
        httpx.Client(base_url=server.base_url, timeout=300, trust_env=False) as client,
    ):
        words = ["tell", "me", "about", "this", "picture", "please"]
        ttft_ms(client, "bench-vl", "warm up", f"{base}/warmup.png", args.output_tokens)
        for i in range(args.requests):
            cold.append(
                ttft_ms(
                    client, "bench-vl", f"{words[i % 6]} {i}", f"{base}/{i}.png", args.output_tokens
                )
            )
        for i in range(args.requests):
            warm.append(
                ttft_ms(
                    client,
                    "bench-vl",
                    f"again {i} {words[(i + 3) % 6]}",
                    f"{base}/{i}.png",
                    args.output_tokens,
                )
            )
        time.sleep(1.5)  # the encode worker's next heartbeat carries the last counts
        hits = _cache_hits(f"redis://127.0.0.1:6379/{db}")
    print(
        f"  {name}: cold p50 {percentile(cold, 50):.1f} ms, warm p50 {percentile(warm, 50):.1f} ms",
        flush=True,
    )
    return Row(name, cold, warm, hits)


def _cache_hits(redis_url: str) -> int | None:
    import json

    import redis

    from shared.queue import names

    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN):
            value = client.get(key)
            stats = json.loads(value).get("embedding_cache") if value else None
            if stats:
                return int(stats["hits"])
    finally:
        client.close()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kind", choices=["llava", "qwen2-vl"], default="llava")
    parser.add_argument(
        "--model",
        type=Path,
        help="a vision-language model folder (default: the generated tiny demo model of --kind)",
    )
    parser.add_argument("--requests", type=int, default=12, help="images per phase")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument(
        "--topology",
        action="append",
        choices=list(TOPOLOGIES),
        help="run only these (repeatable; default: all)",
    )
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-vision-"))
    model = args.model
    if model is None:
        from shared.demo.model import write_demo_model

        model = write_demo_model(Path(f"/tmp/demo-model-{args.kind}"), kind=args.kind)
    pictures = {f"{i}.png": _noise_png(i, args.image_size) for i in range(args.requests)}
    pictures["warmup.png"] = _noise_png(10**6, args.image_size)
    rows = []
    with picture_server(pictures) as base:
        for db, name in enumerate(args.topology or list(TOPOLOGIES), start=7):
            rows.append(measure(name, TOPOLOGIES[name], args, model, base, log_dir, db))
    print(
        f"\nTTFT of image requests ({args.kind}, {args.image_size}x{args.image_size} PNG "
        f"over HTTP, one at a time, {args.requests} per phase), ms"
    )
    print(
        f"{'topology':<30} {'cold p50':>9} {'cold p90':>9} {'warm p50':>9} {'warm p90':>9} "
        f"{'cache hits':>10}"
    )
    for row in rows:
        hits = "-" if row.cache_hits is None else str(row.cache_hits)
        print(
            f"{row.topology:<30} {percentile(row.cold_ms, 50):>9.1f} "
            f"{percentile(row.cold_ms, 90):>9.1f} {percentile(row.warm_ms, 50):>9.1f} "
            f"{percentile(row.warm_ms, 90):>9.1f} {hits:>10}"
        )
    print(f"logs: {log_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
