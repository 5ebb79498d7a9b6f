"""A real cluster for fault injection: a private durable Redis, a gateway, N vLLM workers."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis

from conveyor.redis_server import stop_private_redis
from shared.queue import names
from shared.roles import Role
from tests.e2e.stack import Process, Stack, free_port, wait_until

MODEL_NAME = "chaos"


@dataclass
class Cluster:
    model_path: Path
    workdir: Path
    worker_env: dict[str, str] = field(default_factory=dict)
    redis_port: int = field(default_factory=free_port)
    redis_process: subprocess.Popen[bytes] | None = None
    stack: Stack | None = None
    gateway: Process | None = None
    base_url: str = ""
    workers: dict[str, Process] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    # ------------------------------------------------------------------ redis

    def start_redis(self) -> None:
        folder = self.workdir / "redis"
        folder.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server") or "redis-server"
        self.redis_process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(folder),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--maxmemory-policy",
                "noeviction",
                "--enable-debug-command",
                "local",
                "--logfile",
                str(folder / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.redis_port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        raise RuntimeError("chaos redis did not start")

    def kill_redis(self) -> None:
        assert self.redis_process is not None
        self.redis_process.send_signal(signal.SIGKILL)
        self.redis_process.wait()

    def redis_client(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, socket_timeout=15)

    # ---------------------------------------------------------------- conveyor

    def start(self, workers: int) -> None:
        self.start_redis()
        self.stack = Stack(self.model_path, MODEL_NAME, self.redis_url, self.workdir)
        for number in range(workers):
            self.start_worker(f"worker-{number}")
        # A queue cap of 1.5x what the workers run at once, so overload meets 429s.
        depth = str(48 * workers)
        self.gateway, self.base_url = self.stack.start_gateway(CONVEYOR_QUEUE_MAX_DEPTH=depth)
        self.wait_workers(workers)

    def start_worker(self, name: str) -> Process:
        assert self.stack is not None
        env = {"CONVEYOR_WORKER_MAX_SLOTS": "32", **self.worker_env}
        process = self.stack.start_worker(name, **env)
        self.workers[name] = process
        return process

    def wait_workers(self, count: int, timeout_s: float = 300) -> None:
        """Every worker process of this cluster serves: a restarted one included.

        Counted by process id, so the registry key a killed worker leaves behind (it lives
        until its TTL ends) does not stand in for its restarted successor.
        """
        assert self.gateway is not None
        wait_until(f"{self.base_url}/ready", status=200, process=self.gateway, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self.serving_workers()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.serving_workers())} of {count} workers serve")
            time.sleep(0.5)

    def serving_workers(self) -> list[str]:
        """Names of worker processes that are alive, registered and not draining."""
        registered = [w for w in self.live_workers() if not w.get("draining")]
        return [
            name
            for name, process in self.workers.items()
            if process.popen.poll() is None
            and any(f"-{process.popen.pid}-" in str(w["worker_id"]) for w in registered)
        ]

    def live_workers(self) -> list[dict[str, object]]:
        import json

        client = self.redis_client()
        try:
            found = list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
            values = client.mget(found) if found else []
            return [json.loads(v) for v in values if v]
        finally:
            client.close()

    def jobs_held(self) -> dict[str, int]:
        """Jobs each live worker process has read and not yet acked, by name.

        From the job stream's consumer group, so it is current the moment a worker reads
        a job; a heartbeat's ``active`` count can lag a short request by its whole run.
        """
        client = self.redis_client()
        by_consumer: dict[str, int] = {}
        try:
            stream = names.job_stream(MODEL_NAME, Role.AGGREGATED)
            # the shared stream and, with placement, every worker's own one
            for key in [stream, *client.scan_iter(names.worker_job_stream(stream, "*"))]:
                if not client.exists(key):
                    continue
                for c in client.xpending(key, names.JOB_GROUP).get("consumers") or []:
                    name = c["name"].decode()
                    by_consumer[name] = by_consumer.get(name, 0) + int(c["pending"])
        finally:
            client.close()
        return {
            name: sum(n for wid, n in by_consumer.items() if f"-{process.popen.pid}-" in wid)
            for name, process in self.workers.items()
            if process.popen.poll() is None
        }

    def engine_pid(self, worker: str) -> int:
        parent = psutil.Process(self.workers[worker].popen.pid)
        for child in parent.children(recursive=True):
            if "EngineCore" in " ".join(child.cmdline()) or child.name().startswith("VLLM::Engine"):
                return int(child.pid)
        raise LookupError(f"no engine process under {worker}")

    def admin_state(self) -> dict[str, object]:
        return dict(httpx.get(f"{self.base_url}/admin/state", timeout=10).json())

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop_all()
        if self.redis_process is not None and self.redis_process.poll() is None:
            stop_private_redis(self.redis_process)
