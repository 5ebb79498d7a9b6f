"""Start real Conveyor processes (gateway, vLLM workers) for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from workers.intake.janitor import SAFETY_NET_LOG

CONVEYOR = str(Path(sys.executable).with_name("conveyor"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: each stays bound until all are chosen (one at a
    time, the kernel may hand the port it just freed out again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, timeout_s: float = 30) -> int:
        self.terminate()
        return self.reap(time.monotonic() + timeout_s)

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def reap(self, deadline: float) -> int:
        """Wait for it to exit until ``deadline`` (``time.monotonic()``), then SIGKILL."""
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self.kill_group()
        return int(self.popen.returncode)

    def kill_group(self) -> None:
        """SIGKILL what is left in its process group (an engine core orphaned by a crash)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Stack:
    model_path: Path
    model_name: str
    redis_url: str
    log_dir: Path
    processes: list[Process] = field(default_factory=list)
    data_dir: Path | None = None
    """CONVEYOR_DATA_DIR of every process (the gateways' embedded SQLite state lives there):
    one per session, so no run writes into the checkout's ``.conveyor``."""

    def env(self, **overrides: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CONVEYOR_MODEL=str(self.model_path),
            CONVEYOR_SERVED_MODEL_NAME=self.model_name,
            CONVEYOR_REDIS_URL=self.redis_url,
            CONVEYOR_DTYPE="float32",
            CONVEYOR_LOG_LEVEL="INFO",
            CONVEYOR_SSE_KEEPALIVE_S="1",
        )
        if self.data_dir is not None:
            env["CONVEYOR_DATA_DIR"] = str(self.data_dir)
        env.update(overrides)
        return env

    def start(self, name: str, args: list[str], **env: str) -> Process:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:  # a restarted process keeps its predecessor's log
            popen = subprocess.Popen(
                [CONVEYOR, *args],
                env=self.env(**env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        process = Process(name, popen, log_path)
        self.processes.append(process)
        return process

    def start_worker(self, name: str = "worker", role: str = "aggregated", **env: str) -> Process:
        return self.start(name, ["worker", "--role", role], **env)

    def start_gateway(self, name: str = "gateway", **env: str) -> tuple[Process, str]:
        port = free_port()
        process = self.start(name, ["gateway", "--port", str(port)], **env)
        return process, f"http://127.0.0.1:{port}"

    def stop_all(self) -> None:
        stop_together(self.processes)

    def assert_no_safety_net(self) -> None:
        """A job served by the stale-entry reclaim means a delivery was lost: fail."""
        fired = [
            f"{path.name}: {line}"
            for path in sorted(self.log_dir.glob("*.log"))
            for line in path.read_text(errors="replace").splitlines()
            if SAFETY_NET_LOG in line
        ]
        if fired:
            raise AssertionError("the stale-entry safety net served jobs:\n" + "\n".join(fired))


def stop_together(processes: Iterable[Process], timeout_s: float = 30) -> None:
    """SIGTERM them all at once, then wait: a vLLM worker takes seconds to shut its engine
    down, and one after another those seconds add up."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.reap(deadline)


def wait_until(url: str, *, status: int, process: Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited:\n{process.log_tail()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not return {status} in {timeout_s}s:\n{process.log_tail()}")


def run_offline(script: str, request: dict[str, Any]) -> Any:
    """Run one of this folder's offline vLLM scripts (``offline_*.py``) in its own
    process on ``request`` (JSON on stdin) and return the JSON of its ``RESULT`` line."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script))],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])
